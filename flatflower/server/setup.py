"""Setting a run up, once: the one piece of code that turns a run config into what a run needs
(the server's evaluation data and device, the model, the strategy with its state, the round
to start from and, under DP, the privacy already spent). The ServerApp (server/run.py) runs on
it, and the command line's preflight (tools/prepare.py) calls it before any process starts, so
a setup that fails (data that does not load, a model that does not fit it, a damaged checkpoint
or privacy ledger, missing client state, a server device the machine lacks) fails there with
one line, exactly as it would fail in the ServerApp, and nothing is written.

What the run config alone decides (every key, and every algorithm x option rule:
strategies/compatibility.py) is refused earlier still, when the run config is built.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flatflower.common.augment import check_train_transform
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.data import check_local_data, dataset_for, model_shape, partitions_for
from flatflower.common.models import buffer_names, build_model, check_output
from flatflower.common.privacy import LedgerError, PrivacyLedger, ledger_entries
from flatflower.common.references import BadReference
from flatflower.server import codeid, manifest, recordkey
from flatflower.server.files import open_file
from flatflower.server.rundir import (CHECKPOINT, RunDirError, check_client_state, check_resumable, client_state_files,
                           load_checkpoint)
from flatflower.strategies.registry import get as get_spec
from flatflower.strategies.strategy import FlatStrategy

log = logging.getLogger("flwr.flatflower.server")
LEDGER = "privacy.jsonl"  # dp.clip > 0: each round's (q, noise multiplier), append-only


@dataclass
class RunSetup:
    """What a run starts from (:func:`prepare_run`)."""

    data: object | None  # the dataset whose test split the server evaluates on; None: it has none
    model: nn.Module  # the run's model, with its initial weights (cfg.seed)
    strategy: FlatStrategy  # the algorithm's strategy, its state loaded from the checkpoint when resuming
    first: int  # the first round to play (1, or the checkpoint's round + 1)
    device: torch.device  # where the server evaluates and measures flatness (server-device)
    ledger: PrivacyLedger | None  # dp.clip > 0: the privacy spent before round ``first``
    note: str | None = None  # a resume of a run directory whose records are not sealed by this user (trusted)
    code: dict | None = None  # the code this run runs (server/codeid.py): config.json's ``code``
    code_note: str | None = None  # a resume with changed code (--allow-code-change): what changed


def prepare_run(cfg: RunConfig, run_dir: str | Path | None = None) -> RunSetup:
    """The run of ``cfg`` set up: its data loaded and checked, its model built, its strategy
    allocated and, when ``cfg.resume``, loaded from the checkpoint of its run directory
    (``run_dir``, default ``cfg.run_dir``), with the client state that checkpoint needs
    checked, and every file the resume reads verified against the run directory's manifest
    (server/manifest.py), sealed by the user's record key, and the code it runs against the
    code the run ran (server/codeid.py). Writes nothing. A ValueError (or RunDirError) with one
    line for what does not fit."""
    device = server_device(cfg)
    data = server_data(cfg)
    if data is not None:  # partition = local: each node checks its own data (common/data.py)
        check_train_transform(cfg.train_transform, data)
    input_shape, num_classes = model_shape(cfg)
    try:
        model = build_model(cfg.resolved_model(), input_shape, num_classes, seed=cfg.seed)
    except BadReference:  # the user's own model: already one line naming the key
        raise
    except ValueError as err:
        raise ValueError(f"model {cfg.resolved_model()!r} does not fit dataset {cfg.dataset!r}: {err}") from None
    check_output(model, cfg.resolved_model(), *sample_batch(data, input_shape))
    strategy = get_spec(cfg.algorithm).new_strategy(
        cfg, model.state_dict(), partition_sizes=None if cfg.local_data() else partition_sizes(cfg),
        buffers=buffer_names(model))
    first = 1
    code = codeid.identity(cfg.to_dict())
    if cfg.resume:
        run_dir = Path(run_dir or cfg.run_dir)
        ckpt = load_checkpoint(run_dir)
        check_resumable(cfg, ckpt)
        code_note = check_code(code, run_dir)  # before the checkpoint's tensors meet the new code
        try:
            strategy.load_state_dict(ckpt["strategy"])
        except ValueError as err:
            raise ValueError(f"checkpoint {run_dir / CHECKPOINT} is damaged: {err}") from None
        check_client_state(cfg, ckpt, model)  # after the checkpoint's accepted rounds were checked
        note = verify_files(cfg, ckpt, run_dir)
        first = ckpt["round"] + 1
        ledger = privacy_ledger(cfg, run_dir, first) if cfg.dp_clip > 0 else None
        return RunSetup(data, model, strategy, first, device, ledger, note, code, code_note)
    return RunSetup(data, model, strategy, first, device, PrivacyLedger() if cfg.dp_clip > 0 else None,
                    code=code)


def check_code(code: dict, run_dir: Path) -> str | None:
    """CodeChanged (a RunDirError: one line naming each module) when ``code`` is not the code
    config.json records for the run, unless the user allowed it (``--allow-code-change``:
    codeid.ENV names this run directory); then the note config.json records. config.json is
    read as it is; the manifest check after it vouches for it (a record rewritten to match the
    new code is refused there)."""
    path = Path(run_dir).expanduser().resolve()
    try:
        with open_file(path / "config.json") as f:
            recorded = json.loads(f.read()).get("code")
    except (OSError, ValueError, AttributeError, RecursionError):
        recorded = None  # a missing or damaged config.json: the manifest check names it
    note = codeid.check(recorded, code, path, recordkey.accepts(codeid.ENV, path))
    if note:
        log.warning(note)
    return note


def sample_batch(data, input_shape: tuple[int, ...]) -> tuple[torch.Tensor, str]:
    """What the model's output is checked on before a run (common/models.py: check_output): the
    first 2 examples of the server's training split (else its test split), as training reads
    them; with no data on the server (partition = local without data-dir), 2 zero inputs."""
    split = None if data is None else next((s for s in (data.train, data.test) if len(s)), None)
    if split is None:
        return torch.zeros((2, *input_shape)), f"a batch of 2 zero inputs of shape {tuple(input_shape)}"
    n = min(2, len(split))
    name = "training" if split is data.train else "test"
    return split.get(torch.arange(n))[0], f"a sample batch ({n} examples of the {name} split)"


def verify_files(cfg: RunConfig, ckpt: dict, run_dir: Path) -> str | None:
    """RunDirError (one line naming the file) unless every file the resume reads is as the
    run wrote it (manifest.json, sealed by this user's record key); after the checks of what
    the files mean, which name the field or tensor that is wrong. A run directory whose
    manifest is not sealed by this user (an older flatflower's, another machine's or user's,
    or none at all) is refused, unless the user trusts it (``--trust-run-dir``:
    manifest.TRUST_ENV names it): then a note, and its files are resumed as they are (checked
    against the digests the manifest has), sealed under this user's key from the resume on."""
    path = Path(run_dir).expanduser().resolve()
    trusted = recordkey.accepts(manifest.TRUST_ENV, path)
    try:
        manifest.verify(path, client_state_files(cfg, ckpt["strategy"]["participation"]["accepted"]),
                        trusted=trusted)
        problem = manifest.seal_problem(path, data := manifest.read(path),
                                        manifest.seal_status(path, data, key := recordkey.load(create=False)), key)
    except (manifest.ManifestError, recordkey.RecordKeyError) as err:
        raise RunDirError(str(err)) from None
    if problem is None:
        return None
    unchecked = "" if data is not None else " unchecked"
    note = (f"{problem}; resumed{unchecked} as they are ({manifest.TRUST_FLAG}): the resume records and "
            "seals them under your record key from its first write")
    log.info(note)
    return note


def partition_sizes(cfg: RunConfig):
    """N -> the sizes of the N partitions of the run's dataset (the strategy's weights),
    computed when the strategy first needs them (N: the clients, known at round 1)."""
    return lambda n: [len(p) for p in partitions_for(cfg, n)]


def server_data(cfg: RunConfig):
    """The dataset whose test split the server evaluates on, or None: partition = local
    without a ``data-dir`` of the server's own (the server holds no client's data). A server
    evaluation set under partition = local must fit the run's model, as every node's must."""
    if not cfg.central_evaluation():
        log.info("partition=local and no data-dir on the server: no central evaluation; the run "
                 "measures itself by federated evaluation (fraction-evaluate=%g)", cfg.fraction_evaluate)
        return None
    data = check_local_data(cfg, trains=False) if cfg.local_data() else dataset_for(cfg)
    if not len(data.test):  # a node's test split may be empty (it is not evaluated); the server's measures
        raise ValueError(f"data-dir {cfg.data_dir or '(none)'!r}: the test split the server evaluates on "
                         "holds no samples")
    return data


def server_device(cfg: RunConfig) -> torch.device:
    """The device of the server's evaluation and flatness measurements (``server-device``),
    refused in one line when this machine lacks it."""
    from flatflower.client.node import device_missing

    missing = device_missing(cfg.server_device)
    if missing:
        raise ConfigError(f"server-device={cfg.server_device!r} requested but {missing} on this machine")
    return torch.device(cfg.server_device)


def privacy_ledger(cfg: RunConfig, run_dir: Path, first: int) -> PrivacyLedger:
    """The privacy spent before round ``first``: every round of ``privacy.jsonl`` (LEDGER), the
    rounds a resume redoes included (they released models too). It is never truncated; a
    resumed DP run without it, or missing a round its checkpoint holds, or with an entry its config
    cannot have written, is refused (RunDirError, one line naming the file)."""
    ledger = PrivacyLedger()
    path = run_dir / LEDGER
    try:
        with open_file(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    except OSError as err:
        raise RunDirError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        entries = ledger_entries(lines, cfg.dp_noise_multiplier, str(path), max_round=first + 1_000_000)
    except LedgerError as err:
        raise RunDirError(str(err)) from None
    for _, rate, sigma in entries:
        ledger.add_round(rate, sigma)
    seen = {rnd for rnd, _, _ in entries}
    missing = sorted(set(range(1, first)) - seen)
    if missing:
        raise RunDirError(f"{path} lacks rounds {missing[:5]}{' ...' if len(missing) > 5 else ''} of the "
                        f"checkpoint's 1-{first - 1}: the privacy they spent cannot be accounted, and a "
                        "run with dp.clip > 0 resumes only with its whole ledger (restore the file)")
    return ledger
