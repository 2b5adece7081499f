"""The run directory: everything needed to audit or reproduce a run.

    config.json      resolved run config + versions + seed
    partition.json   partition id -> indices into the training split
    metrics.jsonl    one line per round (round 0 = the initial model)
    model_init.pt    state_dict before round 1
    model_final.pt   state_dict after the last round
    summary.json     final accuracy, rounds, wall time (written when the run ends)

JSON files are written atomically (temporary file + rename). An existing run is never
overwritten: a directory that already holds metrics.jsonl is refused.
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


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        if (self.path / "metrics.jsonl").exists():
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
            "seed": cfg.seed, "dirichlet_alpha": cfg.dirichlet_alpha,
            "classes_per_client": cfg.classes_per_client,
            "partitions": {str(i): [int(j) for j in p] for i, p in enumerate(parts)},
        })

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(dict(row)) + "\n")
            f.flush()

    def save_model(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        tmp = self.path / (name + ".tmp")
        torch.save(dict(state_dict), tmp)
        tmp.replace(self.path / name)

    def write_summary(self, data: Mapping[str, Any]) -> None:
        write_json(self.path / "summary.json", dict(data))
