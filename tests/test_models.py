"""Tests for common/models.py: shapes, parameter counts, seeding, no BN/dropout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatflower.common.models import MODELS, build_model, count_parameters

DIGITS = (1, 8, 8)
CIFAR = (3, 32, 32)
INTENDED_SHAPE = {
    "logreg": DIGITS,
    "mlp": DIGITS,
    "cnn": DIGITS,
    "cifar-cnn": CIFAR,
    "lenet": CIFAR,
    "lenet5": (1, 28, 28),
    "resnet18-gn": CIFAR,
}


def test_every_model_has_an_intended_shape() -> None:
    assert set(INTENDED_SHAPE) == set(MODELS)


@pytest.mark.parametrize("name", sorted(INTENDED_SHAPE))
def test_output_shape(name: str) -> None:
    shape = INTENDED_SHAPE[name]
    model = build_model(name, shape, 10, seed=0)
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("name", "shape"),
    [("resnet18-gn", (1, 28, 28)), ("lenet", (1, 28, 28)), ("cnn", (1, 28, 28)),
     ("cifar-cnn", (1, 28, 28)), ("logreg", (20,)), ("mlp", (20,))],
)
def test_other_input_shapes(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(name, shape, 7, seed=0)
    assert model(torch.randn(2, *shape)).shape == (2, 7)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("cifar-cnn", 2_156_490), ("lenet", 797_962), ("resnet18-gn", 11_181_642)],
)
def test_parameter_counts_match_the_papers(name: str, expected: int) -> None:
    assert count_parameters(build_model(name, CIFAR, 10, seed=0)) == expected


def test_lenet5_is_lecuns_61706_parameters_on_28x28() -> None:
    assert count_parameters(build_model("lenet5", (1, 28, 28), 10, seed=0)) == 61_706


def test_count_parameters_ignores_frozen() -> None:
    model = build_model("logreg", (20,), 10, seed=0)
    assert count_parameters(model) == 20 * 10 + 10
    model[1].bias.requires_grad_(False)
    assert count_parameters(model) == 20 * 10


@pytest.mark.parametrize("name", ["logreg", "cnn", "lenet"])
def test_seed_determines_weights(name: str) -> None:
    shape = INTENDED_SHAPE[name]
    a = build_model(name, shape, 10, seed=3).state_dict()
    b = build_model(name, shape, 10, seed=3).state_dict()
    c = build_model(name, shape, 10, seed=4).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_seeded_build_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    expected = torch.rand(5)
    torch.random.set_rng_state(state)
    build_model("cnn", DIGITS, 10, seed=123)
    assert torch.equal(torch.rand(5), expected)


def test_unseeded_build_uses_global_rng() -> None:
    torch.manual_seed(0)
    a = build_model("mlp", DIGITS, 10).state_dict()
    torch.manual_seed(0)
    b = build_model("mlp", DIGITS, 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'") as info:
        build_model("vgg", CIFAR, 10)
    for name in MODELS:
        assert name in str(info.value)


def test_image_model_rejects_flat_input() -> None:
    with pytest.raises(ValueError, match="cnn"):
        build_model("cnn", (20,), 10)


@pytest.mark.parametrize("name", sorted(INTENDED_SHAPE))
def test_no_batchnorm_or_dropout(name: str) -> None:
    model = build_model(name, INTENDED_SHAPE[name], 10, seed=0)
    banned = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    assert not [m for m in model.modules() if isinstance(m, banned)]


def test_resnet_uses_groupnorm_with_two_groups() -> None:
    model = build_model("resnet18-gn", CIFAR, 10, seed=0)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == 2 for m in norms)


def test_two_forward_passes_agree() -> None:
    """SAM evaluates the model twice; without BN/dropout train mode is deterministic."""
    model = build_model("resnet18-gn", CIFAR, 10, seed=0).train()
    x = torch.randn(2, *CIFAR)
    assert torch.equal(model(x), model(x))
