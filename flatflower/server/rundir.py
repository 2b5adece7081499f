"""The run directory: everything needed to audit or reproduce a run.

    config.json      resolved run config + versions + seed + the machines it ran on
    partition.json   partition id -> indices into the training split (partition = local: each
                     node's training and held-out sizes, as declared at its first handshake)
    metrics.jsonl    one line per round (round 0 = the initial model)
    clients.jsonl    one line per sampled client per round (server/clients.py)
    privacy.jsonl    dp.clip > 0: each round's sampling rate and noise multiplier, append-only
                     (never truncated: the privacy ledger a resume goes on from; server/run.py)
    progress.jsonl   events inside a round (server/progress.py), for the CLI's live display
    events.out.tfevents.*  TensorBoard (server/tensorboard.py), when it is installed
    model_init.pt    state_dict before round 1
    model_final.pt   state_dict after the last round
    summary.json     final accuracy, rounds, wall time (written when the run ends)
    checkpoint.pt    the latest checkpoint: round, global model, all strategy state
    client-state/    (when clients mirror their state here) partition-<i>/round-<r>.pt
    manifest.json    sha256 and size of every file a resume reads, sealed under the user's
                     record key, kept outside the run directory (server/manifest.py, recordkey.py)
    .lock            held (flock) by the process running or resuming the run

JSON files, models and checkpoints are written atomically (temporary file + rename), so a
failed write (a full disk, a read-only directory) leaves the previous checkpoint intact and
resumable; it is reported as one :class:`RunWriteError` line. An existing run is never
overwritten: a directory that already holds metrics.jsonl is refused, unless the run is
resumed from its checkpoint, and only one process uses a run directory at a time. Files read
back are loaded with ``torch.load(weights_only=True)``: a file that needs unpickling arbitrary
objects is refused, never run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import os
import platform
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flatflower.common import protocol as P
from flatflower.common import schema
from flatflower.common.config import RunConfig, defaults, user_path
from flatflower.server import machine, recordkey
from flatflower.server.files import RunWriteError, open_file, write_json, writing  # noqa: F401 - used through rundir too
from flatflower.server.manifest import Manifest, digest


class RunDirError(RuntimeError):
    """The run directory cannot be used (exists with a run in it, in use, not writable...)."""




def refuse_links(run_dir: Path) -> None:
    """RunDirError naming the first symbolic link inside ``run_dir`` (flatflower writes none:
    one there was planted to redirect its reads or writes, logs/ and client-state/ included)."""
    for root, dirs, files in os.walk(run_dir):
        for name in [*dirs, *files]:
            if os.path.islink(os.path.join(root, name)):
                raise RunDirError(f"{os.path.join(root, name)} is a symbolic link; flatflower never "
                                  "follows links in a run directory (remove it)")


def load_tensors(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only. A file that
    asks to unpickle anything else is refused (RunDirError), as is a damaged one or a link."""
    try:
        f = open_file(path, "rb")
    except OSError as err:
        raise RunDirError(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        with f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a damaged file
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line),
                      lines[0] if lines else type(err).__name__)
        raise RunDirError(f"{what} {path} is corrupt or unreadable, or holds objects other than "
                          f"tensors, which are never unpickled ({detail[:200]})") from None


def path_name(name: str) -> str:
    """``name`` as a part of a path: a reference's colon (``mypkg.algo:spec``, a user's
    algorithm or dataset) becomes a dot, as tar, ``docker -v`` and ``PATH``-like lists read a
    colon as a separator."""
    return name.replace(":", ".")


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{path_name(cfg.algorithm)}-{path_name(cfg.dataset)}-s{cfg.seed}-{stamp}-{os.getpid()}"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("flatflower", "flwr"):
        out[dist] = _version(dist)
    code = code_version()
    if code:
        out["flatflower-code"] = code
    return out


@functools.cache
def code_version() -> str | None:
    """The git commit of the checkout this code runs from, with ``+modified`` when tracked
    files differ from it (None outside a git checkout, e.g. an installed wheel or an image);
    read once per process, when its code was imported.
    A sweep's runs each import the code as it is when they start: an edit in the checkout
    mid-sweep shows here, and ``flatflower report`` warns about runs of different code."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'+modified' if changed else ''}" if commit else None


def write_recorded(path: Path, data: Any) -> None:
    """:func:`write_json` of a file a resume reads (config.json, partition.json,
    vectorized.json), recorded in its run directory's manifest (server/manifest.py)."""
    text = json.dumps(data, indent=1).encode()
    with contextlib.suppress(OSError):
        with open_file(path, "rb") as f:
            if f.read(len(text) + 1) == text:  # as it is (vectorized.json, every round): no write at all
                return
    with Manifest(path.parent).replacing(path.name, digest(text)), writing(path, "xb") as f:
        f.write(text)


CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT = 3  # 3: the clients' last accepted rounds in the participation state
# Run-config keys a resumed run may change; every other key must equal the checkpoint's (the
# client-state-dir too: the clients' duals and control variates live there).
RESUME_MAY_CHANGE = ("num-server-rounds", "resume", "run-dir", "round-timeout", "node-wait-timeout",
                     "min-available-nodes", "checkpoint-every", "data-dir",
                     "download", "fraction-evaluate", "evaluate-every", "eval-batch-size", "client-eval", "tensorboard",
                     "flatness-every", "flatness-rho", "flatness-iters", "flatness-probes")


def load_checkpoint(run_dir: str | Path) -> dict:
    """The checkpoint of ``run_dir``, or RunDirError saying why it cannot be used."""
    path = user_path(str(run_dir), "run directory").resolve() / CHECKPOINT
    if not path.is_file():
        raise RunDirError(f"no checkpoint in {path.parent} (checkpoint-every=0, or the run "
                          "stopped before its first checkpoint): nothing to resume")
    ckpt = load_tensors(path, "checkpoint")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise RunDirError(f"checkpoint {path} is not a flatflower checkpoint (format {CHECKPOINT_FORMAT})")
    try:
        check_checkpoint(ckpt)
    except ValueError as err:
        raise RunDirError(f"checkpoint {path} is damaged: {err}") from None
    return ckpt


def check_checkpoint(ckpt: dict) -> None:
    """ValueError naming the first field of a checkpoint's outer tables that is wrong (the
    strategy's own state is checked by its ``load_state_dict``, against the run's model)."""
    schema.table(ckpt, "checkpoint", format=schema.anything, round=schema.whole(0),
                 config=schema.any_table, strategy=schema.any_table, num_partitions=schema.whole(1),
                 sampling=schema.fields(seed=schema.anything, scheme=schema.anything))
    strategy = ckpt["strategy"]
    participation = strategy.get("participation")
    participation = participation if isinstance(participation, dict) else {}
    for key, inner, saved in (("round", "strategy.round", strategy.get("round")),
                              ("num_partitions", "strategy.participation.num_partitions",
                               participation.get("num_partitions"))):
        if saved != ckpt[key]:
            raise ValueError(f"checkpoint.{key} is {ckpt[key]}, {inner} is {saved!r:.40}")


def check_resumable(cfg: RunConfig, ckpt: Mapping[str, Any]) -> None:
    """RunDirError if ``cfg`` changes a key that would make the resumed run a different run."""
    now, default = cfg.to_dict(), defaults()
    # a key the checkpoint lacks is newer than the code that wrote it, which ran as its default
    saved = {k: ckpt["config"].get(k, default.get(k)) for k in now}
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in now
               if k not in RESUME_MAY_CHANGE and saved[k] != now[k]]
    if changed:
        raise RunDirError("cannot resume with a different configuration: " + "; ".join(changed))
    if cfg.num_server_rounds < ckpt["round"]:
        raise RunDirError(f"num-server-rounds={cfg.num_server_rounds} is below the checkpoint's "
                          f"round {ckpt['round']}")


def check_client_state(cfg: RunConfig, ckpt: Mapping[str, Any], model: torch.nn.Module | None = None) -> None:
    """RunDirError unless the clients' state that the checkpoint's accepted rounds need is in
    this run directory's ``client-state-dir``: each client resumes from its state after its
    last accepted round (client/state.py), and a run that went on without it would be another
    run. A relative ``client-state-dir`` is inside the run directory, where the server sees it;
    an absolute one (e.g. node-local) is checked by each client when it trains. With
    ``model``, every tensor is checked too: the model's names, shapes and dtypes, finite
    values (client/state.py: check_state)."""
    from flatflower.client.layout import Layout
    from flatflower.client.state import MissingState, StateMirror, check_state
    from flatflower.strategies.registry import get as get_spec

    needed = set(get_spec(cfg.algorithm).state)
    if not needed or not cfg.client_state_dir:
        return
    path = Path(cfg.client_state_dir).expanduser()
    if path.is_absolute():
        saved = Path(str(ckpt["config"].get("run-dir", ""))).expanduser()
        if saved.is_absolute() and path.is_relative_to(saved) and saved != Path(cfg.run_dir):
            raise RunDirError(f"the clients' state of this run is in {path}, inside the run "
                              f"directory it was started in ({saved}), not in {cfg.run_dir}: a "
                              "moved or copied run directory of an older flatflower cannot resume")
        return
    accepted = ckpt["strategy"]["participation"]["accepted"]  # checked by load_state_dict
    layout = Layout(model) if model is not None else None
    for pid, rnd in sorted((int(p), int(r)) for p, r in accepted.items()):
        mirror = StateMirror(cfg.client_state_path(), pid, cfg.checkpoint_every)
        try:
            state = mirror.read(rnd)
            names = set(state)
        except MissingState as err:
            raise RunDirError(f"cannot resume: client {pid}'s state after round {rnd} is not usable "
                              f"({err}); the run needs every client's state of its checkpoint") from None
        if names - {P.LOCAL_BUFFERS} != needed:  # buffers = local adds the client's own buffers
            raise RunDirError(f"cannot resume: client {pid}'s state after round {rnd} "
                              f"({mirror.path(rnd)}) holds {sorted(names)}, not the {cfg.algorithm} "
                              f"client state {sorted(needed)}")
        if layout is not None:
            try:
                check_state(state, layout, str(mirror.path(rnd)))
            except ValueError as err:
                raise RunDirError(f"cannot resume: {err}") from None


