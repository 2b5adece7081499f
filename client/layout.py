"""Records (named tensors, as they cross the wire and sit in client state) <-> the aligned
lists client rules work on (one tensor per trainable parameter, on the model's device)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

Named = "OrderedDict[str, torch.Tensor]"


class Layout:
    def __init__(self, model: nn.Module):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.device = next(model.parameters()).device
        self.others = OrderedDict((k, torch.zeros_like(v).cpu()) for k, v in model.state_dict().items()
                                  if k not in self.names)  # every other key a record must have
        self.keys = list(model.state_dict())

    def aligned(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """A record (or stored state) as a list aligned with the trainable parameters."""
        return [tensors[n].to(self.device) for n in self.names]

    def named(self, tensors: Sequence[torch.Tensor]) -> OrderedDict:
        """Aligned tensors -> named CPU tensors (client state)."""
        return OrderedDict((n, t.detach().cpu()) for n, t in zip(self.names, tensors))

    def full_record(self, tensors: Sequence[torch.Tensor]) -> OrderedDict:
        """Aligned tensors -> a record with every key of the model's state dict (uploads are
        checked against the model's layout); zeros where a key is not a trainable parameter."""
        by_name = self.named(tensors)
        return OrderedDict((k, by_name[k] if k in by_name else self.others[k]) for k in self.keys)
