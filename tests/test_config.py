"""Tests for common/config.py: defaults, validation, CLI parsing and derived values."""

from __future__ import annotations

import json
import math
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from flatflower.common.config import ConfigError, RunConfig, defaults, flat_keys, general_fields, parse_assignments
from flatflower.strategies.registry import ALGORITHMS
from flatflower.common.datasets import DATASETS
from flatflower.common.params import PLACEHOLDER, is_unset
from tests.helpers import fast_config

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def app_config() -> dict:
    """[tool.flwr.app.config], flattened as Flower does (``sam.rho``)."""
    with open(PYPROJECT, "rb") as f:
        return flat_keys(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


DEFAULTS = defaults()


# ----------------------------------------------------------------------------- defaults
def test_defaults_equal_pyproject_key_by_key() -> None:
    toml = app_config()
    assert sorted(DEFAULTS) == sorted(toml)
    for key, value in toml.items():
        assert DEFAULTS[key] == value or is_unset(DEFAULTS[key]) and value == PLACEHOLDER, key
        if is_unset(DEFAULTS[key]):
            continue
        assert type(DEFAULTS[key]) is type(value), f"{key}: {type(DEFAULTS[key])} vs {type(value)}"


def test_pyproject_config_is_a_valid_run_config() -> None:
    assert RunConfig.from_mapping(app_config()) == RunConfig.from_mapping({}) == RunConfig.from_mapping(None)


def test_a_key_a_family_shares_has_one_declaration() -> None:
    """``sam.rho`` (and every shared key) means one thing, with one default and one check,
    in every algorithm that has it: the field objects are the very same."""
    declared: dict[str, set] = {}
    for spec in ALGORITHMS.values():
        for key, field in spec.params.fields().items():
            declared.setdefault(key, set()).add((field.default, field.metadata["meaning"]))
    assert all(len(v) == 1 for v in declared.values()), {k: v for k, v in declared.items() if len(v) > 1}
    assert all("." in key for key in declared), "algorithm keys are namespaced"
    assert not set(declared) & set(general_fields()), "the general config knows no algorithm key"


# ----------------------------------------------------------------------------- validation
INVALID = [
    ({"algorithm": "fedprox2"}, "algorithm='fedprox2' is not one of: dp-fedsam, fedacg, fedadam, fedasam, fedavg"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"lr": -0.1}, "lr must be a finite number > 0"),
    ({"lr": float("nan")}, "lr must be a finite number > 0 (got nan)"),
    ({"lr": "nan"}, "lr must be a finite number > 0 (got nan)"),
    ({"sam.rho": -0.01}, "sam.rho must be a finite number >= 0"),
    ({"fraction-train": 0.0}, "fraction-train must be in (0, 1]"),
    ({"fraction-train": 1.5}, "fraction-train must be in (0, 1]"),
    ({"fraction-evaluate": -0.1}, "fraction-evaluate must be in [0, 1]"),
    ({"dataset": "imagenet"}, "dataset='imagenet' is not one of"),
    ({"model": "vgg16"}, "model='vgg16' is not one of"),
    ({"partition": "zipf"}, "partition='zipf' is not one of"),
    ({"aggregation": "median"}, "aggregation='median' is not one of: uniform, weighted"),
    ({"batching": "sometimes"}, "batching='sometimes' is not one of: auto, off, on"),
    ({"sampling": "poisson"}, "sampling='poisson' is not one of: bernoulli, fixed"),
    ({"local-epochs": 0}, "local-epochs must be >= 1"),
    ({"batch-size": 0}, "batch-size must be >= 1"),
    ({"momentum": 1.0}, "momentum must be in [0, 1)"),
    ({"lr-decay": 0.0}, "lr-decay must be in (0, 1]"),
    ({"lr-decay": 1.5}, "lr-decay must be in (0, 1]"),
    ({"learning-rate": 0.1}, "unknown run-config key(s): learning-rate"),
    ({"lr": "abc"}, "lr='abc' is not a valid float"),
    ({"num-server-rounds": 1.5}, "num-server-rounds=1.5 is not a valid int"),
    ({"download": "maybe"}, "download='maybe' is not a valid bool"),
    ({"algorithm": 3}, "algorithm='3' is not one of: dp-fedsam, fedacg, fedadam, fedasam, fedavg"),
    ({"fedprox.mu": -0.1}, "fedprox.mu must be a finite number >= 0"),
    ({"fedspeed.alpha": 1.5}, "fedspeed.alpha must be in [0, 1]"),
    ({"fedlesam.first": "global"}, "fedlesam.first must be one of: initial, none (got 'global')"),
    ({"fedacg.lambda": 1.0}, "fedacg.lambda must be in [0, 1)"),
    ({"fedacg.beta": float("inf")}, "fedacg.beta must be a finite number >= 0 (got inf)"),
    ({"fedopt.eta": 0.0}, "fedopt.eta must be a finite number > 0"),
    ({"fedopt.beta2": 1.0}, "fedopt.beta2 must be in [0, 1)"),
    ({"fedopt.tau": 0.0}, "fedopt.tau must be a finite number > 0"),
    ({"algorithm": "fedadam", "server-lr": 0.5},
     "server-lr=0.5 has no effect on fedadam: its server step size is fedopt.eta"),
]


