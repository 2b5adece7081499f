"""Typed, validated run configuration.

The general keys (data, participation, local training, reliability, output) shared by the
ServerApp, every ClientApp and the CLI, plus the run's algorithm's own params
(``cfg.params``: common/params.py, declared beside each client half). Flower hands them over
as ``context.run_config`` (``[tool.flwr.app.config]`` fused with ``flwr run -c`` overrides);
the Python simulation API hands over nothing, so every default also lives here and in the
params classes (tests keep them and pyproject.toml equal).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from flatflower.common.params import Range


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range."""


AGGREGATORS = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan", "norm-clip",
               "centered-clip")
MAX_SECONDS = 10_000_000.0  # ~116 days: any longer timeout is a typo (and overflows timers)
MAX_INT = 2**31 - 1  # whole-number keys travel as 64-bit ints and index tensors
MAX_SEED = 2**32 - 1  # numpy's and torch's seeds
TRAIN_TRANSFORMS = ("none", "crop-flip")  # built-in augmentations (client/augment.py)


@dataclass(frozen=True)
class RunConfig:
    """All hyperparameters of one run. Field ``foo_bar`` is run-config key ``foo-bar``."""

    algorithm: str = "fedsam"
    num_server_rounds: int = 10
    seed: int = 0
    # data and model
    dataset: str = "digits"
    data_dir: str = ""
    download: bool = True
    model: str = "auto"  # a zoo name, or the user's own: package.module:callable (common/models.py)
    # what happens to a model's buffers (BatchNorm's running statistics): "global" = the server
    # averages them (float: weighted mean; integer counters: the maximum), "local" = each client
    # keeps its own (FedBN-style) and the server's averaged ones serve its central evaluation
    buffers: str = "global"
    partition: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    partition_seed: int = -1
    # a validation split carved from the training split before partitioning (flatflower tune's
    # objective): this fraction of each class, drawn with the partition seed, is trained on by no
    # client and is what the server evaluates instead of the test split (0 = none: the test split)
    validation_fraction: float = 0.0
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    # the user's own data (common/userdata.py) and Flower Datasets' partitioners
    csv_label: str = "label"  # dataset = csv: the label column
    classes: str = ""  # dataset = imagefolder: class names in label order ("" = sorted train/ folders)
    image_size: int = 0  # dataset = imagefolder: resize to a square (0 = all images share one size)
    num_classes: int = 0  # the user's data: the number of classes (0 = inferred from the labels)
    partition_args: str = ""  # partition = fds:<Partitioner>: its keyword arguments, "alpha=0.5, ..."
    # the model's input without a dataset on the server (partition = local): "1,8,8"
    input_shape: str = ""
    # partition = local: the largest training (or held-out) set a node may declare at its handshake
    max_node_examples: int = 10_000_000
    # participation and server
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    evaluate_every: int = 1  # federated evaluation every K rounds (and the last), with fraction-evaluate > 0
    sampling: str = "fixed"
    num_partitions: int = 0  # N; 0 = the number of nodes connected when round 1 starts
    min_available_nodes: int = 1
    node_wait_timeout: float = 120.0
    round_timeout: float = 600.0
    aggregation: str = "weighted"
    aggregator: str = "mean"
    aggregator_f: int = 1
    aggregator_trim: float = 0.2
    aggregator_clip: float = 0.0
    aggregator_iterations: int = 3
    server_lr: float = 1.0
    # reliability: failed clients, bad updates, checkpoints
    min_replies: int = 1
    too_few_replies: str = "skip"
    max_retries: int = 1
    outlier_norm_factor: float = 0.0
    checkpoint_every: int = 1
    client_state_dir: str = ""
    resume: bool = False
    # local training
    lr: float = dataclasses.field(default=0.1, metadata={"search": Range(0.001, 0.3, log=True)})  # FedNSAM's grid
    lr_decay: float = 1.0
    local_epochs: int = 5
    local_steps: int = 0
    batch_size: int = 32
    weight_decay: float = 0.0
    momentum: float = 0.0
    clip_norm: float = 0.0
    amp: str = "off"
    batching: str = "auto"  # vectorised engine: auto (a rule over the model's FLOPs, recorded) | on | off
    compile: str = "off"  # vectorised engine: on = its batched step under torch.compile
    eval_batch_size: int = 512
    # the server's own evaluation and flatness measurements (server/run.py): their device, and
    # their CPU threads when it is the CPU (1: today's server, which leaves the cores to clients)
    server_device: str = "cpu"
    server_threads: int = 1
    train_transform: str = "none"  # augmentation of local training batches: none | crop-flip | module:callable
    client_eval: bool = True  # clients report loss/accuracy before and after training (clients.jsonl)
    # client-level differential privacy (common/privacy.py): each client clips its round update
    # to dp.clip and adds Gaussian noise; 0 = off
    dp_clip: float = dataclasses.field(default=0.0, metadata={"key": "dp.clip"})
    dp_noise_multiplier: float = dataclasses.field(default=0.0, metadata={"key": "dp.noise-multiplier"})
    dp_delta: float = dataclasses.field(default=1e-5, metadata={"key": "dp.delta"})
    dp_clip_mode: str = dataclasses.field(default="global", metadata={"key": "dp.clip-mode"})
    # output
    run_dir: str = ""
    tensorboard: bool = True  # TensorBoard event files in the run directory (when installed)
    # flatness of the global model on the evaluation split (common/flatness.py), every K rounds
    flatness_every: int = 0  # K; 0 = off (flatness_distance is written every round regardless)
    flatness_rho: float = 0.05  # the radius of ``sharpness``
    flatness_iters: int = 20  # power-iteration steps at most (``hessian_max_eig``)
    flatness_probes: int = 10  # Hutchinson probes (``hessian_trace``)
    # the algorithm's own hyperparameters (``<namespace>.<key>``), parsed by its spec
    params: Any = dataclasses.field(default=None, metadata={"internal": True})

    # ------------------------------------------------------------------ building
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None = None) -> RunConfig:
        """Build from run-config keys (``num-server-rounds``, ``fedtoga.alpha``); unset keys
        keep their defaults. Keys of other algorithms are accepted (Flower's run config holds
        every default) and ignored; the run's algorithm's params are parsed and checked."""
        values = dict(values or {})
        _load_algorithm(values.get("algorithm"))
        by_key = general_fields()
        known = set(by_key) | set(algorithm_fields())
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown run-config key(s): {', '.join(unknown)}"
                f"{did_you_mean(unknown[0], known)}. Valid keys: {', '.join(sorted(known))}"
            )
        kwargs = {by_key[k].name: _coerce(k, v, by_key[k].type) for k, v in values.items() if k in by_key}
        cfg = cls(**kwargs)
        params = algorithm_params().get(cfg.algorithm)
        if params is not None:
            cfg = dataclasses.replace(cfg, params=params.parse(values, _coerce))
        cfg.validate(others=_other_algorithms_problems(values, cfg))
        return cfg

    @classmethod
    def parsed(cls, values: Mapping[str, Any]) -> RunConfig:
        """:meth:`from_mapping`, remembered (:func:`remembered_by_items`): a client parses the
        same run config at every call (about a millisecond each)."""
        return _parsed(values)

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with some general fields changed (snake_case names); the params
        are kept, or take the new algorithm's defaults when ``algorithm`` changes."""
        return RunConfig.from_mapping({**self.to_dict(), **{_key(k): v for k, v in changes.items()}})

    def to_dict(self) -> dict[str, Any]:
        """Run-config keys -> values (what ``flwr run -c`` and config.json hold): the general
        keys and the run's algorithm's params."""
        general = {k: getattr(self, f.name) for k, f in general_fields().items()}
        return {**general, **(self.params.to_dict() if self.params is not None else {})}

    # ---------------------------------------------------------------- validation
    def validate(self, others: list[str] | None = None) -> None:
        """Raise ConfigError listing every invalid value (``others``: problems found in keys of
        other algorithms given with it)."""
        from flatflower.common import datasets, fds, models, partition, userdata
        from flatflower.common.references import is_reference

        problems: list[str] = []

        def choice(name: str, valid) -> None:
            value = getattr(self, name)
            if value not in valid:
                problems.append(
                    f"{_key(name)}={value!r} is not one of: {', '.join(sorted(valid))}"
                    f"{did_you_mean(str(value), valid)}"
                )

        def check(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        if self.algorithm not in algorithm_params():
            problems.append(f"algorithm={self.algorithm!r} is not one of: {', '.join(sorted(algorithm_params()))}, "
                            f"or a reference package.module:callable to your own{did_you_mean(str(self.algorithm), algorithm_params())}")
        if not userdata.is_user_dataset(self.dataset):
            choice("dataset", datasets.DATASETS + userdata.FORMATS)
        if self.model != "auto" and not models.known_model(self.model):
            names = ("auto", *models.model_names())
            problems.append(f"model={self.model!r} is not one of: {', '.join(sorted(names))}, or a "
                            f"reference package.module:callable{did_you_mean(str(self.model), names)}")
        choice("buffers", ("global", "local"))
        if not fds.is_fds(self.partition):
            choice("partition", (*partition.PARTITIONS, partition.LOCAL))
        problems.extend(fds.problems(self.partition, self.partition_args))
        choice("sampling", ("fixed", "bernoulli"))
        choice("aggregation", ("weighted", "uniform"))
        choice("aggregator", AGGREGATORS)
        choice("too_few_replies", ("skip", "retry"))
        choice("amp", ("off", "bf16"))
        choice("batching", ("auto", "on", "off"))
        choice("compile", ("off", "on"))
        for f in general_fields().values():
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
                problems.append(f"{_key(f.name)}={shown(value)} is out of range (at most {MAX_INT})")
            if isinstance(value, str) and not value.isprintable():
                problems.append(f"{_key(f.name)}={value!r} holds control characters")
        for key in PATH_KEYS:
            try:
                user_path(getattr(self, key.replace("-", "_")), key)
            except ConfigError as err:
                problems.append(str(err))
        check(self.num_server_rounds >= 1, "num-server-rounds must be >= 1")
        check(0 <= self.seed <= MAX_SEED, f"seed must be in [0, {MAX_SEED}] (got {shown(self.seed)})")
        check(_pos(self.lr), f"lr must be a finite number > 0 (got {self.lr})")
        check(_pos(self.lr_decay) and self.lr_decay <= 1.0, "lr-decay must be in (0, 1]")
        check(_pos(self.server_lr), f"server-lr must be a finite number > 0 (got {self.server_lr})")
        check(
            0.0 < self.fraction_train <= 1.0,
            f"fraction-train must be in (0, 1] (got {self.fraction_train})",
        )
        check(
            0.0 <= self.fraction_evaluate <= 1.0,
            f"fraction-evaluate must be in [0, 1] (got {self.fraction_evaluate})",
        )
        check(_pos(self.dirichlet_alpha) and self.dirichlet_alpha <= 1e6,
              "dirichlet-alpha must be in (0, 1e6] (large values are IID already)")
        check(self.classes_per_client >= 1, "classes-per-client must be >= 1")
        check(_nonneg(self.synthetic_alpha) and _nonneg(self.synthetic_beta),
              "synthetic-alpha and synthetic-beta must be finite numbers >= 0")
        if self.dataset == "synthetic-fedprox":
            check(self.partition == "natural", "dataset synthetic-fedprox is generated per client: "
                  "use partition=natural (client i trains on its own generated data)")
            check(self.num_partitions >= 1, "dataset synthetic-fedprox generates one client per "
                  "partition: set num-partitions >= 1")
        elif self.partition == "natural":
            problems.append(f"partition=natural needs a dataset generated per client "
                            f"(synthetic-fedprox), not {self.dataset!r}")
        problems += self._local_problems()
        check(bool(self.csv_label.strip()), "csv-label must name the CSV's label column")
        check(0 <= self.image_size <= 4096, "image-size must be in [0, 4096] (0 = keep the images' own size)")
        check(self.num_classes >= 0, "num-classes must be >= 0 (0 = inferred from the labels)")
        check(self.num_classes == 0 or userdata.is_user_dataset(self.dataset) or self.local_data(),
              f"num-classes is read only for your own data (npz, csv, imagefolder, package.module:callable) "
              f"and partition=local; dataset {self.dataset!r} has its own classes")
        if self.train_transform not in TRAIN_TRANSFORMS and not is_reference(self.train_transform):
            problems.append(f"train-transform={self.train_transform!r} is not one of: "
                            f"{', '.join(TRAIN_TRANSFORMS)}, or a package.module:callable"
                            f"{did_you_mean(self.train_transform, TRAIN_TRANSFORMS)}")
        check(math.isfinite(self.validation_fraction) and 0.0 <= self.validation_fraction < 1.0,
              f"validation-fraction must be in [0, 1) (got {self.validation_fraction})")
        check(-1 <= self.partition_seed <= MAX_SEED,
              f"partition-seed must be in [0, {MAX_SEED}], or -1 (use seed)")
        check(self.num_partitions >= 0,
              "num-partitions must be >= 1, or 0 (the number of nodes connected at round 1)")
        check(self.aggregator_f >= 0, "aggregator-f (clients assumed Byzantine) must be >= 0")
        check(0.0 <= self.aggregator_trim < 0.5, "aggregator-trim must be in [0, 0.5)")
        check(_nonneg(self.aggregator_clip),
              "aggregator-clip must be a finite number >= 0 (0 = the round's median update norm)")
        check(1 <= self.aggregator_iterations <= 100, "aggregator-iterations must be in [1, 100]")
        check(self.min_available_nodes >= 1, "min-available-nodes must be >= 1")
        check(self.min_replies >= 1, "min-replies must be >= 1")
        check(self.max_retries >= 0, "max-retries must be >= 0")
        check(_nonneg(self.outlier_norm_factor) and (self.outlier_norm_factor == 0
                                                    or self.outlier_norm_factor > 1),
              "outlier-norm-factor must be 0 (off) or > 1 (a multiple of the round's median update norm)")
        check(self.checkpoint_every >= 0, "checkpoint-every must be >= 0 (0 = no checkpoints)")
        check(not self.client_state_dir or not _relative(self.client_state_dir) or bool(self.run_dir),
              f"client-state-dir={self.client_state_dir!r} is relative, which means inside the run "
              "directory: set run-dir too, or give an absolute path")
        check(_pos(self.node_wait_timeout) and self.node_wait_timeout <= MAX_SECONDS,
              f"node-wait-timeout must be in (0, {MAX_SECONDS:.0f}] seconds (got {self.node_wait_timeout})")
        # below a second no client answers a round (its message alone takes longer to travel
        # and be read): such a value would fail every round, late, instead of here
        check(_pos(self.round_timeout) and 1.0 <= self.round_timeout <= MAX_SECONDS,
              f"round-timeout must be in [1, {MAX_SECONDS:.0f}] seconds (got {self.round_timeout}): "
              "a round's messages need at least that to travel and be answered")
        check(self.local_epochs >= 1, "local-epochs must be >= 1")
        check(self.local_steps >= 0, "local-steps must be >= 0 (0 = use local-epochs)")
        check(self.batch_size >= 1, "batch-size must be >= 1")
        check(self.eval_batch_size >= 1, "eval-batch-size must be >= 1")
        check(re.fullmatch(r"cpu|cuda(:\d+)?|mps", self.server_device) is not None,
              f"server-device must be cpu, cuda, cuda:N or mps (got {self.server_device!r})")
        check(self.server_threads >= 1, f"server-threads must be >= 1 (got {self.server_threads})")
        check(_nonneg(self.weight_decay), "weight-decay must be a finite number >= 0")
        check(0.0 <= self.momentum < 1.0, "momentum must be in [0, 1)")
        check(_nonneg(self.clip_norm), "clip-norm must be a finite number >= 0 (0 = no clipping)")
        choice("dp_clip_mode", ("global", "per-tensor"))
        check(_nonneg(self.dp_clip), "dp.clip must be a finite number >= 0 (0 = no differential privacy)")
        check(_nonneg(self.dp_noise_multiplier), "dp.noise-multiplier must be a finite number >= 0")
        check(0.0 < self.dp_delta < 1.0, f"dp.delta must be in (0, 1) (got {self.dp_delta})")
        if self.dp_noise_multiplier > 0 and self.dp_clip == 0:
            problems.append("dp.noise-multiplier > 0 needs dp.clip > 0: the noise's scale is "
                            "noise-multiplier * clip")
        if self.dp_clip > 0:
            check(self.aggregation == "uniform", "dp.clip > 0 needs aggregation = uniform: the noise "
                  "is calibrated to the uniform mean of the clipped updates (noise-multiplier * clip / M)")
            check(self.aggregator == "mean", f"dp.clip > 0 needs aggregator = mean, not {self.aggregator!r}: "
                  "the privacy analysis is of the mean of the clipped, noised updates")
            check(self.too_few_replies == "skip", "dp.clip > 0 needs too-few-replies = skip: a retried "
                  "client would release a second noised update of its round, which the accountant "
                  "does not count")
            check(self.outlier_norm_factor == 0, "dp.clip > 0 needs outlier-norm-factor = 0: which "
                  "updates are kept would depend on each one's norm, which the privacy analysis of the "
                  "mean does not cover (clipping already bounds every update to dp.clip)")
        check(self.evaluate_every >= 1, "evaluate-every must be >= 1 (federated evaluation every K rounds "
              "and the last)")
        check(self.flatness_every >= 0, "flatness-every must be >= 0 (0 = no flatness measures; "
              "K = every K rounds and the last)")
        check(_pos(self.flatness_rho), f"flatness-rho must be a finite number > 0 (got {self.flatness_rho})")
        check(1 <= self.flatness_iters <= 100_000, "flatness-iters must be in [1, 100000]")
        check(1 <= self.flatness_probes <= 100_000, "flatness-probes must be in [1, 100000]")
        if self.params is not None:
            problems += self.params.problems(self)
            for rule in _COMPATIBILITY:
                problems += rule(self)
        problems += others or []
        if problems:
            raise ConfigError("invalid run config: " + "; ".join(problems))

    def _local_problems(self) -> list[str]:
        """partition = local (each node trains on its own data; common/data.py): the server
        builds the model from ``input-shape`` and ``num-classes``, with no data of its own."""
        problems = []
        if self.input_shape:
            try:
                parse_shape(self.input_shape)
            except ConfigError as err:
                problems.append(str(err))
        if not 1 <= self.max_node_examples <= MAX_INT:
            problems.append(f"max-node-examples must be in [1, {MAX_INT}] (got {shown(self.max_node_examples)})")
        if self.partition != "local":
            return problems
        if not self.input_shape or self.num_classes < 1:
            problems.append("partition=local needs input-shape (e.g. \"1,8,8\") and num-classes >= 1: the "
                            "server builds the model without any node's data")
        if self.fraction_evaluate == 0 and not self.data_dir:
            problems.append("partition=local with no evaluation set on the server (data-dir) measures "
                            "nothing: set fraction-evaluate > 0 (the clients evaluate the global model "
                            "on their own held-out data), or data-dir")
        if self.flatness_every > 0 and not self.data_dir:
            problems.append("flatness-every > 0 with partition=local needs an evaluation set on the server "
                            "(data-dir: its test split), where the flatness of the global model is measured")
        return problems

    def local_data(self) -> bool:
        """partition = local: every node trains on all of its own data (common/data.py)."""
        return self.partition == "local"

    def central_evaluation(self) -> bool:
        """Whether the server evaluates the global model on a test split of its own: always,
        except with partition = local and no ``data-dir`` (then only federated evaluation)."""
        return not self.local_data() or bool(self.data_dir)

    # ----------------------------------------------------------------- derived
    def measures_flatness(self, server_round: int) -> bool:
        """Whether round ``server_round`` measures the global model's sharpness and Hessian:
        every ``flatness-every`` rounds, and the last round (never with ``flatness-every`` 0)."""
        return self.flatness_every > 0 and (server_round % self.flatness_every == 0
                                            or server_round == self.num_server_rounds)

    def evaluates(self, server_round: int) -> bool:
        """Whether round ``server_round`` ends with a federated evaluation: ``fraction-evaluate``
        > 0, every ``evaluate-every`` rounds and the last."""
        return self.fraction_evaluate > 0 and (server_round % self.evaluate_every == 0
                                               or server_round == self.num_server_rounds)

    def num_steps(self, n: int) -> int:
        """The local steps (mini-batches) a client of ``n`` samples takes in a round (tau_i)."""
        return local_step_count(n, self.batch_size, self.local_epochs, self.local_steps)

    def round_lr(self, server_round: int) -> float:
        """Local learning rate of round ``server_round`` (1-based): lr * lr_decay^(r-1)."""
        return self.lr * self.lr_decay ** (server_round - 1)

    def data_seed(self) -> int:
        """The seed of the data partition: ``partition-seed``, or ``seed`` when it is -1. A
        sweep fixes it so that every seed and algorithm trains on the same partition."""
        return self.seed if self.partition_seed < 0 else self.partition_seed

    def client_state_path(self) -> str:
        """Where clients mirror their state (``client-state-dir``; "" = nowhere): a relative
        path is inside the run directory, so a moved or copied run directory keeps its own."""
        if not self.client_state_dir or not _relative(self.client_state_dir):
            return self.client_state_dir
        return str(Path(self.run_dir) / self.client_state_dir)

    def resolved_model(self) -> str:
        """The model name, with ``auto`` replaced by the dataset's default model (a
        ``package.module:callable`` reference is returned as is)."""
        from flatflower.common.datasets import default_model

        return default_model(self.dataset) if self.model == "auto" else self.model


def parse_shape(text: str) -> tuple[int, ...]:
    """``input-shape`` text ("1,8,8", "64") -> (1, 8, 8): one to four whole numbers >= 1."""
    parts = [p.strip() for p in str(text).split(",")]
    if (not 1 <= len(parts) <= 4 or not all(p.isascii() and p.isdigit() for p in parts)
            or not all(1 <= int(p) <= 1_000_000 for p in parts)):
        raise ConfigError(f"input-shape={text!r} is not 1 to 4 whole numbers >= 1 separated by commas "
                          "(e.g. \"1,8,8\": channels, height, width; \"64\": 64 features)")
    return tuple(int(p) for p in parts)


def local_step_count(n: int, batch_size: int, local_epochs: int, local_steps: int) -> int:
    """``local_steps`` when > 0, else ``local_epochs`` passes of ceil(n / batch_size) batches
    (the last batch of a pass may be smaller): the one rule for the client's loop, the
    vectorised engine and the server's check of a reply's step count."""
    return local_steps if local_steps > 0 else local_epochs * math.ceil(n / batch_size)


def did_you_mean(word: str, options) -> str:
    """`` (did you mean 'fedsam'?)`` for the closest of ``options``, or ''."""
    import difflib

    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key(field_name: str) -> str:
    """The run-config key of RunConfig field ``field_name``."""
    meta = next((f.metadata for f in fields(RunConfig) if f.name == field_name), {})
    return meta.get("key", field_name.replace("_", "-"))


def _other_algorithms_problems(values: Mapping[str, Any], cfg: RunConfig) -> list[str]:
    """Bad values given for keys the run's algorithm does not use are still reported."""
    from typing import get_type_hints

    from flatflower.common.params import field_problem, parse_value

    own = cfg.params.fields() if cfg.params is not None else {}
    out = []
    for k, (cls, f) in algorithm_fields().items():
        if k in values and k not in own:
            try:
                value = parse_value(k, f, values[k], get_type_hints(cls)[f.name].__name__, _coerce)
            except ConfigError as err:
                out.append(str(err))
                continue
            if problem := field_problem(k, f, value):
                out.append(problem)
    return out


# ---------------------------------------------------------------- the algorithms' keys
# Algorithm name -> its params class (the keys of both its halves), filled by the registry
# (strategies/registry.py) when it is imported: the ground floor checks every algorithm's keys
# without importing the halves that declare them. Every entry point imports the registry.
_ALGORITHMS: dict[str, type] = {}
# the registry's algorithm x option rules (strategies/compatibility.py): run config -> problems
_COMPATIBILITY: list[Callable[[RunConfig], list[str]]] = []
# the registry's loader of a user's algorithm, ``algorithm = "package.module:callable"``
# (strategies/registry.py ``load``): it registers the algorithm's params here, or raises ValueError
_LOADER: list[Callable[[str], object]] = []


def register_algorithms(params: Mapping[str, type],
                        compatibility: Callable[[RunConfig], list[str]] | None = None,
                        loader: Callable[[str], object] | None = None) -> None:
    """Make the algorithms' params known to run-config parsing (the registry calls it),
    ``compatibility``, what is wrong with a run config's algorithm under its options, checked
    with every other key (strategies/compatibility.py), and ``loader``, which loads and
    registers a user's algorithm named by its reference."""
    _ALGORITHMS.update(params)
    if compatibility is not None:
        _COMPATIBILITY[:] = [compatibility]
    if loader is not None:
        _LOADER[:] = [loader]
    _parsed.cache_clear()


def _load_algorithm(name: object) -> None:
    """An ``algorithm`` that is a reference to the user's own code (``mypkg.algo:spec``) and
    not registered yet: load it (its keys become valid run-config keys); ConfigError in one
    line when it cannot be used."""
    from flatflower.common.references import is_reference

    if not is_reference(name) or name in _ALGORITHMS or not _LOADER:
        return
    try:
        _LOADER[0](name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def algorithm_params() -> Mapping[str, type]:
    """Algorithm name -> its params class, as registered."""
    if not _ALGORITHMS:
        raise ConfigError("no algorithm is registered: import flatflower.strategies.registry (every flatflower "
                          "entry point does) before building a run config")
    return _ALGORITHMS


def algorithm_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every algorithm's run-config keys -> (a params class that declares it, its field)."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in algorithm_params().values():
        for k, f in cls.fields().items():
            out.setdefault(k, (cls, f))
    return out


def algorithm_keys() -> dict[str, Any]:
    """Every algorithm's run-config keys -> their defaults (a key shared by a family, such as
    ``sam.rho``, has one default)."""
    return {k: f.default for k, (_, f) in algorithm_fields().items()}


def general_fields() -> dict[str, dataclasses.Field]:
    """Run-config key -> field of the general keys (not the algorithm's params): ``foo_bar``
    is ``foo-bar``, or the key its metadata names (``dp.clip``)."""
    return {f.metadata.get("key", _key(f.name)): f for f in fields(RunConfig) if not f.metadata.get("internal")}


def _relative(path: str) -> bool:
    return not path.startswith(("/", "~"))


def _pos(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0


def _coerce(key: str, value: Any, type_name: Any) -> Any:
    """Cast a TOML/CLI value to the field's type, with a clear error."""
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    if isinstance(value, str) and type_name in ("int", "float", "bool") and not value.isascii():
        # float("١") and int("０") are numbers to Python; a config value must say what it means
        raise ConfigError(f"{key}={value!r} is not a valid {type_name} (use ASCII digits)")
    try:
        if type_name == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if type_name == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. run-dir=123 read as a TOML number
        raise ValueError
    except (TypeError, ValueError, OverflowError):  # OverflowError: float(10**400)
        raise ConfigError(f"{key}={shown(value)} is not a valid {type_name}") from None


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for a message (a number of 5000 digits)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 13]}...({len(text)} chars)"


def flat_keys(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables -> dotted run-config keys (``{"sam": {"rho": 0.1}}`` -> ``sam.rho``),
    as Flower flattens ``[tool.flwr.app.config]``."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


PATH_KEYS = ("run-dir", "client-state-dir", "data-dir")


def user_path(text: str, what: str) -> Path:
    """``Path(text).expanduser()``; ConfigError naming ``what`` when ``text`` starts with the
    home directory of a user this machine does not have (``~nosuchuser/x``)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ConfigError(f"{what}={text!r}: {text.split('/')[0]} is no user's home directory "
                          "on this machine") from None


def cli_int(text: str) -> int:
    """argparse type: a whole number written in ASCII digits (``int("١")`` is 1 to Python)."""
    return int(_ascii_number(text))


def cli_float(text: str) -> float:
    """argparse type: a finite number written in ASCII."""
    value = float(_ascii_number(text))
    if not math.isfinite(value):
        raise ValueError(text)
    return value


cli_int.__name__, cli_float.__name__ = "int", "float"  # argparse names the type in its errors


def _ascii_number(text: str) -> str:
    if not text.isascii():
        raise ValueError(text)
    return text


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """Parse CLI ``key=value`` strings; values are read as TOML scalars when possible."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    out: dict[str, Any] = {}
    known = defaults()
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = (s.strip() for s in item.split("=", 1))
        if not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except ValueError:  # TOMLDecodeError, or an int of over 4300 digits (int() refuses it)
            value = raw  # a bare word such as fedsam
        if isinstance(known.get(key), str) and not isinstance(value, str):
            value = raw.strip('"\'')  # text keys keep the text: run-dir=2024-01-01
        out[key] = value
    return out


def check_types(values: Mapping[str, Any]) -> None:
    """ConfigError for a general key whose value is not of its type: each ``--set`` value is
    checked itself, also one that a named flag then overrides (``--set num-server-rounds=abc
    --rounds 5`` is a mistake, not a silently dropped value). Ranges are the run config's."""
    by_key = general_fields()
    for key, value in values.items():
        if key in by_key:
            _coerce(key, value, by_key[key].type)


def defaults() -> dict[str, Any]:
    """Every run-config key -> its default: the general keys and every algorithm's."""
    return {**{k: f.default for k, f in general_fields().items()}, **algorithm_keys()}


def remembered_by_items(maxsize: int) -> Callable:
    """Decorator: ``read(mapping)`` remembered by the mapping's items and their types, in
    their order (1, 1.0 and True are equal keys, not equal values), for configs a client reads
    at every call; an error is raised every time, never remembered, and a mapping with a value
    that cannot be hashed is read afresh. ``.cache_clear()`` forgets."""
    def decorate(read: Callable[[Mapping[str, Any]], Any]) -> Callable[[Mapping[str, Any]], Any]:
        @functools.lru_cache(maxsize=maxsize)
        def remembered(items: tuple, types: tuple) -> Any:
            return read(dict(items))

        @functools.wraps(read)
        def call(mapping: Mapping[str, Any]) -> Any:
            try:
                return remembered(tuple(mapping.items()), tuple(map(type, mapping.values())))
            except TypeError:  # a value that cannot be hashed (or read's own TypeError, raised again)
                return read(mapping)

        call.cache_clear = remembered.cache_clear
        return call
    return decorate


@remembered_by_items(maxsize=16)
def _parsed(values: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_mapping(values)
