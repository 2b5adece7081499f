"""The run directory: everything needed to audit or reproduce a run.

    config.json      resolved run config + versions + seed
    partition.json   partition id -> indices into the training split
    metrics.jsonl    one line per round (round 0 = the initial model)
    model_init.pt    state_dict before round 1
    model_final.pt   state_dict after the last round
    summary.json     final accuracy, rounds, wall time (written when the run ends)
    checkpoint.pt    the latest checkpoint: round, global model, all strategy state
    client-state/    (when clients mirror their state here) partition-<i>/round-<r>.pt

JSON files, models and checkpoints are written atomically (temporary file + rename). An
existing run is never overwritten: a directory that already holds metrics.jsonl is refused,
unless the run is resumed from its checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import RunConfig


class RunDirError(RuntimeError):
    """The run directory cannot be used (exists with a run in it, not writable...)."""


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.algorithm}-{cfg.dataset}-s{cfg.seed}-{stamp}-{os.getpid()}"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("flatflower", "flwr"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "unknown"
    return out


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
# Run-config keys a resumed run may change; every other key must equal the checkpoint's.
RESUME_MAY_CHANGE = ("num-server-rounds", "resume", "run-dir", "round-timeout", "node-wait-timeout",
                     "min-available-nodes", "checkpoint-every", "client-state-dir", "data-dir",
                     "download", "fraction-evaluate", "eval-batch-size")


def load_checkpoint(run_dir: str | Path) -> dict:
    """The checkpoint of ``run_dir``, or RunDirError saying why it cannot be used."""
    path = Path(run_dir).expanduser().resolve() / CHECKPOINT
    if not path.is_file():
        raise RunDirError(f"no checkpoint in {path.parent} (checkpoint-every=0, or the run "
                          "stopped before its first checkpoint): nothing to resume")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a damaged file
        raise RunDirError(f"checkpoint {path} is corrupt or unreadable: {type(err).__name__}: {err}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT or "strategy" not in ckpt:
        raise RunDirError(f"checkpoint {path} is not a flatflower checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def check_resumable(cfg: RunConfig, ckpt: Mapping[str, Any]) -> None:
    """RunDirError if ``cfg`` changes a key that would make the resumed run a different run."""
    saved, now = ckpt["config"], cfg.to_dict()
    changed = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now
               if k not in RESUME_MAY_CHANGE and saved.get(k) != now[k]]
    if changed:
        raise RunDirError("cannot resume with a different configuration: " + "; ".join(changed))
    if cfg.num_server_rounds < ckpt["round"]:
        raise RunDirError(f"num-server-rounds={cfg.num_server_rounds} is below the checkpoint's "
                          f"round {ckpt['round']}")


class RunDir:
    def __init__(self, path: str | Path, resume: bool = False):
        self.path = Path(path).expanduser().resolve()
        if (self.path / "metrics.jsonl").exists() and not resume:
            raise RunDirError(
                f"{self.path} already holds a run (metrics.jsonl); choose another --run-dir"
            )
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run directory {self.path}: {err}") from None

    def write_config(self, cfg: RunConfig, **extra: Any) -> None:
        write_json(self.path / "config.json",
                   {"config": cfg.to_dict(), "seed": cfg.seed, "algorithm": cfg.algorithm,
                    "versions": versions(), **extra})

    def write_partition(self, cfg: RunConfig, parts: Sequence[np.ndarray]) -> None:
        write_json(self.path / "partition.json", {
            "dataset": cfg.dataset, "scheme": cfg.partition, "num_partitions": len(parts),
            "seed": cfg.data_seed(), "dirichlet_alpha": cfg.dirichlet_alpha,
            "classes_per_client": cfg.classes_per_client,
            "partitions": {str(i): [int(j) for j in p] for i, p in enumerate(parts)},
        })

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(dict(row)) + "\n")
            f.flush()

    def truncate_metrics(self, last_round: int) -> None:
        """Keep the complete rows of rounds <= last_round (a resumed run redoes the rest)."""
        path = self.path / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a row cut short by the kill
            if row.get("round", last_round + 1) <= last_round:
                rows.append(line)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(r + "\n" for r in rows))
        tmp.replace(path)

    def save_model(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.save(name, dict(state_dict))

    def save(self, name: str, obj: Any) -> None:
        """torch.save, atomically: a crash leaves the previous file or the new one."""
        tmp = self.path / (name + ".tmp")
        torch.save(obj, tmp)
        tmp.replace(self.path / name)

    def save_checkpoint(self, cfg: RunConfig, server_round: int, strategy_state: Mapping[str, Any],
                        num_partitions: int | None) -> None:
        self.save(CHECKPOINT, {
            "format": CHECKPOINT_FORMAT, "round": server_round, "config": cfg.to_dict(),
            "strategy": dict(strategy_state), "num_partitions": num_partitions,
            # client sampling and client shuffling are pure functions of (seed, round[, partition]):
            # there is no RNG state to carry over
            "sampling": {"seed": cfg.seed, "scheme": cfg.sampling},
        })

    def write_summary(self, data: Mapping[str, Any]) -> None:
        write_json(self.path / "summary.json", dict(data))
