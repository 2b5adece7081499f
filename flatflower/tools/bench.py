"""``flatflower bench``: what each algorithm costs, measured on this implementation.

* **compute** — seconds per local step of each algorithm (our real local loop) divided by a
  plain PyTorch SGD step on the same model, batch and device, measured interleaved in one
  process; beside it the gradient passes per step counted while it ran and the count the
  algorithm needs (``strategies/registry.py``: ``passes`` + ``forwards``/3, a forward being about a
  third of a forward + backward).
* **overhead** — one round of the same clients: the sum of their pure training time against
  the round's wall time in-process, in Ray simulation and in a real loopback deployment
  (the last two with ``--full``), and our FedAvg against a plain Flower FedAvg app (Flower's
  own strategy and a minimal ClientApp, same model, data and local SGD) on the same grid.
* **communication** — bytes down and up per client per round of every algorithm against
  the theoretical count, model bytes x records (``down``/``up`` in the registry), and the
  whole serialized Flower message (protobuf) against the same count.
* **memory** — client-state bytes per client and server-state bytes per algorithm, for a
  growing number of clients, against what the algorithm must keep (model bytes x records).
* **throughput** — client·steps per CPU-second and per wall-second, and seconds per round, of
  short runs on the in-process, vectorised and (``--full``) Ray engines as the number of
  clients grows (tools/throughput.py): CPU time and the fastest of interleaved runs.
* **flatness** — what measuring flatness costs (common/flatness.py): one ``flatness-every``
  evaluation (``measure()``: sharpness, power iteration, Hutchinson) of a trained global model
  on its evaluation split with each Hessian-vector product (``torch.func`` forward-over-reverse,
  double backward), the seconds of one HVP of each, one 21x21 loss landscape (as
  ``flatflower landscape`` computes it, without the figure), all against a training round of the run that
  trained the model (in-process engine: the MLP and the CNN on digits, LeNet on
  ``synthetic-cifar10``); and what ``flatness-every 10`` adds to that digits run, measured in
  it: sum(flatness_seconds) / sum(seconds) over its rows.
* **trial** — what a short run pays besides training (tools/trial.py): a fresh process's fixed
  cost (imports, setup, the first round's extra) and a steady round's framework time per
  sampled client, on the in-process and vectorised engines (``--full``: also compiled).

Targets (docs/benchmarks.md) are reported, never asserted: timings belong here, not in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flatflower.client.batch import ModelBatch
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig, cli_int
from flatflower.common.datasets import Split
from flatflower.common.flatness import DEFAULT_ITERS, DEFAULT_PROBES, HVP_METHODS, SplitLoss, measure, random_vector
from flatflower.common.models import build_model
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.registry import get as get_spec
from flatflower.server.rundir import load_checkpoint, load_tensors
from flatflower.runtime.engines import quiet_flower
from flatflower.tools.parsers import BENCH_SECTIONS as SECTIONS
from flatflower.tools.parsers import bench as build_parser
from flatflower.tools.throughput import ThroughputSettings, bench_throughput
from flatflower.tools.throughput import render as render_throughput
from flatflower.tools.trial import VARIANTS as TRIAL_VARIANTS
from flatflower.tools.trial import TrialSettings, bench_trial
from flatflower.tools.trial import render as render_trial

# Variants measured besides each algorithm's defaults: (label, algorithm, run-config overrides).
VARIANTS = [(name, name, {}) for name in ALGORITHMS] + [
    ("fedtoga (N)", "fedtoga", {"fedtoga.perturbation": "N"}),
]
EXPECTED_OVERRIDES = {"fedtoga (N)": 1.0}  # passes of a variant whose config changes them
MEMORY_CLIENTS_QUICK, MEMORY_CLIENTS_FULL = (2, 4), (4, 8, 16)
# the throughput section's defaults: --quick keeps `make test` fast; --full adds Ray
THROUGHPUT_QUICK = {"models": ("mlp",), "clients": (10, 20), "rounds": 3, "repeats": 2}
THROUGHPUT_FULL = {"models": ("mlp", "cnn", "lenet"), "clients": (10, 100, 500), "rounds": 4, "repeats": 2}
# the flatness section: which models, measure()'s iterations/probes, the landscape's grid, and
# fastest-of-N timings of each HVP method (interleaved); --quick keeps `make test` fast
FLATNESS_QUICK = {"models": ("mlp", "cnn"), "iters": 3, "probes": 2, "steps": 5, "repeats": 1,
                  "run": {"clients": 4, "local-epochs": 1, "rounds": 3, "flatness-every": 2}}
FLATNESS_FULL = {"models": ("mlp", "cnn", "lenet"), "iters": DEFAULT_ITERS, "probes": DEFAULT_PROBES,
                 "steps": 21, "repeats": 3, "run": {}}
FLATNESS_RUNS = {  # model -> the in-process FedAvg run (iid) whose rounds are timed (without --quick)
    "mlp": {"dataset": "digits", "clients": 10, "local-epochs": 5, "rounds": 10, "flatness-every": 10},
    "cnn": {"dataset": "digits", "clients": 10, "local-epochs": 5, "rounds": 10, "flatness-every": 10},
    # a LeNet round of 5000 images is long here: 1 epoch, 2 rounds, measured apart (no flatness-every)
    "lenet": {"dataset": "synthetic-cifar10", "clients": 10, "local-epochs": 1, "rounds": 2,
              "flatness-every": 0, "repeats": 1},
}
RUN_HVP = inspect.signature(measure).parameters["hvp"].default  # what a run's flatness-every uses
# the trial section: --quick keeps `make test` fast (two short eager runs); --full adds compile = on
# and a tune worker's next trial (the same setting run twice in one process, the second timed)
TRIAL_QUICK = {"clients": 10, "rounds": 4, "repeats": 1, "variants": ("inprocess", "vectorized")}
TRIAL_FULL = {"clients": 100, "rounds": 6, "repeats": 2, "variants": tuple(TRIAL_VARIANTS)}
FLATNESS_TARGET = 0.10  # issue 24: flatness-every 10 adds <= 10% to a digits-CNN run
_RUN_IDS = itertools.count()


@dataclass
class Settings:
    quick: bool
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    steps: int
    repeats: int
    device: str
    full_overhead: bool
    threads: int = 1
    sections: tuple[str, ...] = SECTIONS
    throughput: ThroughputSettings | None = None
    flatness_models: tuple[str, ...] = ()  # () = FLATNESS_QUICK's or FLATNESS_FULL's
    trial: TrialSettings | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        shape = tuple(int(s) for s in args.input_shape.split(","))
        sections = _names(args.sections)
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown or not sections:
            raise ValueError(f"--sections: unknown {', '.join(unknown) or '(none given)'} "
                             f"(valid: {', '.join(SECTIONS)})")
        defaults = THROUGHPUT_QUICK if args.quick else THROUGHPUT_FULL
        engines = ("inprocess", "vectorized", "ray") if args.full else ("inprocess", "vectorized")
        try:
            clients = tuple(cli_int(c) for c in _names(args.throughput_clients))
        except ValueError:
            raise ValueError(f"--throughput-clients {args.throughput_clients!r}: whole numbers, "
                             "comma-separated") from None
        throughput = ThroughputSettings(
            models=_names(args.throughput_models) or defaults["models"],
            clients=clients or defaults["clients"],
            engines=_names(args.throughput_engines) or engines,
            algorithms=_names(args.throughput_algorithms) or ("fedavg",),
            rounds=args.throughput_rounds or defaults["rounds"],
            repeats=args.throughput_repeats or defaults["repeats"],
            ray_max_clients=args.throughput_ray_max_clients,
            fraction=args.throughput_fraction, local_epochs=args.throughput_epochs,
            batch_size=args.throughput_batch_size)
        throughput.validate()
        flatness_models = _names(args.flatness_models)
        unknown = [m for m in flatness_models if m not in FLATNESS_FULL["models"]]
        if unknown:
            raise ValueError(f"--flatness-models: unknown {', '.join(unknown)} "
                             f"(valid: {', '.join(FLATNESS_FULL['models'])})")
        return cls(quick=args.quick, model=args.model, input_shape=shape, num_classes=args.classes,
                   batch_size=args.batch_size, steps=args.steps, repeats=args.repeats,
                   device=args.device, full_overhead=args.full, threads=args.threads,
                   sections=sections, throughput=throughput, flatness_models=flatness_models,
                   trial=TrialSettings(**(TRIAL_QUICK if args.quick else TRIAL_FULL)))


def _names(text: str | None) -> tuple[str, ...]:
    """A comma-separated list option's items (none for None or "")."""
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


