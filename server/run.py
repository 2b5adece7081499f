"""One federated run on any Grid (deployment, Ray simulation or in-process).

Round r: the strategy samples and configures clients, the grid carries the messages,
the strategy validates and aggregates, then the global model is evaluated centrally on the
test split and one metrics.jsonl line is written.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.serverapp import Grid

from common import protocol as P
from common.config import RunConfig
from common.data import dataset_for, partitions_for
from common.evaluate import evaluate
from common.models import build_model
from common.registry import get as get_spec
from server.rundir import RunDir, default_run_dir

log = logging.getLogger("flwr.flatflower.server")


def run_server(grid: Grid, cfg: RunConfig) -> Path:
    """Run ``cfg`` to completion over ``grid``; returns the run directory."""
    t_start = time.monotonic()
    run_dir = RunDir(cfg.run_dir or default_run_dir(cfg))
    log.info("flatflower: %s on %s, run directory %s", cfg.algorithm, cfg.dataset, run_dir.path)
    data = dataset_for(cfg)
    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=cfg.seed)
    torch.set_num_threads(1)
    run_dir.write_config(cfg, model=cfg.resolved_model())
    run_dir.save_model("model_init.pt", model.state_dict())
    strategy = get_spec(cfg.algorithm).strategy_class()(cfg, model.state_dict())

    def central_eval() -> tuple[float, float]:
        model.load_state_dict(strategy.model)
        return evaluate(model, data.test, cfg.eval_batch_size)

    loss, acc = central_eval()
    run_dir.append_metrics({"round": 0, "test_accuracy": acc, "test_loss": loss})
    log.info("round 0: test accuracy %.4f, loss %.4f", acc, loss)
    for rnd in range(1, cfg.num_server_rounds + 1):
        t_round = time.monotonic()
        messages = strategy.configure_train(rnd, P.to_record(strategy.model), ConfigRecord(), grid)
        if rnd == 1:
            run_dir.write_partition(cfg, partitions_for(cfg, strategy.num_partitions))
        replies = grid.send_and_receive(messages, timeout=cfg.round_timeout)
        _, train_metrics = strategy.aggregate_train(rnd, replies)
        row = {"round": rnd}
        eval_messages = strategy.configure_evaluate(rnd, P.to_record(strategy.model), ConfigRecord(), grid)
        if eval_messages:
            client_eval = strategy.aggregate_evaluate(
                rnd, grid.send_and_receive(eval_messages, timeout=cfg.round_timeout))
            row.update({k.replace("-", "_"): v for k, v in (client_eval or {}).items()})
        loss, acc = central_eval()
        stats = dict(train_metrics)
        row.update({
            "test_accuracy": acc, "test_loss": loss,
            "train_loss": stats.get("train_loss"),
            **{k: int(stats[k]) for k in ("clients_sampled", "clients_replied", "clients_rejected",
                                           "clients_failed", "bytes_down", "bytes_up")},
            "sampled_partitions": [int(p) for p in stats.get("sampled_partitions", [])],
            "lr": cfg.round_lr(rnd), "seconds": round(time.monotonic() - t_round, 4),
        })
        run_dir.append_metrics(row)
        log.info("round %d: test accuracy %.4f, loss %.4f, clients %d/%d ok, %.1fs", rnd, acc, loss,
                 row["clients_replied"] - row["clients_rejected"], row["clients_sampled"], row["seconds"])
        if not math.isfinite(loss):
            log.warning("round %d: test loss is %s", rnd, loss)
    run_dir.save_model("model_final.pt", strategy.model)
    run_dir.write_summary({"final_test_accuracy": acc, "final_test_loss": loss,
                           "rounds": cfg.num_server_rounds,
                           "seconds": round(time.monotonic() - t_start, 2),
                           "num_partitions": strategy.num_partitions,
                           "model_bytes": P.payload_bytes(RecordDict({P.MODEL: P.to_record(strategy.model)})),
                           "records_down": list(strategy.spec.down),
                           "records_up": list(strategy.spec.up)})
    log.info("flatflower: finished, final test accuracy %.4f, run directory %s", acc, run_dir.path)
    return run_dir.path
