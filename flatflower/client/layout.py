"""Records (named tensors, as they cross the wire and sit in client state) <-> the aligned
lists client rules work on (one tensor per trainable parameter, on the model's device)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Layout:
    def __init__(self, model: nn.Module):
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]  # the model's own trainable parameters
        self.device = next(model.parameters()).device
        self.state = model.state_dict(keep_vars=True)  # the model's own tensors, by key
        self.others = OrderedDict((k, torch.zeros_like(v).detach().cpu()) for k, v in self.state.items()
                                  if k not in self.names)  # every other key a record must have
        self.keys = list(self.state)
        self.buffers = list(self.others)  # the non-trainable entries (BatchNorm statistics, ...)

    @classmethod
    def of(cls, model: nn.Module) -> Layout:
        """The layout of ``model``, made once per model object (a model's structure does not
        change; the engines reuse their models, and walking the modules costs per call)."""
        layout = _LAYOUTS.get(model)
        if layout is None:
            layout = _LAYOUTS[model] = cls(model)
        return layout

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a record into the model, as ``load_state_dict(strict=True)``: the same keys
        and shapes, or an error saying which differ."""
        if tensors.keys() != self.state.keys():
            missing = sorted(set(self.state) - set(tensors))
            unexpected = sorted(set(tensors) - set(self.state))
            raise RuntimeError(f"record does not fit the model: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        with torch.no_grad():
            for key, target in self.state.items():
                value = tensors[key]
                if value.shape != target.shape:
                    raise RuntimeError(f"record key {key!r} has shape {list(value.shape)}, "
                                       f"the model's is {list(target.shape)}")
                target.copy_(value)

    def own_buffers(self) -> OrderedDict:
        """Copies of the model's non-trainable entries (``buffers = local``: the client's own)."""
        return OrderedDict((k, self.state[k].detach().cpu().clone()) for k in self.buffers)

    def load_buffers(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a client's own buffers (:meth:`own_buffers`) into the model, over what it received."""
        if list(tensors) != self.buffers:
            raise RuntimeError(f"the client's stored buffers {sorted(tensors)[:5]} do not fit the "
                               f"model's {self.buffers[:5]}")
        with torch.no_grad():
            for key in self.buffers:
                self.state[key].copy_(tensors[key])

    def weights(self) -> OrderedDict:
        """The model's current state dict (detached views of its tensors)."""
        return OrderedDict((k, v.detach()) for k, v in self.state.items())

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
