"""One federated run on any Grid (deployment, Ray simulation or in-process).

Round r: the strategy samples and configures clients, the grid carries the messages,
the strategy validates and aggregates, then the global model is evaluated centrally on the
test split and one metrics.jsonl line is written.

With ``partition = local`` the server holds no client's data: it builds the model from
``input-shape`` and ``num-classes``, learns each node's size at its handshake, and evaluates
centrally only when its own ``data-dir`` is set (that folder's test split); otherwise
metrics.jsonl has no test_accuracy/test_loss, and federated evaluation (``fraction-evaluate``:
federated_accuracy, federated_loss) is how the run measures itself.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from flwr.app import RecordDict
from flwr.serverapp import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid  # Flower's simulation engine (Ray)

from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.common.data import partitions_for
from flatflower.common.evaluate import evaluate
from flatflower.common.flatness import flatness_distance, measure, seed_of
from flatflower.common.privacy import PrivacyLedger
from flatflower.server.clients import client_rows
from flatflower.server.progress import RoundProgress
from flatflower.server.rundir import RunDir, RunDirError, default_run_dir
from flatflower.server.setup import LEDGER, prepare_run
from flatflower.server.tensorboard import Board
from flatflower.strategies.base import all_finite
from flatflower.strategies.strategy import RoundStats, RunFailed

log = logging.getLogger("flwr.flatflower.server")


def run_server(grid: Grid, cfg: RunConfig) -> Path:
    """Run ``cfg`` to completion over ``grid`` (from its checkpoint when ``resume``);
    returns the run directory. The directory is locked for the run's duration; a failure
    after it is claimed is written to summary.json (``status``, ``error``) and raised, except
    a refusal of the directory's files (RunDirError, e.g. a damaged resume input): nothing
    has run, and nothing in the directory is changed."""
    run_dir = RunDir(cfg.run_dir or default_run_dir(cfg), resume=cfg.resume)
    with run_dir.locked():
        try:
            return _run(grid, cfg, run_dir)
        except RunDirError:  # refused before anything ran (a damaged resume input): nothing written
            raise
        except BaseException as err:
            run_dir.record_failure(err)
            raise


def _run(grid: Grid, cfg: RunConfig, run_dir: RunDir) -> Path:
    t_start = time.monotonic()
    log.info("flatflower: %s on %s, run directory %s", cfg.algorithm, cfg.dataset, run_dir.path)
    if cfg.algorithm == "dp-fedsam" and cfg.dp_clip == 0:
        log.warning("dp-fedsam with dp.clip = 0: no clipping and no noise, so no privacy and no dp_epsilon "
                    "(DP-FedSAM's local optimizer alone); its authors' values: dp.clip = 0.2, "
                    "dp.noise-multiplier = 0.95")
    setup = prepare_run(cfg, run_dir.path)  # the one setup (server/setup.py), which the CLI's preflight runs too
    data, model, strategy, first, device = setup.data, setup.model, setup.strategy, setup.first, setup.device
    ledger = setup.ledger  # read before any truncation
    torch.set_num_threads(cfg.server_threads)
    if cfg.resume:
        run_dir.truncate_metrics(first - 1)
        run_dir.truncate_metrics(first - 1, "clients.jsonl")
        log.info("resuming from the checkpoint of round %d", first - 1)
    else:
        run_dir.save_model("model_init.pt", model.state_dict())
    run_dir.write_config(cfg, device=device, first_round=first, model=cfg.resolved_model(), engine=engine_of(grid),
                         code=setup.code, notes=[n for n in (setup.note, setup.code_note) if n])
    test = None if data is None else data.test
    if device.type != "cpu":  # a copy on the device (the strategy keeps the CPU model) and the test split, once
        model = copy.deepcopy(model).to(device)
        test = None if test is None else test.to(device)

    def global_model() -> torch.nn.Module:
        """The model at the strategy's global weights, on the server's device, with the server's
        CPU threads (an in-process client may have set its own since)."""
        torch.set_num_threads(cfg.server_threads)
        model.load_state_dict(strategy.model)
        return model

    def central_eval() -> dict:
        """The global model's test_loss and test_accuracy on the server's test split ({}: the
        server has none, partition = local without data-dir)."""
        if test is None:
            return {}
        loss, acc = evaluate(global_model(), test, cfg.eval_batch_size)
        return {"test_accuracy": acc, "test_loss": finite(loss)}

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    def flatness(rnd: int, stats: RoundStats) -> dict:
        """The round's flatness fields: FedNSAM's eq. 4 distance (None when the round was
        skipped: no new global model), and every ``flatness-every`` rounds the new global
        model's sharpness and Hessian numbers on the evaluation split, with their cost."""
        row = {"flatness_distance": None if stats.skipped else
               flatness_distance([u.model for u in strategy.round_record().updates], strategy.model, trainable)}
        if cfg.measures_flatness(rnd):
            t0 = time.monotonic()
            found = measure(global_model(), test, batch_size=cfg.eval_batch_size, rho=cfg.flatness_rho,
                            iters=cfg.flatness_iters, probes=cfg.flatness_probes, seed=seed_of(cfg.seed, rnd))
            row.update(sharpness=found["sharpness"], sharpness_rho=cfg.flatness_rho,
                       hessian_max_eig=found["hessian_max_eig"], hessian_trace=found["hessian_trace"],
                       flatness_seconds=round(time.monotonic() - t0, 4))
            log.info("round %d: flatness of the global model: sharpness %.4g (rho %g), top Hessian "
                     "eigenvalue %.4g, Hessian trace %.4g (%.1fs)", rnd, found["sharpness"],
                     cfg.flatness_rho, found["hessian_max_eig"], found["hessian_trace"],
                     row["flatness_seconds"])
        return {k: v if v is None or isinstance(v, str) else finite(v) for k, v in row.items()}

    board = Board(run_dir.path, cfg.tensorboard)
    try:
        return _rounds(grid, cfg, run_dir, strategy, central_eval, flatness, first, board, t_start, ledger)
    finally:
        board.close()


