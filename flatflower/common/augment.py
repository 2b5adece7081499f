"""Augmentation of local training batches: ``train-transform``.

``none`` (the default) | ``crop-flip`` | ``package.module:callable``. A transform sees a raw
batch (float N x C x H x W, ``x / scale``, before the per-channel standardisation:
common/datasets.py ``Split.get(index, augment=...)``) and returns one of the same shape. It is
applied to the clients' local training batches only: never to the self-reports, the federated
or the central evaluation.

Its random draws come from a generator of its own, a function of (seed, round, partition) like
the client's shuffling generator (client/train.py ``round_generator``) but on another stream:
the shuffling is the same with or without augmentation, a run with ``none`` is bit for bit what
it was before this key existed, and a run with ``crop-flip`` repeats bit for bit and agrees
across the engines (each draws a client's batches in the same order, through
``TrainCall.batch``). The generator is a CPU ``torch.Generator``: draws are made on the CPU and
moved to the batch's device (a few numbers per sample), so a GPU run draws the same crops.

``crop-flip`` is the CIFAR papers' augmentation (torchvision's ``RandomCrop(32, padding=4)`` and
``RandomHorizontalFlip()``): zero-pad 4 pixels, crop a random H x W window, flip horizontally with
probability 1/2; drawn per sample. A user's ``module:callable`` takes ``(x, generator)`` and
returns the augmented batch (same shape, floating point).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

AUGMENT_STREAM = 1  # the augmentation's stream of (seed, round, partition); the shuffling's has none
PADDING = 4


class TransformError(ValueError):
    """A train-transform that cannot be used with this data (one line)."""


def augment_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The augmentation's RNG: a function of (seed, round, partition) only, independent of the
    shuffling RNG of the same triple."""
    state = np.random.SeedSequence([seed, server_round, partition_id, AUGMENT_STREAM]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = PADDING) -> torch.Tensor:
    """Per sample: zero-pad ``padding`` pixels on every side, take a random H x W window (top
    and left offsets uniform in [0, 2 padding]), flip it horizontally with probability 1/2.
    Draw order: the N top offsets, the N left offsets, the N flips."""
    n, _, h, w = x.shape
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
    padded = F.pad(x, (padding, padding, padding, padding))
    rows = top[:, None] + torch.arange(h, device=x.device)  # (N, H)
    cols = left[:, None] + torch.arange(w, device=x.device)  # (N, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    samples = torch.arange(n, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[samples, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


@dataclass
class Augment:
    """A train-transform bound to one client's round: ``augment(x)`` draws from its generator."""

    fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor]
    generator: torch.Generator
    name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise TransformError(f"train-transform={self.name!r} needs image batches (N, C, H, W), got {tuple(x.shape)}")
        out = self.fn(x, self.generator)
        if self.fn is not crop_flip:
            _check_output(self.name, x, out)
        return out


def transform_function(name: str) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None:
    """The function ``train-transform`` names (None for ``none``); a reference is resolved here
    (flatflower.common.references: one-line BadReference)."""
    if name == "none":
        return None
    if name == "crop-flip":
        return crop_flip
    from flatflower.common.references import resolve

    return resolve(name, "train-transform")


def train_augment(name: str, seed: int, server_round: int, partition_id: int) -> Augment | None:
    """The augmentation of one client's local training in one round, or None (``none``)."""
    fn = transform_function(name)
    if fn is None:
        return None
    if fn is not crop_flip:
        fn = _user_transform(fn, name)
    return Augment(fn, augment_generator(seed, server_round, partition_id), name)


def check_train_transform(name: str, data) -> None:
    """Refuse, before anything starts, a train-transform the dataset (a FederatedDataset)
    cannot take: crop-flip and a user's transform need images (C, H, W); a user's transform is
    called once on a few raw training samples and must return a floating batch of their shape."""
    if name == "none":
        return
    if len(data.input_shape) != 3:
        raise TransformError(f"train-transform={name!r} needs image data (C, H, W); the samples of dataset "
                             f"{data.name!r} have shape {tuple(data.input_shape)}")
    augment = train_augment(name, 0, 0, 0)
    if augment is not None and augment.fn is not crop_flip:
        augment(data.train.x[:4].float() / data.train.scale)


def _user_transform(fn: Callable, name: str) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    from flatflower.common.references import BadReference, call

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        try:
            return call(fn, (x, generator), "train-transform", name)
        except BadReference as err:
            raise TransformError(str(err)) from None

    return apply


def _check_output(name: str, x: torch.Tensor, out: object) -> None:
    if not isinstance(out, torch.Tensor):
        raise TransformError(f"train-transform={name!r} returned {type(out).__name__}, not a tensor")
    if out.shape != x.shape:
        raise TransformError(f"train-transform={name!r} returned shape {tuple(out.shape)} for a batch of "
                             f"shape {tuple(x.shape)}; it must keep the shape")
    if not out.is_floating_point():
        raise TransformError(f"train-transform={name!r} returned {out.dtype}; it must return floating point")