@pytest.mark.parametrize(("overrides", "expected"), INVALID,
                         ids=[f"{next(iter(o))}={next(iter(o.values()))!r}" for o, _ in INVALID])
def test_invalid_value_is_rejected_with_a_clear_message(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping(overrides)
    assert expected in str(err.value)


def test_unknown_key_message_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError, match="Valid keys: ") as err:
        RunConfig.from_mapping({"learning-rate": 0.1})
    listed = str(err.value).split("Valid keys: ", 1)[1].split(", ")
    assert listed == sorted(DEFAULTS)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({"lr": 0.0, "sam.rho": -1.0, "batch-size": 0})
    message = str(err.value)
    assert "lr must be a finite number > 0" in message and "sam.rho must be a finite number >= 0" in message
    assert "batch-size must be >= 1" in message


def test_replace_validates() -> None:
    cfg = RunConfig()
    assert cfg.replace(lr=0.5).lr == 0.5
    with pytest.raises(ConfigError, match="lr must be a finite number > 0"):
        cfg.replace(lr=-1.0)


def test_invalid_config_fails_before_training(tmp_path: Path) -> None:
    """The in-process runner refuses the config before it creates a run directory."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="lr must be a finite number > 0"):
        run_inprocess(fast_config(lr=0.0, run_dir=str(run_dir)), num_clients=2)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("False", False), ("1", True), ("0", False),
     (1, True), (0, False)],
)
def test_bool_coercion(value, expected: bool) -> None:
    assert RunConfig.from_mapping({"download": value}).download is expected


def test_numeric_coercion() -> None:
    cfg = RunConfig.from_mapping({"num-server-rounds": 3.0, "lr": 1, "seed": "7"})
    assert cfg.num_server_rounds == 3 and type(cfg.num_server_rounds) is int
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert cfg.seed == 7
    with pytest.raises(ConfigError, match="is not a valid int"):
        RunConfig.from_mapping({"seed": True})


# ----------------------------------------------------------------------------- CLI parsing
def test_parse_assignments_reads_toml_scalars_and_bare_words() -> None:
    values = parse_assignments([
        "num-server-rounds=5",
        "lr = 0.05",
        "sam.rho=1e-2",
        'dataset="fashion-mnist"',
        "algorithm=mofedsam",
        "download=false",
        "data-dir=/tmp/some dir",
        "run-dir=a=b",
    ])
    assert values == {
        "num-server-rounds": 5, "lr": 0.05, "sam.rho": 0.01, "dataset": "fashion-mnist",
        "algorithm": "mofedsam", "download": False, "data-dir": "/tmp/some dir", "run-dir": "a=b",
    }
    assert type(values["num-server-rounds"]) is int and type(values["lr"]) is float
    assert values["download"] is False
    cfg = RunConfig.from_mapping(values)
    assert (cfg.num_server_rounds, cfg.algorithm, cfg.download) == (5, "mofedsam", False)


def test_parse_assignments_true_and_empty_list() -> None:
    assert parse_assignments(["download=true"]) == {"download": True}
    assert parse_assignments([]) == {}


def test_parse_assignments_requires_equals_sign() -> None:
    with pytest.raises(ConfigError, match="--set expects key=value, got 'lr'"):
        parse_assignments(["lr"])


def test_parse_assignments_numeric_looking_string_value() -> None:
    cfg = RunConfig.from_mapping(parse_assignments(["run-dir=123", "data-dir=2024-01-01"]))
    assert (cfg.run_dir, cfg.data_dir) == ("123", "2024-01-01")
    assert RunConfig.from_mapping({"run-dir": 123}).run_dir == "123"  # flwr run -c run-dir=123


# ----------------------------------------------------------------------------- derived values
def test_round_lr_decays_geometrically() -> None:
    cfg = RunConfig.from_mapping({"lr": 0.1, "lr-decay": 0.5})
    assert cfg.round_lr(1) == pytest.approx(0.1)
    assert cfg.round_lr(2) == pytest.approx(0.05)
    assert cfg.round_lr(4) == pytest.approx(0.0125)
    constant = RunConfig.from_mapping({"lr": 0.3})
    assert [constant.round_lr(r) for r in (1, 5, 100)] == [0.3, 0.3, 0.3]


EXPECTED_AUTO_MODEL = {
    "digits": "mlp", "synthetic": "logreg", "synthetic-fedprox": "logreg", "mnist1d": "mlp",
    "synthetic-cifar10": "lenet", "mnist": "cnn", "fashion-mnist": "cnn", "cifar10": "lenet",
    "cifar100": "lenet",
}
GENERATED_PER_CLIENT = {"partition": "natural", "num-partitions": 4}


@pytest.mark.parametrize("dataset", DATASETS)
def test_resolved_model_auto_per_dataset(dataset: str) -> None:
    extra = GENERATED_PER_CLIENT if dataset == "synthetic-fedprox" else {}
    cfg = RunConfig.from_mapping({"dataset": dataset, **extra})
    assert cfg.model == "auto"
    assert cfg.resolved_model() == EXPECTED_AUTO_MODEL[dataset]
    assert RunConfig.from_mapping({"dataset": dataset, "model": "resnet18-gn", **extra}) \
        .resolved_model() == "resnet18-gn"


@pytest.mark.parametrize(("values", "message"), [
    ({"dataset": "synthetic-fedprox", "num-partitions": 4}, "use partition=natural"),
    ({"dataset": "synthetic-fedprox", "partition": "natural"}, "set num-partitions >= 1"),
    ({"dataset": "digits", "partition": "natural"}, "partition=natural needs a dataset generated"),
    ({"synthetic-alpha": -1.0}, "synthetic-alpha and synthetic-beta must be"),
])
def test_generated_per_client_dataset_rules(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


def test_to_dict_from_mapping_round_trip() -> None:
    cfg = RunConfig.from_mapping(fast_config(algorithm="mofedsam", lr=0.05, download=False,
                                             run_dir="runs/x", fraction_train=0.5,
                                             **{"mofedsam.beta": 0.4}))
    values = cfg.to_dict()
    assert sorted(values) == sorted([*general_fields(), *ALGORITHMS["mofedsam"].params.fields()])
    assert values["mofedsam.beta"] == 0.4 and cfg.params.beta == 0.4
    assert values["local-steps"] == 2 and values["algorithm"] == "mofedsam"
    assert RunConfig.from_mapping(values) == cfg
    # as written to config.json and read back
    assert RunConfig.from_mapping(json.loads(json.dumps(values))) == cfg


def test_defaults_mapping_matches_dataclass() -> None:
    for spec in ALGORITHMS.values():
        example = spec.example_config()
        values = RunConfig.from_mapping(example).to_dict()
        assert all(DEFAULTS[k] == v for k, v in values.items() if k not in example), spec.name
    # NaN is the placeholder of a required key only (FedGF's T_D), never a default
    unset = {k for k, v in DEFAULTS.items() if isinstance(v, float) and math.isnan(v)}
    assert unset == {k for spec in ALGORITHMS.values() for k in spec.params.examples()} == {"fedgf.threshold"}