def _rounds(grid: Grid, cfg: RunConfig, run_dir: RunDir, strategy, central_eval, flatness,
            first: int, board: Board, t_start: float, ledger: PrivacyLedger | None) -> Path:
    central = central_eval()
    if not cfg.resume and central:  # no evaluation set on the server: no round 0 to record
        run_dir.append_metrics({"round": 0, **central})
        board.add_round({"round": 0, **central})
        log.info("round 0: %s", measured(central))
    RoundProgress(grid, run_dir.path, cfg.num_server_rounds)  # progress.json inside each round
    skipped = 0
    federated = None  # the last federated evaluation's results
    for rnd in range(first, cfg.num_server_rounds + 1):
        t_round = time.monotonic()
        stats = strategy.train_round(rnd, grid)
        while federation_left(stats, grid):  # not a round of the run: redo it once nodes are back
            log.warning("round %d: no sampled client replied and no node is connected any more; "
                        "the round is not recorded: it runs again when nodes return", rnd)
            strategy.participation.wait_for_nodes(grid)  # NoNodesError after node-wait-timeout
            stats = strategy.train_round(rnd, grid)
        skipped += stats.skipped
        if cfg.local_data():  # the sizes learned so far (nodes may join late)
            run_dir.write_local_partition(cfg, strategy.participation)
        elif not (run_dir.path / "partition.json").exists():
            run_dir.write_partition(cfg, partitions_for(cfg, strategy.num_partitions))
        row = {"round": rnd}
        client_eval = strategy.evaluate_round(rnd, grid) if cfg.evaluates(rnd) else None
        row.update({k.replace("-", "_"): finite(v) for k, v in (client_eval or {}).items()})
        if client_eval:
            federated = {k: row[k] for k in ("federated_accuracy", "federated_loss")}
        central = central_eval()
        row.update({**central, **round_fields(stats),
                    "lr": cfg.round_lr(rnd), "seconds": round(time.monotonic() - t_round, 4)})
        row.update(flatness(rnd, stats))  # after "seconds": its cost is flatness_seconds
        if ledger is not None:  # the clients released noised updates this round, skipped or not
            entry = {"round": rnd, **stats.privacy}
            ledger.add_round(entry["dp_sampling_rate"], entry["dp_noise_multiplier"])
            run_dir.append_rows(LEDGER, [entry])  # first: a round redone after a resume counts twice
            row["dp_epsilon"] = finite(ledger.epsilon(cfg.dp_delta))
        clients = client_rows(strategy.round_record(), rnd)
        run_dir.append_rows("clients.jsonl", clients)
        run_dir.append_metrics(row)  # before the checkpoint: a resume redoes rows past it
        board.add_round(row, clients)
        if cfg.checkpoint_every and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.num_server_rounds):
            run_dir.save_checkpoint(cfg, rnd, strategy.state_dict())
        log.info("round %d: %s, clients %d/%d ok, %.1fs", rnd, measured(row),
                 row["clients_replied"] - row["clients_rejected"], row["clients_sampled"], row["seconds"])
        if central and central["test_loss"] is None:
            log.warning("round %d: test loss is not finite", rnd)
    if first <= cfg.num_server_rounds and skipped == cfg.num_server_rounds - first + 1:
        raise RunFailed(f"every round ({first}-{cfg.num_server_rounds}) was skipped: no round had "
                        "enough accepted client updates (see the rejections in metrics.jsonl)")
    if not all_finite(strategy.model):
        raise RunFailed("the final model holds NaN or Inf values")
    run_dir.save_model("model_final.pt", strategy.model)
    finals = {f"final_{k}": v for k, v in central.items()}
    if federated is not None:  # the last federated evaluation's, when it ran
        finals.update(final_federated_accuracy=federated["federated_accuracy"],
                      final_federated_loss=federated["federated_loss"])
    lost = [k[len("final_"):] for k in ("final_test_loss", "final_federated_loss") if k in finals and finals[k] is None]
    if lost:  # e.g. a BatchNorm variance driven negative: never a plain "completed"
        raise RunFailed(f"the final global model's {' and '.join(lost)} is not finite: its accuracy means "
                        "nothing; metrics.jsonl and model_final.pt hold what was computed")
    run_dir.write_summary({"status": "completed", **finals, "rounds": cfg.num_server_rounds,
                           "seconds": round(time.monotonic() - t_start, 2),
                           "num_partitions": strategy.num_partitions,
                           "model_bytes": codec.payload_bytes(RecordDict({P.MODEL: codec.to_record(strategy.model)})),
                           "records_down": list(strategy.spec.down),
                           "records_up": list(strategy.spec.up)})
    log.info("flatflower: finished, final %s, run directory %s", measured({**central, **(federated or {})}),
             run_dir.path)
    return run_dir.path