# ---------------------------------------------------------------------------- compute
class PassCounter:
    """Counts gradient passes (every one a client rule asks for goes through its batch,
    flatflower.client.batch.ModelBatch) and forwards of one model."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.grads, self.forwards = model, 0, 0

    @contextlib.contextmanager
    def counting(self):
        original = ModelBatch._grad

        def grad(*args, **kwargs):
            self.grads += 1
            return original(*args, **kwargs)

        def hook(module, inputs):
            self.forwards += 1

        handle = self.model.register_forward_pre_hook(hook)
        ModelBatch._grad = grad
        try:
            yield self
        finally:
            ModelBatch._grad = original
            handle.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_sgd_seconds(model, x, y, steps: int, lr: float, device) -> float:
    """Seconds per step of the textbook loop: forward, cross-entropy, backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _noise_like(tensors: OrderedDict, scale: float = 1e-3) -> OrderedDict:
    g = torch.Generator().manual_seed(0)
    return OrderedDict((k, scale * torch.randn(v.shape, generator=g)) for k, v in tensors.items())


def _algorithm_seconds(name: str, overrides: dict, settings: Settings, x, y, init: OrderedDict,
                       device) -> tuple[float, int, int, int]:
    """Seconds per step of ``name`` in our real local loop (flatflower.client.train.local_train), after a
    warm-up round that gives the client its state; and the passes counted in the timed round."""
    from flatflower.client.train import build_rule, local_train, rule_outputs

    cfg = RunConfig.from_mapping({**get_spec(name).example_config(), "local-steps": settings.steps,
                                  "batch-size": settings.batch_size, "local-epochs": 1, **overrides})
    spec = get_spec(name)
    # non-zero broadcasts (as after round 1), so every perturbation/correction path runs
    broadcast = {rec: _noise_like(init) for rec in spec.down}
    broadcast.update({name: 0.5 for name in spec.values})  # mixing weights strictly inside (0, 1)
    data = Split(x, y)  # already on the device, as a GPU client's partition is
    model = build_model(settings.model, settings.input_shape, settings.num_classes, seed=0).to(device)
    state: dict = {}
    for timed in (False, True):
        model.load_state_dict(init)
        rule, layout = build_rule(spec, cfg, model, broadcast, state, cfg.lr, lambda: init)
        counter = PassCounter(model)
        gen = torch.Generator().manual_seed(0)
        _sync(device)
        t0 = time.perf_counter()
        with counter.counting():
            result = local_train(model, data, rule, cfg, cfg.lr, gen)
        _sync(device)
        seconds = (time.perf_counter() - t0) / result.num_steps
        state = {**state, **rule_outputs(rule, layout, model)[1]}
    return seconds, result.num_steps, counter.grads, counter.forwards


