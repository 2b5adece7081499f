"""What every client half provides: the direction of one local step, and its uploads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from common.config import RunConfig

Named = "OrderedDict[str, torch.Tensor]"


class ClientAlgorithm:
    """Client half of an algorithm.

    ``broadcast`` holds the extra records the server sent this round (by record name);
    ``state`` the client's persistent records from earlier rounds (empty at first);
    ``initial_weights()`` rebuilds the run's initial global model w^0. The
    local loop calls :meth:`direction` once per local step and applies it with SGD (weight
    decay, momentum and clipping are the loop's job). After training, :meth:`uploads` and
    :meth:`new_state` say what goes to the server and what the client keeps.
    """

    def __init__(
        self,
        cfg: RunConfig,
        model: nn.Module,
        broadcast: dict[str, OrderedDict[str, torch.Tensor]],
        state: dict[str, OrderedDict[str, torch.Tensor]],
        initial_weights: Callable[[], OrderedDict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.broadcast = broadcast
        self.state = state
        self.initial_weights = initial_weights  # w^0 of the run (rebuilt from the seed) on demand
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        device = next(model.parameters()).device
        # Broadcast tensors aligned with the trainable parameters, on the model's device.
        self.broadcast_params = {
            rec: [tensors[n].to(device) for n in names] for rec, tensors in broadcast.items()
        }

    def direction(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[float, list[torch.Tensor]]:
        """(loss at the current weights, update direction per trainable parameter)."""
        raise NotImplementedError

    def uploads(self, model: nn.Module) -> dict[str, OrderedDict[str, torch.Tensor]]:
        """Extra records for the server, besides the local model."""
        return {}

    def new_state(self, model: nn.Module) -> dict[str, OrderedDict[str, torch.Tensor]]:
        """Records to keep on this client until its next round."""
        return {}