def measured(row: dict) -> str:
    """The round's accuracy and loss for the log: the server's test split's, and the clients'
    federated evaluation's, where each was measured."""
    parts = [f"{what} accuracy {row[f'{key}_accuracy']:.4f}, loss {row.get(f'{key}_loss') or float('nan'):.4f}"
             for key, what in (("test", "test"), ("federated", "federated")) if row.get(f"{key}_accuracy") is not None]
    return "; ".join(parts) or "no evaluation"


def engine_of(grid: Grid) -> str:
    """Which engine carries the run, for config.json: the grid's own ``engine`` value
    (inprocess, vectorized: runtime/engines/inprocess.py), ray for Flower's simulation engine's
    grid, else deployment (a SuperLink and SuperNodes)."""
    engine = getattr(grid, "engine", None)
    if isinstance(engine, str):
        return engine
    return "ray" if isinstance(grid, InMemoryGrid) else "deployment"


def federation_left(stats: RoundStats, grid: Grid) -> bool:
    """Whether every node left the federation during the round: none of the sampled clients
    replied and none is connected now (a federation being shut down, or a lost network). Such
    a round is no outcome of the run, unlike one in which connected clients failed (skipped)."""
    return (stats.clients_sampled > 0 and stats.clients_replied == 0 and stats.clients_failed > 0
            and not list(grid.get_node_ids()))


def finite(x: float) -> float | None:
    """``x``, or None (JSON null) when it is NaN or infinite: metrics.jsonl stays valid JSON."""
    return x if math.isfinite(x) else None


def round_fields(stats: RoundStats) -> dict:
    """The metrics.jsonl fields of a training round."""
    row = asdict(stats)
    row["train_loss"] = row["train_loss"] if math.isfinite(row["train_loss"]) else None
    row.update({k: finite(v) for k, v in row.pop("rule").items()})  # the algorithm's own columns
    row.update(row.pop("privacy"))  # dp.clip > 0: the round's q and noise multiplier
    return row