def _silent(text: str) -> None:
    """The default ``say``: no progress output."""


def bench_compute(settings: Settings, say=_silent) -> list[dict[str, Any]]:
    """Per variant, the fastest of ``repeats`` timed rounds against the fastest of the
    ``repeats`` plain SGD rounds timed between them: load from other processes only ever adds
    time, so minima are the steadier estimate."""
    device = torch.device(settings.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(settings.batch_size, *settings.input_shape, generator=g).to(device)
    y = torch.randint(0, settings.num_classes, (settings.batch_size,), generator=g).to(device)
    init = build_model(settings.model, settings.input_shape, settings.num_classes, seed=0).state_dict()
    baseline = build_model(settings.model, settings.input_shape, settings.num_classes, seed=0).to(device)
    _plain_sgd_seconds(baseline, x, y, 3, 0.01, device)  # warm-up (allocator, kernels)
    rows = []
    for i, (label, name, overrides) in enumerate(VARIANTS, 1):
        say(f"compute: {label} ({i}/{len(VARIANTS)})")
        times, sgd_times = [], []
        for _ in range(settings.repeats):  # interleaved with the baseline
            sgd_times.append(_plain_sgd_seconds(baseline, x, y, settings.steps, 0.01, device))
            t_alg, steps, grads, forwards = _algorithm_seconds(name, overrides, settings, x, y, init, device)
            times.append(t_alg)
        seconds, sgd, grads, forwards = min(times), min(sgd_times), grads / steps, forwards / steps
        spec = get_spec(name)
        expected = EXPECTED_OVERRIDES.get(label, spec.passes + spec.forwards / 3)
        rows.append({
            "algorithm": label, "seconds_per_step": seconds, "sgd_seconds_per_step": sgd,
            "cost_vs_sgd": seconds / sgd, "expected_cost": round(expected, 3),
            "within_10pct": abs(seconds / sgd / expected - 1) <= 0.10,
            "gradient_passes_per_step": grads, "forwards_per_step": forwards,
            "expected_gradient_passes": EXPECTED_OVERRIDES.get(label, spec.passes),
        })
    return rows


# ---------------------------------------------------------------------------- overhead
def _overhead_config(run_dir: Path, quick: bool) -> dict[str, Any]:
    """FedAvg on digits, iid: 1 local epoch of the MLP (quick) or 5 of the CNN."""
    return {"algorithm": "fedavg", "dataset": "digits", "partition": "iid",
            "model": "mlp" if quick else "cnn", "local-epochs": 1 if quick else 5,
            # the same work as Flower's FedAvg app: no client self-report passes, no event files
            "client-eval": False, "tensorboard": False,
            "num-server-rounds": 3, "checkpoint-every": 0, "run-dir": str(run_dir)}


def _pure_training_seconds(cfg: RunConfig, clients: int) -> float:
    """Sum over the clients of local_train alone (round 1's start model, their data)."""
    from flatflower.client.algorithms.fedavg import FedAvgClient
    from flatflower.client.train import local_train, round_generator
    from flatflower.common.data import client_split, dataset_for

    data = dataset_for(cfg)
    init = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=cfg.seed).state_dict()
    total = 0.0
    for pid in range(clients):
        split = client_split(cfg, pid, clients)
        model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=0)
        model.load_state_dict(init)
        rule = FedAvgClient(cfg.params, [p.detach() for p in model.parameters()], {}, {}, cfg.lr)
        t0 = time.perf_counter()
        local_train(model, split, rule, cfg, cfg.lr, round_generator(cfg.seed, 1, pid))
        total += time.perf_counter() - t0
    return total


