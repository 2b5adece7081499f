"""Model zoo: run-config name -> builder(input_shape, num_classes).

No model contains BatchNorm or dropout: the SAM algorithms run two forward passes per
step, and both must see the same function of the weights.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch
from torch import nn

Shape = tuple[int, ...]


def _logreg(input_shape: Shape, num_classes: int) -> nn.Module:
    """Multinomial logistic regression."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def _mlp(input_shape: Shape, num_classes: int) -> nn.Module:
    """One hidden layer of 128 ReLU units."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _image_dims(input_shape: Shape, model: str) -> tuple[int, int, int]:
    """(C, H, W) of an image input shape, or a ValueError naming the model."""
    if len(input_shape) != 3:
        raise ValueError(f"model {model!r} needs an image input (C, H, W), got {input_shape}")
    c, h, w = input_shape
    return c, h, w


def _two_conv_net(name: str, input_shape: Shape, num_classes: int, widths: tuple[int, int],
                  kernel: int, hidden: int) -> nn.Module:
    """conv-ReLU-pool twice ('same' padding, so H and W shrink by 4), then a 2-layer head."""
    c, h, w = _image_dims(input_shape, name)
    if h < 4 or w < 4:
        raise ValueError(f"model {name!r} needs H, W >= 4, got {input_shape}")
    pad = kernel // 2
    return nn.Sequential(
        nn.Conv2d(c, widths[0], kernel, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], kernel, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(widths[1] * (h // 4) * (w // 4), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def _cnn(input_shape: Shape, num_classes: int) -> nn.Module:
    """Small two-conv CNN sized for 8x8 digits (any C x H x W with H, W >= 4)."""
    return _two_conv_net("cnn", input_shape, num_classes, (16, 32), kernel=3, hidden=64)


def _cifar_cnn(input_shape: Shape, num_classes: int) -> nn.Module:
    """The FedAvg CIFAR CNN ("FedAvgNetCIFAR" of FedGMT): 2,156,490 parameters on CIFAR-10."""
    return _two_conv_net("cifar-cnn", input_shape, num_classes, (32, 64), kernel=5, hidden=512)


def _lenet_family(name: str, input_shape: Shape, num_classes: int, widths: tuple[int, int],
                  first_padding: int, hidden: tuple[int, int]) -> nn.Module:
    """Two 5x5 conv-ReLU-2x2-maxpool stages (the first padded by ``first_padding``), then two
    hidden ReLU layers and the classifier."""
    c, h, w = _image_dims(input_shape, name)
    fh, fw = ((h + 2 * first_padding - 4) // 2 - 4) // 2, ((w + 2 * first_padding - 4) // 2 - 4) // 2
    if fh < 1 or fw < 1:
        raise ValueError(f"model {name!r} needs H, W >= {16 - 2 * first_padding}, got {input_shape}")
    return nn.Sequential(
        nn.Conv2d(c, widths[0], 5, padding=first_padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(widths[1] * fh * fw, hidden[0]),
        nn.ReLU(),
        nn.Linear(hidden[0], hidden[1]),
        nn.ReLU(),
        nn.Linear(hidden[1], num_classes),
    )


def _lenet(input_shape: Shape, num_classes: int) -> nn.Module:
    """The FedDyn / FL-Simulator / FedTOGA "LeNet" (unpadded 5x5 convs)."""
    return _lenet_family("lenet", input_shape, num_classes, (64, 64), 0, (384, 192))


def _lenet5(input_shape: Shape, num_classes: int) -> nn.Module:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling: 6 and 16 5x5 filters (the first
    'same'-padded, as LeNet-5's 28x28 digits padded to 32x32), then 120, 84, classes; 61,706
    parameters on 1x28x28. The Fashion-MNIST benchmark's model (a twelfth of ``lenet``'s cost)."""
    return _lenet_family("lenet5", input_shape, num_classes, (6, 16), 2, (120, 84))


def _resnet18_gn(input_shape: Shape, num_classes: int) -> nn.Module:
    """torchvision ResNet-18 with GroupNorm(2, C) for BatchNorm; ImageNet stem kept."""
    from torchvision.models import resnet18

    c, _, _ = _image_dims(input_shape, "resnet18-gn")
    model = resnet18(
        weights=None, num_classes=num_classes, norm_layer=lambda ch: nn.GroupNorm(2, ch)
    )
    if c != 3:
        model.conv1 = nn.Conv2d(c, 64, 7, 2, 3, bias=False)
    return model


MODELS: dict[str, Callable[[Shape, int], nn.Module]] = {
    "logreg": _logreg,
    "mlp": _mlp,
    "cnn": _cnn,
    "cifar-cnn": _cifar_cnn,
    "lenet": _lenet,
    "lenet5": _lenet5,
    "resnet18-gn": _resnet18_gn,
}


_SEEDED = threading.Lock()


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, seed: int | None = None
) -> nn.Module:
    """Build model ``name``; with ``seed``, its initial weights depend only on the seed.

    Seeding happens inside a forked CPU RNG, so torch's global RNG state is left unchanged
    (``torch.manual_seed`` would also queue a seed for every accelerator RNG, and costs more than
    building a small model).
    """
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}") from None
    shape = tuple(int(d) for d in input_shape)
    if seed is None:
        return builder(shape, num_classes)
    with _SEEDED, torch.random.fork_rng(devices=[]):  # the lock: clients may build in threads
        torch.random.default_generator.manual_seed(seed)
        return builder(shape, num_classes)


class ModelPool:
    """Built models kept for reuse, one per call in flight: loading a record into a kept model
    costs about a tenth of building one (a seeded build also queues on the lock above)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[nn.Module]] = {}
        self._lock = threading.Lock()

    def take(self, name: str, input_shape: tuple[int, ...], num_classes: int,
             device: torch.device) -> tuple[tuple, nn.Module]:
        """(key, a model of this kind on ``device``): a kept one, else a new one (seed 0)."""
        key = (name, tuple(int(d) for d in input_shape), int(num_classes), str(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                return key, free.pop()
        return key, build_model(name, input_shape, num_classes, seed=0).to(device)

    def give(self, key: tuple, model: nn.Module) -> None:
        """Keep ``model`` for the next :meth:`take` of its kind (its gradients dropped)."""
        for p in model.parameters():
            p.grad = None
        with self._lock:
            self._free.setdefault(key, []).append(model)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
