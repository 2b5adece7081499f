"""What every dataset is made of: splits held compactly in memory, and the error of a dataset
that cannot be had. The built-in datasets (common/datasets.py) and the user's own
(common/userdata.py) build these; flatflower.common.datasets re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch


class DatasetUnavailableError(RuntimeError):
    """A dataset is not on disk and could not be downloaded."""


@dataclass
class Split:
    """Samples ``x`` (stored compactly) with int64 labels ``y`` and how to normalise x."""

    x: torch.Tensor
    y: torch.Tensor
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    scale: float = 1.0

    def __len__(self) -> int:
        return self.y.shape[0]  # (len(tensor) takes torch's Python-level path)

    def get(self, index: torch.Tensor | slice,
            augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 inputs (x / scale, then per-channel standardised) and int64 labels;
        ``augment`` (a local training batch's train-transform, common/augment.py) acts on the
        raw x / scale, before the standardisation, as torchvision's transforms do."""
        return self.inputs(self.x[index], augment), self.y[index].long()

    def inputs(self, stored: torch.Tensor,
               augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Stored rows of x (of this split, or of any split that normalises as it does: one
        element-wise map, so rows of many clients may go through it at once) -> the float32
        inputs :meth:`get` gives."""
        x = stored.float() / self.scale
        if augment is not None:
            x = augment(x)
        if self.mean is not None and self.std is not None:
            view = (1, -1) + (1,) * (x.dim() - 2)
            mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(view)
            std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(view)
            x = (x - mean) / std
        return x

    def normalisation(self) -> tuple:
        """What :meth:`inputs` depends on besides the rows, as a hashable tuple (a mean or std
        given as a list or an array becomes a tuple of floats): splits with equal ones map
        rows alike."""
        def numbers(values):
            return None if values is None else tuple(float(v) for v in values)

        return (self.x.dtype, tuple(self.x.shape[1:]), self.x.device, float(self.scale),
                numbers(self.mean), numbers(self.std))

    def to(self, device: torch.device | str) -> Split:
        """The split on ``device``. A client's partition is small (CIFAR-10, 100 clients: 1.5 MB
        as uint8), so a GPU client keeps all of it on the GPU and builds every batch there: no
        per-batch host-to-device copies, no pinned-memory staging and no loader workers."""
        return replace(self, x=self.x.to(device), y=self.y.to(device))

    def subset(self, indices: Sequence[int] | np.ndarray) -> Split:
        """The rows ``indices``, with the same normalisation."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return replace(self, x=self.x[idx], y=self.y[idx])


@dataclass
class FederatedDataset:
    """A dataset's train and test splits and what a model needs to know about it."""

    name: str
    train: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    # generated per client (synthetic-fedprox): the client each train / test sample belongs to
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