def _round_seconds(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["seconds"] for r in rows if r["round"] >= 1]


def _plain_flower_fedavg_seconds(cfg: RunConfig, clients: int) -> list[float]:
    """Per-round wall time of Flower's own FedAvg strategy (``strategy.start``) driving a
    minimal ClientApp (same data, model and local SGD), central evaluation each round, on
    the same in-process grid as ours."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg

    from flatflower.client.algorithms.fedavg import FedAvgClient
    from flatflower.client.train import local_train, round_generator
    from flatflower.common.data import client_split, dataset_for
    from flatflower.common.evaluate import evaluate
    from flatflower.runtime.engines.inprocess import InProcessGrid

    data = dataset_for(cfg)
    plain = ClientApp()

    @plain.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        split = client_split(cfg, pid, clients)
        model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=0)
        model.load_state_dict(msg.content[P.MODEL].to_torch_state_dict())
        rnd = int(msg.content[P.CONFIG][P.SERVER_ROUND])
        rule = FedAvgClient(cfg.params, [p.detach() for p in model.parameters()], {}, {}, cfg.lr)
        result = local_train(model, split, rule, cfg, cfg.lr, round_generator(cfg.seed, rnd, pid))
        return Message(RecordDict({P.MODEL: ArrayRecord(model.state_dict()),
                                   P.METRICS: MetricRecord({P.NUM_EXAMPLES: result.num_examples})}),
                       reply_to=msg)

    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=cfg.seed)
    stamps: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, data.test, cfg.eval_batch_size)
        stamps.append(time.perf_counter())
        return MetricRecord({"accuracy": acc, "loss": loss})

    grid = InProcessGrid(plain, clients, cfg.to_dict())
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=clients,
                      min_available_nodes=clients)
    strategy.fraction_evaluate = 0.0  # set after: 0 in the constructor makes Flower warn
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                       num_rounds=cfg.num_server_rounds, evaluate_fn=central)
    return [b - a for a, b in zip(stamps, stamps[1:])]


DEPLOYMENTS = {  # label -> extra flags of `flatflower local`
    "deployment (stock)": ["--clientapps", "stock"],
    "deployment (warm)": [],
    "deployment (warm + fast poll)": ["--fast-poll"],
}


def _cli_round_seconds(command: str, cfg_dict: dict, clients: int, workdir: Path, timeout: float,
                       extra: list[str] = (), name: str = "") -> dict:
    """Run ``flatflower local|simulate`` for FedAvg in a subprocess; its round times and wall."""
    run_dir = workdir / (name or command).replace(" ", "_").replace("(", "").replace(")", "")
    args = [sys.executable, "-m", "flatflower.tools.cli", command, *extra, "--algorithm", "fedavg", "--clients", str(clients),
            "--rounds", str(cfg_dict["num-server-rounds"]), "--dataset", "digits", "--partition", "iid",
            "--model", cfg_dict["model"], "--set", f"local-epochs={cfg_dict['local-epochs']}",
            "--set", "checkpoint-every=0", "--run-dir", str(run_dir),
            "--timeout", str(int(timeout))]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout + 60,
                          cwd=Path(__file__).resolve().parents[2])
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-400:], "wall_seconds": wall}
    rounds = _round_seconds(run_dir)
    return {"round_seconds": statistics.median(rounds[1:] or rounds), "wall_seconds": wall,
            "startup_and_teardown_seconds": wall - sum(rounds)}


def bench_overhead(settings: Settings, workdir: Path, say=_silent) -> dict[str, Any]:
    from flatflower.runtime.engines.inprocess import run_inprocess

    clients = 4
    cfg_dict = _overhead_config(workdir / "ours", settings.quick)
    cfg = RunConfig.from_mapping(cfg_dict)
    say("overhead: pure training")
    pure = statistics.median(_pure_training_seconds(cfg, clients) for _ in range(3))
    ours, observed = [], []
    say("overhead: in-process rounds")
    for i in range(2 if settings.quick else 3):
        run_dir, _ = run_inprocess({**cfg_dict, "run-dir": str(workdir / f"ours-{i}")}, clients)
        ours += _round_seconds(run_dir)[1:]  # round 1 carries one-off warm-up
        run_dir, _ = run_inprocess({**cfg_dict, "client-eval": True, "tensorboard": True,
                                    "run-dir": str(workdir / f"observed-{i}")}, clients)
        observed += _round_seconds(run_dir)[1:]
    say("overhead: plain Flower FedAvg")
    flower = []
    for _ in range(2 if settings.quick else 3):
        flower += _plain_flower_fedavg_seconds(cfg, clients)
    out = {
        "clients": clients, "dataset": "digits", "model": cfg.resolved_model(),
        "local_epochs": cfg.local_epochs,
        "pure_training_seconds": pure,
        "inprocess_round_seconds": statistics.median(ours),
        "plain_flower_fedavg_round_seconds": statistics.median(flower),
        # the defaults: clients' before/after evaluation passes and TensorBoard event files
        "inprocess_round_seconds_observed": statistics.median(observed),
    }
    out["ours_vs_plain_flower"] = out["inprocess_round_seconds"] / out["plain_flower_fedavg_round_seconds"]
    out["inprocess_vs_pure_training"] = out["inprocess_round_seconds"] / pure
    engines = {"ray": ("simulate", ["--engine", "ray"])} | {label: ("local", flags) for label, flags in DEPLOYMENTS.items()}
    for engine, (command, flags) in engines.items():
        if not settings.full_overhead:
            out[engine] = {"skipped": "run with --full (starts Ray / Flower processes)"}
            continue
        say(f"overhead: {engine} rounds")
        result = _cli_round_seconds(command, cfg_dict, clients, workdir, timeout=600, extra=flags,
                                    name=engine)
        out[engine] = result
        if "round_seconds" in result:  # rounds 2.. (round 1 has the handshake and warm-up)
            out[engine]["vs_inprocess_round"] = result["round_seconds"] / out["inprocess_round_seconds"]
            out[engine]["vs_pure_training"] = result["round_seconds"] / pure
    return out


# ---------------------------------------------------------------------------- communication
def _fast_run(workdir: Path, name: str, clients: int, **overrides) -> tuple[Path, Any]:
    from flatflower.runtime.engines.inprocess import run_inprocess

    cfg = {**get_spec(name).example_config(), "dataset": "synthetic", "model": "mlp", "partition": "iid",
           "local-steps": 2, "batch-size": 64, "num-server-rounds": 2,
           "run-dir": str(workdir / f"{name}-{clients}-{next(_RUN_IDS)}"), **overrides}
    return run_inprocess(cfg, clients)


def _wire_bytes(message) -> int:
    """Bytes of the whole Flower message as serialized for the wire (protobuf)."""
    from flwr.common.serde import message_to_proto

    return message_to_proto(message).ByteSize()


class _WireGrid:
    """Wraps an InProcessGrid to measure every train message and reply as serialized."""

    def __init__(self, grid):
        self.grid, self.down, self.up, self.count, self.train_ids = grid, 0, 0, 0, set()

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(self.grid.push_messages(messages))
        train = [m for m in messages if m.metadata.message_type == "train"]
        self.down += sum(_wire_bytes(m) for m in train)
        self.count += len(train)
        self.train_ids |= {m.metadata.message_id for m in train}
        return ids

    def pull_messages(self, message_ids):
        replies = list(self.grid.pull_messages(message_ids))
        self.up += sum(_wire_bytes(r) for r in replies if not r.has_error()
                       and r.metadata.reply_to_message_id in self.train_ids)
        return replies


def bench_communication(workdir: Path, say=_silent) -> list[dict[str, Any]]:
    from flatflower.client.app import app as client_app
    from flatflower.runtime.engines.inprocess import InProcessGrid
    from flatflower.server.run import run_server

    rows = []
    clients = 4
    for name, spec in ALGORITHMS.items():
        say(f"communication: {name}")
        cfg = RunConfig.from_mapping({**spec.example_config(), "dataset": "synthetic", "model": "mlp",
                                      "partition": "iid", "local-steps": 2, "batch-size": 64,
                                      "num-server-rounds": 2, "fraction-train": 0.5,
                                      "run-dir": str(workdir / f"comm-{name}")})
        grid = _WireGrid(InProcessGrid(client_app, clients, cfg.to_dict()))
        with quiet_flower():
            run_dir = run_server(grid, cfg)
        summary = json.loads((run_dir / "summary.json").read_text())
        model_bytes = summary["model_bytes"]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[1:]]
        sent = sum(r["clients_sampled"] for r in metrics)
        replied = sum(r["clients_replied"] for r in metrics)
        down = sum(r["bytes_down"] for r in metrics) / sent
        up = sum(r["bytes_up"] for r in metrics) / replied
        theory_down, theory_up = model_bytes * (1 + len(spec.down)), model_bytes * (1 + len(spec.up))
        rows.append({
            "algorithm": name, "model_bytes": model_bytes,
            "records_down": 1 + len(spec.down), "records_up": 1 + len(spec.up),
            "bytes_down_per_client": down, "bytes_up_per_client": up,
            "theoretical_down": theory_down, "theoretical_up": theory_up,
            "wire_down_per_client": grid.down / grid.count, "wire_up_per_client": grid.up / grid.count,
            "wire_vs_theory_down": grid.down / grid.count / theory_down,
            "wire_vs_theory_up": grid.up / grid.count / theory_up,
        })
    return rows


# ---------------------------------------------------------------------------- memory
def _state_bytes(records) -> int:
    """Tensor bytes of a client's ArrayRecords (names and metadata not counted)."""
    return sum(arr.numpy().nbytes for rec in records.values() for arr in rec.values())


