"""Models: the zoo (run-config name -> builder(input_shape, num_classes)) and the user's own.

No model of the zoo contains BatchNorm or dropout: the SAM algorithms run two forward passes
per step, and both must see the same function of the weights.

The run-config key ``model`` also takes a reference to the user's own builder,
``package.module:callable`` (common/references.py): a callable taking ``(input_shape,
num_classes)`` or nothing and returning an ``nn.Module``. The text crosses processes, so it
works in every engine; each process (the ServerApp, every ClientApp) imports the module
itself. :func:`register_model` adds a name in this process only (the in-process engines).
A user's model is checked when it is first built in a process, each failure one line naming
the key and the reference: it must be an ``nn.Module`` with trainable parameters whose output
on a batch of 2 zero inputs (eval mode, no gradients) has shape ``(2, num_classes)``.

A user's model may hold buffers (BatchNorm's running statistics and counter): the run-config
key ``buffers`` says how they are combined (``global``: averaged by the server, ``local``:
kept by each client, FedBN-style); the algorithms' server rules see the trainable parameters
only (strategies/strategy.py), and the extra forward passes of a SAM step leave the running
statistics as the step's first pass left them (client/batch.py).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Callable

import torch
from torch import nn

from flatflower.common.references import BadReference, call, is_reference, resolve

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
# name -> builder added by register_model: this process only (the string reference is what
# crosses processes)
_REGISTERED: dict[str, Callable[..., nn.Module]] = {}
_CHECKED: set[tuple] = set()  # (name, input shape, classes) of the user's models checked here


def register_model(name: str, builder: Callable[..., nn.Module]) -> None:
    """Make ``model = name`` build ``builder(input_shape, num_classes)`` (or ``builder()``)
    **in this process only**: for the in-process engines and the Python API. Ray, ``flatflower
    local`` and a real deployment start other processes, which know nothing of it: give them
    a ``package.module:callable`` reference instead."""
    if not isinstance(name, str) or not name or name == "auto" or name in MODELS or is_reference(name):
        raise ValueError(f"register_model: {name!r} is not a new model name (not 'auto', not a zoo "
                         "name, not of the form package.module:callable)")
    if not callable(builder):
        raise ValueError(f"register_model: the builder of {name!r} is not callable")
    _REGISTERED[name] = builder
    _CHECKED.difference_update({k for k in _CHECKED if k[0] == name})


def known_model(name: str) -> bool:
    """Whether run-config ``model = name`` is valid here: a zoo name, a registered name, or a
    reference (its import is checked when the model is first built)."""
    return name in MODELS or name in _REGISTERED or is_reference(name)


def check_importable(name: str) -> None:
    """BadReference (one line naming the module) unless the module of a reference ``name``
    imports here: what a node's handshake checks, so that a SuperNode without the user's code
    is refused with that reason before any round."""
    if is_reference(name) and name not in _REGISTERED:
        resolve(name, "model")


def model_names() -> list[str]:
    """The names ``model`` takes besides references: the zoo's and the registered ones."""
    return [*MODELS, *_REGISTERED]


def _users_builder(name: str) -> Callable[[Shape, int], nn.Module]:
    """The builder of a registered name or a reference, each failure a BadReference."""
    fn = _REGISTERED.get(name) or resolve(name, "model")
    return lambda shape, classes: call(fn, (shape, classes), "model", name)


