"""``flatflower check-algorithm REF``: the conformance kit of an algorithm (docs/check-algorithm.md).

Each check runs the real ServerApp and ClientApps (the in-process grid, and the other engines
asked for) on a tiny problem that takes seconds: multinomial logistic regression (``logreg``)
on the offline ``synthetic`` data, a few clients (full participation), full-batch local steps
(K = 3, lr 0.1), the algorithm's defaults (a required key at its example value). The checks,
one line each (PASS / FAIL / SKIP, what was compared, the number):

1. **loads**: the spec passes the registry's checks (strategies/registry.py ``spec_problems``)
   and the declared client-state check (its client rule keeps only what it declares);
2. **engines agree**: every engine's final model is the in-process one's to float tolerance
   (:data:`ENGINE_TOLERANCE`, relative);
3. **resume**: a run stopped after round 1 (its checkpoint) whose ServerApp restarts on the same
   nodes ends with the uninterrupted run's model, bit for bit;
4. **client state**: the same with fresh nodes (new contexts) whose state comes only from the
   files of ``client-state-dir``, and the clients keep only the declared state records;
5. **records on the wire**: every train message carries exactly the model, the config and the
   spec's ``down`` records, its config exactly the protocol's keys and the spec's ``values``;
   every reply exactly the model, metrics, config and the spec's ``up`` records;
6. **bad hyperparameters**: for each key, a value of the wrong type and, where it has a check,
   the values among NaN, -1 and infinity that fail it are refused by ``RunConfig.from_mapping``
   naming the key;
7. **reference**: with ``--reference module:callable``, the user's float64 numpy reference of
   one round (it receives a :class:`~flatflower.common.reference_problem.ReferenceProblem`)
   gives the algorithm's model to :data:`REFERENCE_TOLERANCE`.

The runs go to a temporary directory (``work_dir`` keeps them). The command is tools/commands.py's
``check_algorithm``, over the parser of tools/parsers.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message, MessageType

from flatflower.client.app import app as client_app
from flatflower.client.rule_state import RuleStateError, check_declared_state
from flatflower.common import protocol as P
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.data import client_split, model_shape
from flatflower.common.models import build_model
from flatflower.common.params import is_required
from flatflower.common.reference_problem import ReferenceProblem, grad
from flatflower.common.references import BadReference, call, is_reference, resolve
from flatflower.runtime.engines.inprocess import InProcessGrid, RunStopped, VectorizedGrid, check_vectorizable
from flatflower.server.run import run_server
from flatflower.strategies import registry
from flatflower.strategies.aggregate import client_weights
from flatflower.strategies.registry import AlgorithmSpec, spec_problems
from flatflower.tools.parsers import CHECK_CLIENTS, CHECK_DEFAULT_ENGINES, CHECK_ENGINES, CHECK_ROUNDS
from flatflower.tools.parsers import check_algorithm as build_parser  # the command's (tools/commands.py)

__all__ = ["BadInput", "Check", "Kit", "build_parser", "run_checks", "summary"]

# the tiny problem (the algorithm tests' own: tests/helpers.py run): full-batch steps on logreg
PROBLEM = {"dataset": "synthetic", "model": "logreg", "partition": "iid", "seed": 3, "local-steps": 3,
           "batch-size": 100_000, "lr": 0.1, "client-eval": False, "tensorboard": False}
CLIENTS, ROUNDS, ENGINES, DEFAULT_ENGINES = CHECK_CLIENTS, CHECK_ROUNDS, CHECK_ENGINES, CHECK_DEFAULT_ENGINES
STATE_DIR = "client-state"  # the clients' state files, inside each run's directory
# Engines agree to 1e-5 relative (to max(1, max |w|)): each engine runs the same float32
# arithmetic in another order (the vectorised one batches clients under vmap), so their models
# differ by rounding only: float32's 1.2e-7 per operation, accumulated over a few rounds of K
# steps (the 28 built-ins agree bit for bit on this problem on a CPU; CNNs elsewhere to ~1e-8
# relative, docs/engines.md). An error of the algorithm's own (a state not carried, a term
# missing) moves the model by lr x a gradient, ~1e-3 and more: 1e-5 sits far from either.
ENGINE_TOLERANCE = 1e-5
REFERENCE_TOLERANCE = 1e-6  # float32 pipeline vs a float64 reference, as the algorithm tests hold it
# Ray's actors can fail under load (ActorUnavailableError): a missing reply is re-sent, never skipped
RAY_RETRY = {"too-few-replies": "retry", "max-retries": 8}
STOP_AFTER = 1  # the resume checks stop a run after this round (its checkpoint)
# the keys of a train message's config that are the protocol's, not the algorithm's
TRAIN_CONFIG = (P.SERVER_ROUND, P.NONCE, P.STATE_ROUND)


class BadInput(ValueError):
    """An algorithm or a ``--reference`` that cannot be loaded (one line: exit 2 in the CLI)."""


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``ok`` (a skipped check is ok), and its line."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False

    @property
    def line(self) -> str:
        return f"{'SKIP' if self.skipped else 'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def passed(name: str, detail: str) -> Check:
    return Check(name, True, detail)


def failed(name: str, detail: str) -> Check:
    return Check(name, False, detail)


def skipped(name: str, detail: str) -> Check:
    return Check(name, True, detail, skipped=True)


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and its message's first line, bounded."""
    text = " ".join(str(err).split("\n", 1)[0].split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


# ---------------------------------------------------------------- the runs
@dataclass(frozen=True)
class WireRecords:
    """What one message carried: its record names by kind, and its config's keys."""

    node: int
    round: int
    arrays: frozenset
    configs: frozenset
    metrics: frozenset
    config_keys: frozenset

    @classmethod
    def of(cls, msg: Message, node: int) -> WireRecords:
        content = msg.content
        config = content.config_records.get(P.CONFIG)
        return cls(node, int(msg.metadata.group_id or 0), frozenset(content.array_records),
                   frozenset(content.config_records), frozenset(content.metric_records),
                   frozenset(config.keys()) if config is not None else frozenset())


class TappedGrid(InProcessGrid):
    """The in-process grid, recording what every train message and reply carried
    (:class:`WireRecords`, for check 5) and stopping the run, as an interrupt would, when the
    first train message of round ``stop_before`` is pushed (its checkpoint then holds the
    rounds before it)."""

    def __init__(self, *args, stop_before: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_before = stop_before
        self.sent: list[WireRecords] = []
        self.received: list[WireRecords] = []
        self.errors: list[str] = []  # error replies to train messages

    def push_messages(self, messages):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if self.stop_before is not None and any(int(m.metadata.group_id) >= self.stop_before for m in train):
            self.stopping = True  # the base raises RunStopped, as for an interrupted run: nothing is sent
        else:
            self.sent += [WireRecords.of(m, m.metadata.dst_node_id) for m in train]
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for reply in replies:
            if reply.metadata.message_type != MessageType.TRAIN:
                continue
            if reply.has_content():
                self.received.append(WireRecords.of(reply, reply.metadata.src_node_id))
            else:
                self.errors.append(str(reply.error.reason).split("\n", 1)[0][:300])
        return replies

    def resume(self) -> None:
        """Let the nodes take messages again (the same nodes, their state kept)."""
        self.stopping, self.stop_before = False, None


@dataclass
class Run:
    """One run of the kit: its config, directory, grid (in-process engines) and error (None:
    completed)."""

    cfg: RunConfig
    grid: InProcessGrid | None
    error: str | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    def final(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "model_final.pt")

    def initial(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "model_init.pt")


def last_refusal(run_dir: Path) -> str:
    """``; the last refusal: client 0: <reason>`` (or failure), from the run's metrics.jsonl:
    why the server refused the replies of a run that failed ("" when it refused none)."""
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    for row in reversed(rows):
        for what, items in (("refusal", row.get("rejections")), ("failure", row.get("failures"))):
            if items:
                reason = " ".join(str(items[-1].get("reason", "")).split("\n", 1)[0].split())[:200]
                return f"; the last {what}: client {items[-1].get('partition')}: {reason}"
    return ""


def quiet():
    """Flower's and flatflower's logs below ERROR silenced while the kit's runs run (a failing
    algorithm's refusals are the checks' to report, in their lines)."""
    from flatflower.runtime.engines.inprocess import logs_at

    return logs_at(logging.ERROR)



class Kit:
    """The kit's runs of one algorithm, made once each and shared by the checks."""

    def __init__(self, spec: AlgorithmSpec, work_dir: Path, clients: int = CLIENTS, rounds: int = ROUNDS,
                 engines: Sequence[str] = DEFAULT_ENGINES):
        self.spec, self.work_dir, self.clients, self.rounds = spec, Path(work_dir), clients, rounds
        self.engines = list(dict.fromkeys(["inprocess", *engines]))  # the in-process engine: the baseline
        self.runs: dict[str, Run] = {}

    def config(self, name: str, **overrides: Any) -> RunConfig:
        """The problem's run config for run ``name`` (its own directory under the work dir)."""
        return RunConfig.from_mapping({
            **PROBLEM, **self.spec.example_config(), "num-partitions": self.clients,
            "num-server-rounds": self.rounds, "client-state-dir": STATE_DIR,
            "run-dir": str((self.work_dir / name).resolve()), **overrides})

    def grid(self, cfg: RunConfig, kind: type[InProcessGrid] = TappedGrid, **kwargs) -> InProcessGrid:
        # flatflower's ClientApp reads what it receives and builds fresh replies: no copies needed
        return kind(client_app, self.clients, cfg.to_dict(), copy_messages=False, **kwargs)

    @staticmethod
    def execute(cfg: RunConfig, grid: InProcessGrid, stopping: bool = False) -> str | None:
        """Run ``cfg`` over ``grid``: None when it completed (or, ``stopping``, stopped as
        asked), else its error in one line."""
        try:
            with quiet():
                run_server(grid, cfg)
        except RunStopped:
            return None if stopping else "the run was stopped"
        except Exception as err:  # noqa: BLE001 - the algorithm under test may raise anything
            return one_line(err) + last_refusal(Path(cfg.run_dir))
        return "it did not stop after round 1" if stopping else None

    def whole(self) -> Run:
        """The uninterrupted in-process run, its messages tapped: the baseline of checks 2-5."""
        if "whole" not in self.runs:
            cfg = self.config("whole")
            grid = self.grid(cfg)
            self.runs["whole"] = Run(cfg, grid, self.execute(cfg, grid))
        return self.runs["whole"]

    def on_engine(self, engine: str) -> Run:
        """The same run on ``engine`` (vectorized or ray)."""
        if engine == "inprocess":
            return self.whole()
        if engine not in self.runs:
            self.runs[engine] = self._vectorized() if engine == "vectorized" else self._ray()
        return self.runs[engine]

    def _vectorized(self) -> Run:
        cfg = self.config("vectorized")
        try:
            check_vectorizable(cfg)
            grid = self.grid(cfg, VectorizedGrid)
        except Exception as err:  # noqa: BLE001 - refused before it starts: its line
            return Run(cfg, None, one_line(err))
        return Run(cfg, grid, self.execute(cfg, grid))

    def _ray(self) -> Run:
        from flatflower.runtime import engines
        from flatflower.tools.prepare import app_dir

        cfg = self.config("ray", **RAY_RETRY, **{"min-replies": self.clients})
        logs = Path(cfg.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            with quiet(), contextlib.redirect_stdout(io.StringIO()):
                outcome = engines.run_ray(cfg, self.clients, app_dir(None, cfg), logs, timeout=600,
                                          on_poll=lambda: None)
        except Exception as err:  # noqa: BLE001
            return Run(cfg, None, one_line(err))
        return Run(cfg, None, None if outcome.ok else f"the Ray run did not complete: {outcome.details}"[:300])

    def stopped_and_resumed(self, name: str, state_dir: str, fresh_nodes: bool) -> tuple[Run, Run]:
        """A run stopped after round 1, then resumed from its checkpoint to the last round by
        a restarted ServerApp: on the same nodes (their state in memory), or on ``fresh_nodes``
        (new contexts: their state only in ``state_dir``'s files). (stopped, resumed)."""
        cfg = self.config(name, **{"client-state-dir": state_dir})
        grid = self.grid(cfg, stop_before=STOP_AFTER + 1)
        stopped = Run(cfg, grid, self.execute(cfg, grid, stopping=True))
        if stopped.error is None and not (stopped.run_dir / "checkpoint.pt").is_file():
            stopped.error = "no checkpoint was written after round 1"
        if stopped.error is not None:
            return stopped, Run(cfg, None, "not resumed: the stopped run failed")
        again = cfg.replace(resume=True)
        if fresh_nodes:
            grid = self.grid(again)
        else:
            grid.resume()
        before = len(grid.sent)
        resumed = Run(again, grid, self.execute(again, grid))
        rounds = sorted({m.round for m in grid.sent[before:]})
        if resumed.error is None and rounds[:1] != [STOP_AFTER + 1]:
            resumed.error = f"the resumed run trained rounds {rounds}, not from round {STOP_AFTER + 1} on"
        return stopped, resumed

    def one_round(self) -> Run:
        """One round in-process (check 7)."""
        if "one-round" not in self.runs:
            cfg = self.config("one-round", **{"num-server-rounds": 1})
            grid = self.grid(cfg)
            self.runs["one-round"] = Run(cfg, grid, self.execute(cfg, grid))
        return self.runs["one-round"]


# ---------------------------------------------------------------- comparing models
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every tensor (inf when their keys or shapes differ)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return math.inf
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def largest(model: dict[str, torch.Tensor]) -> float:
    return max((float(v.double().abs().max()) for v in model.values() if v.numel()), default=0.0)


def state_files(run: Run) -> list[Path]:
    """The clients' state files of ``run`` (client-state-dir inside its directory)."""
    root = run.run_dir / STATE_DIR
    return sorted(root.glob("partition-*/round-*.pt")) if root.is_dir() else []


def state_records(files: Sequence[Path]) -> set[str]:
    """The record names the clients' state files hold."""
    from flatflower.client.state import read_state_file

    return {name for f in files for name in read_state_file(f)}


def names(items) -> str:
    return ", ".join(sorted(items)) or "none"


# ---------------------------------------------------------------- 1. loads
def declared_state_problem(spec: AlgorithmSpec) -> str | None:
    """Why the client rule keeps what its declaration does not say (None: it keeps to it):
    the declared client-state check (flatflower.client.rule_state ``check_declared_state``:
    the rule built on a probe model, a few local steps, refused in one line)."""
    try:
        check_declared_state(spec.client, down=spec.down, values=spec.values, state=spec.state)
    except RuleStateError as err:
        return str(err)
    return None


def check_loads(spec: AlgorithmSpec, problems: Sequence[str], state: str | None) -> Check:
    """Check 1 from what :func:`load_algorithm` found: the registry's ``problems`` with the
    spec, and the declared client-state check's ``state``."""
    name = "loads"
    if problems:
        return failed(name, f"the registry refuses the spec: {'; '.join(problems)}")
    if state:
        return failed(name, f"the registry's checks pass; the declared client-state check fails: {state}")
    return passed(name, f"the registry's checks (halves, record names, keys) and the declared client-state "
                        f"check (client {spec.client.__name__} on a probe model) pass")


# ---------------------------------------------------------------- 2. engines agree
def check_engines_agree(kit: Kit) -> Check:
    name = "engines agree"
    base = kit.whole()
    if base.error:
        return failed(name, f"the in-process run failed: {base.error}")
    if len(kit.engines) == 1:
        return skipped(name, "only the in-process engine asked for (--engines)")
    reference = base.final()
    tolerance = ENGINE_TOLERANCE * max(1.0, largest(reference))
    found, bad = [], []
    for engine in kit.engines[1:]:
        other = kit.on_engine(engine)
        if other.error:
            return failed(name, f"the {engine} run failed: {other.error}")
        diff = max_abs_diff(reference, other.final())
        found.append(f"{engine} vs inprocess max abs diff {diff:.3g}")
        if not diff <= tolerance:
            bad.append(engine)
    detail = (f"final model after {kit.rounds} rounds: {'; '.join(found)} (tolerance {tolerance:.3g} = "
              f"{ENGINE_TOLERANCE:g} x max(1, max |w|))")
    return failed(name, f"{', '.join(bad)} disagree: {detail}") if bad else passed(name, detail)


# ---------------------------------------------------------------- 3. and 4. resume
def compared_to_whole(kit: Kit, resumed: Run) -> tuple[bool, str]:
    """(bit-identical, the words) of a resumed run's final model against the uninterrupted one's."""
    whole, mine = kit.whole().final(), resumed.final()
    if bit_identical(whole, mine):
        return True, "bit for bit (max abs diff 0)"
    return False, f"max abs diff {max_abs_diff(whole, mine):.3g}, bit-identical expected"


def check_resume(kit: Kit) -> Check:
    name = "resume"
    if kit.whole().error:
        return failed(name, f"the uninterrupted run failed: {kit.whole().error}")
    stopped, resumed = kit.stopped_and_resumed("resume", state_dir="", fresh_nodes=False)
    if stopped.error or resumed.error:
        return failed(name, f"stopped after round {STOP_AFTER}: {stopped.error or 'ok'}; resumed: {resumed.error}")
    same, words = compared_to_whole(kit, resumed)
    what = (f"stopped after round {STOP_AFTER} (checkpoint), the ServerApp restarted on the same nodes and "
            f"resumed to round {kit.rounds}: final model vs the uninterrupted run's: {words}")
    if same:
        return passed(name, what)
    return failed(name, f"{what} (the checkpoint holds the server rule's model and records: state kept "
                        "elsewhere on the rule, e.g. a counter attribute, is lost on a restart)")


def check_client_state(kit: Kit) -> Check:
    name = "client state"
    whole = kit.whole()
    if whole.error:
        return failed(name, f"the uninterrupted run failed: {whole.error}")
    written = state_records(state_files(whole))
    undeclared = written - set(kit.spec.state)
    if undeclared:
        return failed(name, f"the clients keep records {names(undeclared)} that the spec's state "
                            f"({names(kit.spec.state)}) does not declare: they are never read back")
    if not kit.spec.state:
        return passed(name, "no client state (the spec declares none, the clients wrote none)")
    stopped, resumed = kit.stopped_and_resumed("node-restart", state_dir=STATE_DIR, fresh_nodes=True)
    if stopped.error or resumed.error:
        return failed(name, f"stopped after round {STOP_AFTER}: {stopped.error or 'ok'}; resumed on fresh "
                            f"nodes: {resumed.error}")
    files = [f for f in state_files(stopped) if f.name == f"round-{STOP_AFTER:06d}.pt"]
    same, words = compared_to_whole(kit, resumed)
    what = (f"resumed after round {STOP_AFTER} on fresh nodes (new contexts), their state ({names(kit.spec.state)}) "
            f"from {len(files)} files of client-state-dir: final model vs the uninterrupted run's: {words}")
    return passed(name, what) if same else failed(name, what)


# ---------------------------------------------------------------- 5. records on the wire
def wire_problems(spec: AlgorithmSpec, cfg: RunConfig, sent: Sequence[WireRecords],
                  received: Sequence[WireRecords]) -> list[str]:
    """What the tapped messages carried beyond, or short of, the spec's declarations."""
    down = {P.MODEL, *spec.down}
    train_keys = {*TRAIN_CONFIG, *spec.values, *((P.SAMPLED_CLIENTS,) if cfg.dp_clip > 0 else ())}
    up = {P.MODEL, *spec.up}
    out = []

    def differ(what: str, msg: WireRecords, got: frozenset, expected: set, declared: str) -> None:
        if got != expected:
            extra, missing = sorted(got - expected), sorted(expected - got)
            out.append(f"{what} {msg.node} in round {msg.round} carries "
                       + "; ".join(p for p in (extra and f"undeclared {', '.join(map(repr, extra))}",
                                               missing and f"lacks {', '.join(map(repr, missing))}") if p)
                       + f" ({declared})")

    for msg in sent:
        differ("the train message to node", msg, msg.arrays, down, f"declared down: {names(spec.down)}")
        differ("the train message to node", msg, msg.configs | msg.metrics, {P.CONFIG}, "records: config only")
        differ("the train config to node", msg, msg.config_keys, train_keys, f"declared values: {names(spec.values)}")
    for msg in received:
        differ("the reply from node", msg, msg.arrays, up, f"declared up: {names(spec.up)}")
        differ("the reply from node", msg, msg.configs | msg.metrics, {P.CONFIG, P.METRICS},
               "records: config and metrics")
    return out


def check_wire_records(kit: Kit) -> Check:
    name = "records on the wire"
    whole = kit.whole()
    grid = whole.grid
    problems = wire_problems(kit.spec, whole.cfg, grid.sent, grid.received)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        run = f"; the run: {whole.error}" if whole.error else ""
        return failed(name, f"{problems[0]}{more}{run}")
    if whole.error or not grid.sent:
        return failed(name, f"the run failed before its messages could be checked: {whole.error}")
    if grid.errors:
        return failed(name, f"{len(grid.errors)} train replies were errors: {grid.errors[0]}")
    spec = kit.spec
    return passed(name, f"{len(grid.sent)} train messages carried exactly arrays, config (+ down: {names(spec.down)}; "
                        f"config keys {', '.join(TRAIN_CONFIG)} + values: {names(spec.values)}); "
                        f"{len(grid.received)} replies exactly arrays, metrics, config (+ up: {names(spec.up)})")


# ---------------------------------------------------------------- 6. bad hyperparameters
NUMBERS = (math.nan, -1.0, math.inf)  # values a numeric key's check may refuse
WRONG_TYPE = {"float": "not-a-number", "int": "not-an-integer", "bool": "maybe"}


def bad_values(field_type: str, check) -> list[Any]:
    """The values of a key of ``field_type`` that must be refused: a wrong type, and those of
    :data:`NUMBERS` (or a text that is no choice) its check fails."""
    out: list[Any] = [WRONG_TYPE[field_type]] if field_type in WRONG_TYPE else []
    if check is None:
        return out
    candidates = (["no-such-choice"] if field_type == "str"
                  else [int(v) if field_type == "int" and math.isfinite(v) else v for v in NUMBERS
                        if field_type == "float" or math.isfinite(v)] if field_type in ("float", "int") else [])
    for value in candidates:
        try:
            fails = not check.ok(value)
        except Exception:  # noqa: BLE001 - a check that raises on it refuses it
            fails = True
        if fails:
            out.append(value)
    return out


def check_bad_hyperparameters(spec: AlgorithmSpec) -> Check:
    name = "bad hyperparameters"
    from typing import get_type_hints

    hints = get_type_hints(spec.params)
    fields = {k: f for k, f in spec.params.fields().items()}
    if not fields:
        return passed(name, "no keys of its own")
    base = spec.example_config()
    tried, accepted, unchecked = 0, [], []
    for key_name, f in fields.items():
        check = f.metadata.get("check")
        if check is None and not is_required(f):
            unchecked.append(key_name)
        for value in bad_values(getattr(hints[f.name], "__name__", str(hints[f.name])), check):
            tried += 1
            try:
                RunConfig.from_mapping({**base, key_name: value})
            except ConfigError as err:
                if key_name not in str(err):
                    accepted.append(f"{key_name}={value!r} refused without naming the key: {err}")
                continue
            accepted.append(f"{key_name}={value!r} accepted (its check: {check.text if check else 'none'})")
    note = f"; without a check (any value of its type goes): {', '.join(unchecked)}" if unchecked else ""
    if accepted:
        return failed(name, f"{accepted[0]}" + (f" (and {len(accepted) - 1} more)" if len(accepted) > 1 else "") + note)
    return passed(name, f"{tried} bad values of {len(fields)} key{'s' if len(fields) > 1 else ''} (NaN, negative, infinite, wrong type, each where "
                        f"its check refuses it) each refused by the run config naming its key{note}")


# ---------------------------------------------------------------- 7. the user's reference
def trainable_names(cfg: RunConfig) -> list[str]:
    input_shape, num_classes = model_shape(cfg)
    model = build_model(cfg.resolved_model(), input_shape, num_classes, seed=cfg.seed)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def reference_problem(run: Run) -> ReferenceProblem:
    """Round 1 of ``run`` as its reference sees it (docs/check-algorithm.md)."""
    cfg = run.cfg
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sampled = next(r for r in rows if r["round"] == 1)["sampled_partitions"]
    n = cfg.num_partitions
    splits = [client_split(cfg, pid, n) for pid in sampled]
    clients = [(s.x.double().numpy(), s.y.numpy().astype(np.int64)) for s in splits]
    init = run.initial()
    return ReferenceProblem(
        w0=[init[k].double().numpy() for k in trainable_names(cfg)], clients=clients,
        weights=np.array(client_weights([len(y) for _, y in clients], cfg.aggregation)),
        params=dict(cfg.params.to_dict()), lr=cfg.round_lr(1), local_steps=cfg.local_steps,
        server_lr=cfg.server_lr, grad=grad, num_clients=n)


def check_reference(kit: Kit, reference: Callable[..., Any] | None, text: str | None) -> Check:
    name = "reference"
    if reference is None:
        return skipped(name, "no --reference module:callable given (one round against your float64 numpy reference)")
    run = kit.one_round()
    if run.error:
        return failed(name, f"the one-round run failed: {run.error}")
    problem = reference_problem(run)
    try:
        got = reference(problem)
    except Exception as err:  # noqa: BLE001 - the user's reference may raise anything
        return failed(name, f"{text} raised {one_line(err)}")
    names_ = trainable_names(run.cfg)
    final = run.final()
    expected = [final[k].double().numpy() for k in names_]
    try:
        got = [np.asarray(a, dtype=np.float64) for a in got]
    except (TypeError, ValueError) as err:
        return failed(name, f"{text} returned {type(got).__name__}, not a list of arrays ({err})")
    shapes = [a.shape for a in expected]
    if [a.shape for a in got] != shapes:
        return failed(name, f"{text} returned arrays of shapes {[list(a.shape) for a in got]}, the model's "
                            f"trainable parameters have {[list(s) for s in shapes]}")
    diff = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
    moved = max(float(np.abs(e - w).max()) for e, w in zip(expected, problem.w0))
    what = (f"one round ({len(problem.clients)} clients, {problem.local_steps} full-batch steps) vs {text} "
            f"(float64): max abs diff {diff:.3g} (tolerance {REFERENCE_TOLERANCE:g}; the round moved the "
            f"model by up to {moved:.3g})")
    return passed(name, what) if diff <= REFERENCE_TOLERANCE else failed(name, what)


# ---------------------------------------------------------------- the kit
def load_algorithm(text: str) -> tuple[AlgorithmSpec, list[str], str | None]:
    """(the spec ``text`` names, the registry's problems with it, the declared client-state
    check's refusal or None): a built-in or an already registered reference, else the user's
    ``package.module:callable``, registered when it passes both (the registry's own load
    refuses it otherwise). BadInput when it names nothing usable (not a spec)."""
    if text in registry.ALGORITHMS:
        spec = registry.ALGORITHMS[text]
        return spec, spec_problems(spec) if text in registry.BUILT_IN else [], declared_state_problem(spec)
    if not is_reference(text):
        try:
            registry.get(text)
        except ValueError as err:
            raise BadInput(str(err)) from None
    try:
        make = resolve(text, "algorithm")
        spec = make if isinstance(make, AlgorithmSpec) else call(make, (), "algorithm", text)
    except BadReference as err:
        raise BadInput(str(err)) from None
    if not isinstance(spec, AlgorithmSpec):
        raise BadInput(f"algorithm={text!r} returned a {type(spec).__name__}, not a flatflower.AlgorithmSpec")
    problems = spec_problems(spec)
    state = None if problems else declared_state_problem(spec)
    if problems or state:
        return spec, problems, state
    try:
        return registry.load(text), [], None
    except ValueError as err:
        raise BadInput(str(err)) from None


def load_reference(text: str | None) -> Callable[..., Any] | None:
    if text is None:
        return None
    try:
        return resolve(text, "--reference")
    except BadReference as err:
        raise BadInput(str(err)) from None


CHECKS = ("loads", "engines agree", "resume", "client state", "records on the wire", "bad hyperparameters",
          "reference")


def run_checks(algorithm: str, reference: str | None = None, engines: Sequence[str] = DEFAULT_ENGINES,
               rounds: int = ROUNDS, clients: int = CLIENTS, work_dir: str | Path | None = None,
               out: Callable[[str], None] = print) -> list[Check]:
    """Every check of ``algorithm`` (a built-in name or ``package.module:callable``), each
    line given to ``out`` as it is decided; ``reference``: ``module:callable`` for check 7.
    The runs go to ``work_dir`` (kept), else to a temporary directory (removed). BadInput
    (nothing run) when the algorithm or the reference cannot be loaded, or an engine is
    unknown, or ``rounds`` < 2 (the resume checks stop a run after its first)."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise BadInput(f"unknown engine {unknown[0]!r}: choose among {', '.join(ENGINES)}")
    if rounds < STOP_AFTER + 1 or clients < 1:
        raise BadInput(f"the kit needs rounds >= {STOP_AFTER + 1} (got {rounds}) and clients >= 1 (got {clients})")
    spec, problems, state = load_algorithm(algorithm)
    user_reference = load_reference(reference)
    results: list[Check] = []

    def emit(check: Check) -> None:
        results.append(check)
        out(check.line)

    emit(check_loads(spec, problems, state))
    if algorithm not in registry.ALGORITHMS:  # the registry refused it: nothing else can run it
        for name in CHECKS[1:]:
            emit(skipped(name, "the algorithm does not load"))
        return results
    temporary = work_dir is None
    root = Path(tempfile.mkdtemp(prefix="flatflower-check-")) if temporary else Path(work_dir)
    root.mkdir(parents=True, exist_ok=True)
    kit = Kit(spec, root, clients=clients, rounds=rounds, engines=engines)
    try:
        emit(check_engines_agree(kit))
        emit(check_resume(kit))
        emit(check_client_state(kit))
        emit(check_wire_records(kit))
        emit(check_bad_hyperparameters(spec))
        emit(check_reference(kit, user_reference, reference))
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    return results


def summary(results: Sequence[Check], seconds: float | None = None) -> str:
    """The last line: how many checks passed, failed and were skipped (and the time)."""
    counts = [(sum(r.ok and not r.skipped for r in results), "passed"), (sum(not r.ok for r in results), "failed"),
              (sum(r.skipped for r in results), "skipped")]
    took = f" ({seconds:.1f}s)" if seconds is not None else ""
    return f"{len(results)} checks: {', '.join(f'{n} {what}' for n, what in counts if n or what == 'passed')}{took}"