def bench_memory(settings: Settings, workdir: Path, say=_silent) -> list[dict[str, Any]]:
    rows = []
    sizes = MEMORY_CLIENTS_QUICK if settings.quick else MEMORY_CLIENTS_FULL
    for name, spec in ALGORITHMS.items():
        say(f"memory: {name}")
        for clients in sizes:
            with quiet_flower():
                run_dir, grid = _fast_run(workdir, name, clients, **{"checkpoint-every": 2})
            # a client holds its state after its last accepted round and after its newest
            # round, until the server accepts that one (client/state.py): two copies
            per_client = [_state_bytes(ctx.state.array_records) for ctx in grid.contexts.values()]
            ckpt = load_checkpoint(run_dir)
            server = sum(t.numel() * t.element_size() for rec in ckpt["strategy"]["records"].values()
                         for t in rec.values())
            init = load_tensors(run_dir / "model_init.pt", "initial model")
            model_bytes = sum(t.numel() * t.element_size() for t in init.values())
            rows.append({
                "algorithm": name, "clients": clients,
                "client_state_bytes_max": max(per_client),
                "client_state_bytes_total": sum(per_client),
                "expected_client_state_bytes": 2 * model_bytes * len(spec.state),
                "server_state_bytes": server, "model_bytes": model_bytes,
            })
    return rows