def check_model(model: object, name: str, input_shape: Shape, num_classes: int) -> None:
    """BadReference (one line) unless ``model`` is an ``nn.Module`` with trainable parameters
    whose output on 2 zero inputs of ``input_shape`` (eval mode, no gradients: no running
    statistic moves) has shape ``(2, num_classes)``."""
    where = f"model={name!r}"
    if not isinstance(model, nn.Module):
        raise BadReference(f"{where}: returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise BadReference(f"{where}: the model has no trainable parameters")
    x = torch.zeros((2, *input_shape), device=next(model.parameters()).device)
    out = _forward(model, x, f"{where}: its forward pass on a batch of 2 inputs of shape {tuple(input_shape)}")
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (2, num_classes):
        raise BadReference(f"{where}: its output on a batch of 2 inputs of shape {tuple(input_shape)} is "
                           f"{shape}, not (2, {num_classes}) (one logit per class of the dataset)")


def _forward(model: nn.Module, x: torch.Tensor, what: str):
    """``model(x)`` in eval mode without gradients or RNG draws (no running statistic moves, the
    global RNG stays as it was), its training mode restored; BadReference (one line: ``what``
    raised ...) when the forward pass raises."""
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return model(x)
    except Exception as err:  # noqa: BLE001 - the user's forward may raise anything
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise BadReference(f"{what} raised {type(err).__name__}{': ' + first if first else ''}") from None
    finally:
        model.train(was_training)


def check_output(model: nn.Module, name: str, x: torch.Tensor, sample: str) -> None:
    """ValueError (one line) unless ``model``'s output on the sample batch ``x`` (``sample``
    says what it is, for the message) is finite: a model whose output is NaN or inf before any
    training would fail every client's first step, round after round. Run before a run starts
    (server/setup.py), on the run's own data where the server has some."""
    out = _forward(model, x, f"model={name!r}: its forward pass on {sample}")
    if isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise ValueError(f"model={name!r}: its output on {sample} is not finite ({bad} of {out.numel()} "
                         "values are NaN or inf) before any training: check its forward pass and its "
                         "initial weights")


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, seed: int | None = None
) -> nn.Module:
    """Build model ``name`` (a zoo name, a registered name or a ``package.module:callable``
    reference); with ``seed``, its initial weights depend only on the seed.

    Seeding happens inside a forked CPU RNG, so torch's global RNG state is left unchanged
    (``torch.manual_seed`` would also queue a seed for every accelerator RNG, and costs more than
    building a small model). A user's model is checked (:func:`check_model`) the first time
    this process builds it for an input shape and number of classes.
    """
    shape = tuple(int(d) for d in input_shape)
    if name in MODELS:
        builder = MODELS[name]
    elif name in _REGISTERED or is_reference(name):
        builder = _users_builder(name)
    else:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(model_names())}, or a "
                         "reference package.module:callable")
    if seed is None:
        model = builder(shape, num_classes)
    else:
        with _SEEDED, torch.random.fork_rng(devices=[]):  # the lock: clients may build in threads
            torch.random.default_generator.manual_seed(seed)
            model = builder(shape, num_classes)
    if name not in MODELS and (name, shape, int(num_classes)) not in _CHECKED:
        check_model(model, name, shape, num_classes)
        _CHECKED.add((name, shape, int(num_classes)))
    return model


def buffer_names(model: nn.Module) -> list[str]:
    """The state-dict keys of ``model`` that are not trainable parameters (BatchNorm's running
    statistics and counter, frozen parameters): what the server never corrects."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return [k for k in model.state_dict() if k not in trainable]


class ModelPool:
    """Built models kept for reuse, one per call in flight: loading a record into a kept model
    costs about a tenth of building one (a seeded build also queues on the lock above)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[nn.Module]] = {}
        self._params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its parameters
        self._lock = threading.Lock()

    def take(self, name: str, input_shape: tuple[int, ...], num_classes: int,
             device: torch.device) -> tuple[tuple, nn.Module]:
        """(key, a model of this kind on ``device``): a kept one, else a new one (seed 0)."""
        key = (name, tuple(int(d) for d in input_shape), int(num_classes), str(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                return key, free.pop()
        model = build_model(name, input_shape, num_classes, seed=0).to(device)
        with self._lock:
            self._params[model] = list(model.parameters())
        return key, model

    def give(self, key: tuple, model: nn.Module) -> None:
        """Keep ``model`` for the next :meth:`take` of its kind (its gradients dropped)."""
        params = self._params.get(model)
        for p in model.parameters() if params is None else params:  # (walking the modules costs per call)
            p.grad = None
        with self._lock:
            self._free.setdefault(key, []).append(model)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
