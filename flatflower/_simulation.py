"""``flatflower.run_simulation``: a run of the real ServerApp and ClientApps in this process
(runtime/engines/inprocess.py), set up and checked as the CLI's ``simulate`` does
(tools/prepare.py), and read back from its run directory as a :class:`RunResult`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatflower.common.config import ConfigError, RunConfig, flat_keys

ENGINES = ("inprocess", "vectorized")


class History:
    """The per-round rows of a run's metrics.jsonl (round 0: the initial model's evaluation,
    where the server evaluates), with each column as a list aligned with :attr:`rounds`
    (None where a round has no value)."""

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    def column(self, key: str) -> list[Any]:
        """Column ``key`` of every row (None where a row lacks it)."""
        return [row.get(key) for row in self.rows]

    @property
    def rounds(self) -> list[int]:
        return self.column("round")

    @property
    def test_accuracy(self) -> list[float | None]:
        return self.column("test_accuracy")

    @property
    def test_loss(self) -> list[float | None]:
        return self.column("test_loss")

    @property
    def train_loss(self) -> list[float | None]:
        return self.column("train_loss")

    @property
    def federated_accuracy(self) -> list[float | None]:
        return self.column("federated_accuracy")

    @property
    def federated_loss(self) -> list[float | None]:
        return self.column("federated_loss")

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def __repr__(self) -> str:
        return f"History({len(self.rows)} rows, rounds {self.rounds[:1]}..{self.rounds[-1:]})"


@dataclass(frozen=True)
class RunResult:
    """A finished run: where it lies, its config, its per-round history, its final global
    model (a state dict; :meth:`model` rebuilds the ``nn.Module``) and summary.json."""

    run_dir: Path
    config: RunConfig
    history: History
    final_model: dict[str, torch.Tensor]
    summary: dict[str, Any]

    @property
    def status(self) -> str:
        """summary.json's status ("completed" for every run that returns a result)."""
        return self.summary.get("status", "")

    def model(self) -> nn.Module:
        """The run's model, holding the final global weights."""
        from flatflower.common.data import model_shape
        from flatflower.common.models import build_model

        input_shape, num_classes = model_shape(self.config)
        model = build_model(self.config.resolved_model(), input_shape, num_classes, seed=self.config.seed)
        model.load_state_dict(self.final_model)
        return model

    @classmethod
    def read(cls, run_dir: Path, config: RunConfig) -> RunResult:
        """The result a completed run left in ``run_dir``."""
        from flatflower.server.rundir import load_tensors

        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return cls(run_dir, config, History(rows), dict(load_tensors(run_dir / "model_final.pt", "final model")),
                   json.loads((run_dir / "summary.json").read_text()))


def run_config(config: Mapping[str, Any] | RunConfig | None = None, *, preset: str | None = None,
               algorithm: str | None = None, rounds: int | None = None, model: Any = None,
               dataset: Any = None, keys: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], int | None]:
    """(the run-config values, the preset's number of clients or None), in the CLI's order:
    the preset's [config] (and its table for the algorithm), then ``config`` (run-config keys;
    nested tables such as ``{"sam": {"rho": 0.05}}`` are read as ``sam.rho``), then ``keys``
    (``local_epochs=1`` is ``local-epochs``), then the named arguments."""
    from flatflower._objects import dataset_name, model_name

    values: dict[str, Any] = {}
    clients = None
    given = config.to_dict() if isinstance(config, RunConfig) else flat_keys(dict(config or {}))
    named = {"algorithm": algorithm, "num-server-rounds": rounds,
             "model": None if model is None else model_name(model),
             "dataset": None if dataset is None else dataset_name(dataset)}
    named = {k: v for k, v in named.items() if v is not None}
    more = {k.replace("_", "-"): v for k, v in (keys or {}).items()}
    if preset is not None:
        from flatflower.tools.presets import load_preset

        loaded = load_preset(preset)  # PresetError (a ValueError): one line
        chosen = named.get("algorithm") or more.get("algorithm") or given.get("algorithm")
        values.update(loaded.values(None if chosen is None else str(chosen)))
        clients = loaded.clients
    values.update(given)
    values.update(more)
    values.update(named)
    if values.get("dataset") == "synthetic-fedprox":
        values.setdefault("partition", "natural")  # its clients are generated, not split
    return values, clients


def run_simulation(config: Mapping[str, Any] | RunConfig | None = None, *, preset: str | None = None,
                   algorithm: str | None = None, clients: int | None = None, rounds: int | None = None,
                   model: Any = None, dataset: Any = None, engine: str = "inprocess",
                   run_dir: str | Path | None = None, verbose: bool = False, **keys: Any) -> RunResult:
    """Run a federated simulation in this process and return its :class:`RunResult`.

    Bad input raises ConfigError (a ValueError, one line) before anything starts or is
    written; a run that fails raises its error (e.g. flatflower.server.run.RunFailed), its run directory
    holding summary.json's ``status = failed``. See docs/api.md."""
    from flatflower.common.datasets import DatasetUnavailableError
    from flatflower.server.rundir import RunDirError
    from flatflower.runtime.engines.inprocess import run_inprocess
    from flatflower.tools.prepare import DEFAULT_CLIENTS, UsageError, place_run, preflight

    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not one of: {', '.join(ENGINES)} (Ray and a local deployment "
                          "start other processes: use the flatflower command line)")
    values, preset_clients = run_config(config, preset=preset, algorithm=algorithm, rounds=rounds,
                                        model=model, dataset=dataset, keys=keys)
    if clients is None:
        clients = preset_clients or int(values.get("num-partitions") or 0) or DEFAULT_CLIENTS
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ConfigError(f"clients={clients!r} must be a whole number >= 1")
    if not values.get("num-partitions"):  # 0: the nodes connected at round 1, here the clients
        values["num-partitions"] = clients
    try:
        cfg = RunConfig.from_mapping(values)
        if cfg.num_partitions != clients:
            raise ConfigError(f"num-partitions={cfg.num_partitions} disagrees with clients={clients}")
        if cfg.local_data():
            raise ConfigError("partition=local (data on each node) is for the flatflower command line "
                              "(--node-data) and real deployments")
        cfg = place_run(cfg, str(run_dir) if run_dir is not None else None)
        preflight(cfg, clients, engine)
    except (UsageError, RunDirError, DatasetUnavailableError) as err:  # the CLI's "error: ..." lines
        raise ConfigError(str(err)) from None
    with _quiet(not verbose):
        path, _ = run_inprocess(cfg.to_dict(), clients, vectorized=engine == "vectorized")
    return RunResult.read(path, cfg)


def _quiet(quiet: bool):
    """Flower's and flatflower's per-round log lines at WARNING while the run lasts (what
    ``flatflower simulate`` shows), unless verbose."""
    from flatflower.runtime.engines.inprocess import logs_at

    return logs_at(logging.WARNING) if quiet else contextlib.nullcontext()