# ---------------------------------------------------------------------------- flatness
def _landscape_seconds(model: torch.nn.Module, split: Split, steps: int, batch_size: int = 512) -> float:
    """Seconds of one ``steps`` x ``steps`` loss landscape of ``model`` on ``split``, as
    ``flatflower landscape`` computes it (tools/landscape.py: two filter-normalised directions,
    then steps² full-split losses over [-1, 1]²); no plotting or file writing."""
    from flatflower.tools.landscape import Progress, grid, losses, random_directions, surface_points, trainable

    device = next(model.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    directions = random_directions(trainable(model), seed=0, dims=2)
    losses(model, split, batch_size, directions, surface_points(grid(-1.0, 1.0, steps), 2),
           Progress(steps ** 2, silent=True))
    _sync(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _counting_hvps():
    """Counts SplitLoss.hvp calls (each one HVP over the whole split) while it is open."""
    original, count = SplitLoss.hvp, [0]

    def hvp(self, v):
        count[0] += 1
        return original(self, v)

    SplitLoss.hvp = hvp
    try:
        yield count
    finally:
        SplitLoss.hvp = original


def _measure_seconds(model, split: Split, hvp: str, knobs: dict, batch_size: int) -> tuple[float, int]:
    """Seconds of one measure() with ``hvp`` and the HVPs it took."""
    device = next(model.parameters()).device
    with _counting_hvps() as count:
        _sync(device)
        t0 = time.perf_counter()
        measure(model, split, batch_size=batch_size, iters=knobs["iters"], probes=knobs["probes"], hvp=hvp)
        _sync(device)
    return time.perf_counter() - t0, count[0]


def _hvp_seconds(model, split: Split, hvp: str, repeats: int, batch_size: int) -> float:
    """The fastest of ``repeats`` HVPs over the whole split, after one warm-up."""
    split_loss = SplitLoss(model, split, batch_size, hvp)
    v = random_vector(split_loss.params, torch.Generator().manual_seed(0))
    split_loss.hvp(v)
    times = []
    for _ in range(repeats):
        _sync(split_loss.device)
        t0 = time.perf_counter()
        split_loss.hvp(v)
        _sync(split_loss.device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _flatness_run(model_name: str, workdir: Path, knobs: dict) -> tuple[Path, dict]:
    """The in-process FedAvg run whose rounds are timed and whose final model is measured."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    plan = {**FLATNESS_RUNS[model_name], **knobs["run"]}
    cfg = {"algorithm": "fedavg", "dataset": plan["dataset"], "model": model_name, "partition": "iid",
           "local-epochs": plan["local-epochs"], "num-server-rounds": plan["rounds"],
           "flatness-every": plan["flatness-every"], "flatness-iters": knobs["iters"],
           "flatness-probes": knobs["probes"],
           # the work of a round alone: no client self-report passes, event files or checkpoints
           "client-eval": False, "tensorboard": False, "checkpoint-every": 0,
           "run-dir": str(workdir / f"flatness-{model_name}")}
    with quiet_flower():
        run_dir, _ = run_inprocess(cfg, plan["clients"])
    return run_dir, plan


def _flatness_row(model_name: str, settings: Settings, workdir: Path, knobs: dict, say) -> dict[str, Any]:
    from flatflower.tools.saved import SavedRun

    say(f"flatness: {model_name} run")
    run_dir, plan = _flatness_run(model_name, workdir, knobs)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rounds = [r for r in rows if r["round"] >= 1]
    saved = SavedRun.open(run_dir)
    data = saved.dataset()
    model, split = saved.model("final", data).to(settings.device), saved.split("test", data)
    batch = saved.cfg.eval_batch_size
    repeats = min(knobs["repeats"], plan.get("repeats", knobs["repeats"]))
    say(f"flatness: {model_name} HVPs and measure()")
    per_hvp = {m: _hvp_seconds(model, split, m, max(repeats, 2), batch) for m in HVP_METHODS}  # warms up
    timed: dict[str, list[tuple[float, int]]] = {m: [] for m in HVP_METHODS}
    for _ in range(repeats):  # the methods interleaved, the fastest of each kept
        for method in HVP_METHODS:
            timed[method].append(_measure_seconds(model, split, method, knobs, batch))
    hvp = {m: {"flatness_seconds": min(timed[m])[0], "hvps": min(timed[m])[1], "seconds_per_hvp": per_hvp[m]}
           for m in HVP_METHODS}
    say(f"flatness: {model_name} landscape")
    landscape = _landscape_seconds(model, split, knobs["steps"], batch)
    round_seconds = statistics.median([r["seconds"] for r in rounds[1:] or rounds])
    out = {"model": model_name, "dataset": plan["dataset"], "split": "test", "examples": len(split),
           "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "eval_batch_size": batch, "clients": plan["clients"], "local_epochs": plan["local-epochs"],
           "batch_size": saved.cfg.batch_size, "rounds": plan["rounds"],
           "round_seconds": round_seconds, "hvp": hvp,
           "faster_hvp": min(HVP_METHODS, key=lambda m: hvp[m]["seconds_per_hvp"]),
           "landscape_points": knobs["steps"] ** 2, "landscape_seconds": landscape,
           "flatness_vs_round": hvp[RUN_HVP]["flatness_seconds"] / round_seconds,
           "landscape_vs_round": landscape / round_seconds}
    measured = [r for r in rounds if r.get("flatness_seconds") is not None]
    if measured:  # flatness-every in the run itself: what it added
        added, spent = sum(r["flatness_seconds"] for r in measured), sum(r["seconds"] for r in rounds)
        every = plan["flatness-every"]
        out["every"] = {"flatness_every": every, "rounds": len(rounds),
                        "measurements": len(measured), "flatness_seconds": added, "round_seconds": spent,
                        "overhead": added / spent, "within_target": added / spent <= FLATNESS_TARGET,
                        # one measurement against `every` median rounds: round 1's warm-up left out
                        "overhead_steady": added / len(measured) / (every * round_seconds)}
    return out


def bench_flatness(settings: Settings, workdir: Path, say=_silent) -> dict[str, Any]:
    knobs = FLATNESS_QUICK if settings.quick else FLATNESS_FULL
    return {"iters": knobs["iters"], "probes": knobs["probes"], "landscape_steps": knobs["steps"],
            "repeats": knobs["repeats"], "run_hvp": RUN_HVP, "device": settings.device,
            "target_overhead": FLATNESS_TARGET,
            "models": [_flatness_row(m, settings, workdir, knobs, say)
                       for m in settings.flatness_models or knobs["models"]]}


# ---------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        import flwr

        info["flwr"] = flwr.__version__
    except Exception:  # noqa: BLE001 - informative only
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def run_bench(settings: Settings, workdir: Path, say=_silent) -> dict[str, Any]:
    """Every section; ``say(text)`` is told what is being measured (flatflower.tools.progress.Steps)."""
    t0 = time.perf_counter()
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    report: dict[str, Any] = {"machine": machine(), "settings": asdict(settings)}
    if "compute" in settings.sections:
        report["compute"] = bench_compute(settings, say)
    if "overhead" in settings.sections:
        with quiet_flower():
            report["overhead"] = bench_overhead(settings, workdir, say)
    if "communication" in settings.sections:
        report["communication"] = bench_communication(workdir, say)
    if "memory" in settings.sections:
        report["memory"] = bench_memory(settings, workdir, say)
    if "throughput" in settings.sections:
        report["throughput"] = bench_throughput(settings.throughput or ThroughputSettings(), workdir, say)
    if "flatness" in settings.sections:
        report["flatness"] = bench_flatness(settings, workdir, say)
    if "trial" in settings.sections:
        report["trial"] = bench_trial(settings.trial or TrialSettings(), workdir, say)
    report["seconds"] = time.perf_counter() - t0
    return report


def print_tables(report: dict[str, Any]) -> str:
    out = []
    if "compute" in report:
        out.append(_compute_table(report))
    if "overhead" in report:
        out.append(_overhead_table(report))
    if "communication" in report:
        out.append(_communication_table(report))
    if "memory" in report:
        out.append(_memory_table(report))
    if "throughput" in report:
        out.append(render_throughput(report["throughput"]))
    if "flatness" in report:
        out.append(_flatness_table(report))
    if "trial" in report:
        out.append(render_trial(report["trial"]))
    return "\n".join(out)


def _compute_table(report: dict[str, Any]) -> str:
    from flatflower.tools.report import render_table

    comp = [{"algorithm": r["algorithm"], "s/step": f"{r['seconds_per_step'] * 1e3:.2f} ms",
             "x SGD": f"{r['cost_vs_sgd']:.2f}", "expected": f"{r['expected_cost']:.2f}",
             "grad passes": f"{r['gradient_passes_per_step']:.2f}",
             "within 10%": "yes" if r["within_10pct"] else "no"} for r in report["compute"]]
    return render_table(comp, "compute: cost per local step vs a plain SGD step")


def _overhead_table(report: dict[str, Any]) -> str:
    from flatflower.tools.report import render_table

    o = report["overhead"]
    over = [{"what": "pure training (sum over clients)", "seconds": f"{o['pure_training_seconds']:.3f}"},
            {"what": "in-process round (ours)", "seconds": f"{o['inprocess_round_seconds']:.3f}"},
            {"what": "plain Flower FedAvg round", "seconds": f"{o['plain_flower_fedavg_round_seconds']:.3f}"},
            {"what": "in-process round, clients' self-report + TensorBoard on (the defaults)",
             "seconds": f"{o['inprocess_round_seconds_observed']:.3f}"}]
    for engine in ("ray", *DEPLOYMENTS):
        if "round_seconds" in o[engine]:
            over.append({"what": f"{engine} round ({o[engine]['vs_inprocess_round']:.1f}x in-process)",
                         "seconds": f"{o[engine]['round_seconds']:.3f}"})
    return render_table(over, f"overhead: one FedAvg round, {o['clients']} clients "
                              f"(ours / plain Flower = {o['ours_vs_plain_flower']:.3f})")


def _communication_table(report: dict[str, Any]) -> str:
    from flatflower.tools.report import render_table

    comm = [{"algorithm": r["algorithm"], "down": r["records_down"], "up": r["records_up"],
             "payload down/up": f"{r['bytes_down_per_client']:.0f}/{r['bytes_up_per_client']:.0f}",
             "theory down/up": f"{r['theoretical_down']}/{r['theoretical_up']}",
             "wire/theory": f"{r['wire_vs_theory_down']:.3f}/{r['wire_vs_theory_up']:.3f}"}
            for r in report["communication"]]
    return render_table(comm, "communication per client per round (bytes)")


def _memory_table(report: dict[str, Any]) -> str:
    from flatflower.tools.report import render_table

    mem = [{"algorithm": r["algorithm"], "clients": r["clients"],
            "client state (max)": r["client_state_bytes_max"],
            "expected": r["expected_client_state_bytes"], "server state": r["server_state_bytes"]}
           for r in report["memory"]]
    return render_table(mem, "memory: state bytes")


def _flatness_table(report: dict[str, Any]) -> str:
    from flatflower.tools.report import render_table

    f = report["flatness"]
    rows, lines = [], []
    for r in f["models"]:
        for i, (method, h) in enumerate(r["hvp"].items()):
            rows.append({"model": f"{r['model']} ({r['examples']} ex.)" if i == 0 else "",
                         "round (s)": f"{r['round_seconds']:.2f}" if i == 0 else "",
                         "HVP": method + (" (runs)" if method == f["run_hvp"] else ""),
                         "measure (s)": f"{h['flatness_seconds']:.2f}", "HVPs": h["hvps"],
                         "ms per HVP": f"{h['seconds_per_hvp'] * 1e3:.1f}",
                         "measure / round": f"{h['flatness_seconds'] / r['round_seconds']:.2f}",
                         "landscape (s)": f"{r['landscape_seconds']:.1f}" if i == 0 else "",
                         "landscape / round": f"{r['landscape_vs_round']:.1f}" if i == 0 else ""})
        if "every" in r:
            e = r["every"]
            lines.append(f"{r['model']}: flatness-every {e['flatness_every']} over {e['rounds']} rounds "
                         f"({e['measurements']} measured) added {e['overhead']:.1%}, "
                         f"{e['overhead_steady']:.1%} of {e['flatness_every']} median rounds "
                         f"(target <= {f['target_overhead']:.0%}: {'yes' if e['within_target'] else 'no'})")
    steps = f["landscape_steps"]
    title = (f"flatness: one measure() ({f['iters']} power iterations at most, {f['probes']} probes) "
             f"and one {steps}x{steps} landscape vs a round, {f['device']}")
    return render_table(rows, title) + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = ({"model": "cnn", "input_shape": "1,8,8", "batch_size": 32, "steps": 8, "repeats": 3}
                if args.quick else
                {"model": "lenet", "input_shape": "3,32,32", "batch_size": 50, "steps": 20, "repeats": 5})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        settings = Settings.from_args(args)
        if settings.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {settings.device}: CUDA is not available on this machine")
        build_model(settings.model, settings.input_shape, settings.num_classes, seed=0)
        if min(settings.batch_size, settings.steps, settings.repeats) < 1:
            raise ValueError("--batch-size, --steps and --repeats must be >= 1")
        if settings.threads < 0:
            raise ValueError("--threads must be >= 0")
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from flatflower.tools.progress import Steps

    steps = Steps("bench")
    try:
        with tempfile.TemporaryDirectory(prefix="flatflower-bench-") as tmp:
            report = run_bench(settings, Path(tmp), steps)
    finally:
        steps.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=float))
    print(print_tables(report))
    print(f"bench report written to {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
