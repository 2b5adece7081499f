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
    ``initial_weights()`` rebuilds the run's initial global model w^0; ``lr`` is this round's
    local learning rate (SCAFFOLD's control variates are in gradient units). The
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
        lr: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.broadcast = broadcast
        self.state = state
        self.initial_weights = initial_weights  # w^0 of the run (rebuilt from the seed) on demand
        self.lr = cfg.lr if lr is None else lr
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.device = next(model.parameters()).device
        # Broadcast tensors aligned with the trainable parameters, on the model's device.
        self.broadcast_params = {
            rec: self.aligned(tensors) for rec, tensors in broadcast.items()
        }

    # -- helpers for subclasses
    def aligned(self, tensors: Named) -> list[torch.Tensor]:
        """Named tensors (a record or stored state) as a list aligned with the trainable
        parameters, on the model's device."""
        return [tensors[n].to(self.device) for n in self.names]

    def stored(self, record: str) -> list[torch.Tensor] | None:
        """A record of this client's state, aligned; None before its first round."""
        tensors = self.state.get(record)
        return None if tensors is None else self.aligned(tensors)

    def named(self, tensors: list[torch.Tensor]) -> Named:
        """Aligned tensors -> named CPU tensors (for state)."""
        return OrderedDict((n, t.detach().cpu()) for n, t in zip(self.names, tensors))

    def full_record(self, model: nn.Module, tensors: list[torch.Tensor]) -> Named:
        """Aligned tensors -> a record with every key of the model's state dict (uploads are
        checked against the model's layout); zeros where a key is not a trainable parameter."""
        by_name = dict(zip(self.names, tensors))
        return OrderedDict((k, by_name[k].detach().cpu() if k in by_name else torch.zeros_like(v).cpu())
                           for k, v in model.state_dict().items())

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