def client_state_files(cfg: RunConfig, accepted: Mapping[Any, Any]) -> list[Path]:
    """The clients' state files a resume from a checkpoint with these ``accepted`` rounds
    reads, where the server sees them: inside the run directory (a relative
    ``client-state-dir``); [] for node-local state (each client checks its own)."""
    from flatflower.client.state import StateMirror

    if not cfg.client_state_dir or cfg.client_state_dir.startswith(("/", "~")):
        return []
    out = []
    for pid, rnd in accepted.items():
        with contextlib.suppress(TypeError, ValueError):
            if int(rnd) > 0:
                out.append(StateMirror(cfg.client_state_path(), int(pid), cfg.checkpoint_every).path(int(rnd)))
    return sorted(out)


class RunDir:
    def __init__(self, path: str | Path, resume: bool = False):
        self.path = user_path(str(path), "run-dir").resolve()
        if (self.path / "metrics.jsonl").exists() and not resume:
            raise RunDirError(
                f"{self.path} already holds a run (metrics.jsonl); choose another --run-dir"
            )
        try:  # the key that seals manifest.json, made now: a run never fails at its first checkpoint for it
            recordkey.load(create=True)
        except recordkey.RecordKeyError as err:
            raise RunDirError(str(err)) from None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run directory {self.path}: {err}") from None
        refuse_links(self.path)
        self.manifest = Manifest(self.path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[RunDir]:
        """Hold the run directory's lock for the block (RunDirError if another process holds it)."""
        with hold_lock(self.path / ".lock", f"{self.path} is in use by another flatflower run or "
                                            "resume; wait for it to end (or choose another --run-dir)"):
            yield self

    def record_failure(self, err: BaseException) -> None:
        """summary.json says the run failed and why (best effort: the disk may be full)."""
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        with contextlib.suppress(Exception):
            write_json(self.path / "summary.json", {"status": "failed", "error": reason[:500]})

    def write_config(self, cfg: RunConfig, device: torch.device | str | None = None, first_round: int = 1,
                     notes: Sequence[str] = (), **extra: Any) -> None:
        """config.json: the run config, versions, seed, ``extra`` (the model, the engine, the
        ``code`` it runs: server/codeid.py), ``machines``: the machine (server/machine.py) of
        each stretch of the run, the one running it now last (a resume keeps the list it finds,
        and adds a new machine at ``first_round``), and ``resume_notes``: what the user accepted
        at each resume (``notes``: records not sealed by this user, changed code), kept across
        resumes (absent while there is none)."""
        recorded = self._recorded("config.json") if cfg.resume else {}
        kept = recorded.get("resume_notes")
        kept = [n for n in kept if isinstance(n, dict)] if isinstance(kept, list) else []
        kept += [{"from_round": first_round, "note": note} for note in notes]
        write_recorded(self.path / "config.json",
                   {"config": cfg.to_dict(), "seed": cfg.seed, "algorithm": cfg.algorithm,
                    "versions": versions(), **extra,
                    "machines": machine.history(recorded.get("machines"), machine.fingerprint(device), first_round),
                    **({"resume_notes": kept} if kept else {})})

    def _recorded(self, name: str) -> dict[str, Any]:
        """The JSON table ``name`` as the run wrote it ({} when missing or not a table)."""
        try:
            with open_file(self.path / name) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_partition(self, cfg: RunConfig, parts: Sequence[np.ndarray]) -> None:
        write_recorded(self.path / "partition.json", {
            "dataset": cfg.dataset, "scheme": cfg.partition, "num_partitions": len(parts),
            "seed": cfg.data_seed(), "dirichlet_alpha": cfg.dirichlet_alpha,
            "classes_per_client": cfg.classes_per_client,
            **({"partition_args": cfg.partition_args, "flwr_datasets": _version("flwr-datasets")}
               if cfg.partition.startswith("fds:") else {}),
            "partitions": {str(i): [int(j) for j in p] for i, p in enumerate(parts)},
        })

    def write_local_partition(self, cfg: RunConfig, participation: Any) -> None:
        """partition = local: no indices (each node trains on its own data), but the sizes the
        server learned at the handshakes (strategies/participation.py), fixed for the run;
        rewritten while nodes join."""
        table = {"dataset": cfg.dataset, "scheme": cfg.partition, "num_partitions": participation.num_partitions,
                 "max_node_examples": cfg.max_node_examples,
                 "sizes": {str(p): n for p, n in sorted(participation.sizes.items())},
                 "heldout_sizes": {str(p): n for p, n in sorted(participation.heldout.items())}}
        path = self.path / "partition.json"
        with contextlib.suppress(OSError, ValueError):
            with open_file(path) as f:
                if json.load(f) == table:
                    return
        write_recorded(path, table)

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        self.append_rows("metrics.jsonl", [row])

    def append_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append JSON lines to ``name`` (metrics.jsonl, clients.jsonl)."""
        path = self.path / name
        try:
            with open_file(path, "a") as f:
                f.write("".join(json.dumps(dict(row)) + "\n" for row in rows))
                f.flush()
        except OSError as err:
            raise RunWriteError(f"cannot write {path}: {err.strerror or err}") from None

    def read_lines(self, name: str) -> list[str]:
        """The lines of ``name`` ([] when it does not exist), never through a link."""
        path = self.path / name
        try:
            with open_file(path) as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise RunDirError(f"cannot read {path}: {err.strerror or err}") from None

    def truncate_metrics(self, last_round: int, name: str = "metrics.jsonl") -> None:
        """Keep the complete rows of rounds <= last_round (a resumed run redoes the rest)."""
        path = self.path / name
        rows = []
        for line in self.read_lines(name):
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a row cut short by the kill
            rnd = row.get("round") if isinstance(row, dict) else None
            if type(rnd) is int and rnd <= last_round:
                rows.append(line)
        text = "".join(r + "\n" for r in rows).encode()
        self.manifest.forget_log(name)
        with self.manifest.replacing(name, digest(text), key="prefixes"), writing(path, "xb") as f:
            f.write(text)

    def save_model(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.save(name, dict(state_dict))

    def save(self, name: str, obj: Any) -> None:
        """torch.save, atomically: a crash or a failed write leaves the previous file."""
        with writing(self.path / name, "xb") as f:
            torch.save(obj, f)  # through a Python file: a failed write is an OSError with errno

    def save_checkpoint(self, cfg: RunConfig, server_round: int, strategy_state: Mapping[str, Any]) -> None:
        """The checkpoint, atomically, with its generation in manifest.json: its digest, the
        clients' state files it needs, the logs' prefixes (server/manifest.py)."""
        buffer = io.BytesIO()
        torch.save({
            "format": CHECKPOINT_FORMAT, "round": server_round, "config": cfg.to_dict(),
            "strategy": dict(strategy_state),
            "num_partitions": strategy_state["participation"]["num_partitions"],
            # client sampling and client shuffling are pure functions of (seed, round[, partition]):
            # there is no RNG state to carry over
            "sampling": {"seed": cfg.seed, "scheme": cfg.sampling},
        }, buffer)
        data = buffer.getvalue()
        clients = client_state_files(cfg, strategy_state["participation"]["accepted"])
        with self.manifest.checkpoint(server_round, data, clients), writing(self.path / CHECKPOINT, "xb") as f:
            f.write(data)

    def write_summary(self, data: Mapping[str, Any]) -> None:
        write_json(self.path / "summary.json", dict(data))


def claim(path: Path, busy: str) -> int:
    """An exclusive flock on ``path`` (a lock file, created if needed, or a directory, which is
    locked without writing anything), held until the returned descriptor is closed or the
    process ends; RunDirError(``busy``) if another process holds it."""
    flags = os.O_RDONLY | os.O_DIRECTORY if path.is_dir() else os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        raise RunDirError(f"cannot lock {path}: {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(busy) from None
    return fd


@contextlib.contextmanager
def hold_lock(path: Path, busy: str) -> Iterator[None]:
    """:func:`claim` for the duration of the block."""
    fd = claim(path, busy)
    try:
        yield
    finally:
        os.close(fd)
