"""The papers' own kind of simulation, as a yardstick for the engines: one process, one model,
the round's clients trained one after the other in a plain PyTorch loop, no messages.

This is how the authors' code simulates a federation (FL-Simulator, FedSMOO's and FedGMT's
repositories: a ``for`` loop over the round's clients around ``optimizer.step()``). It does the
same passes as a flatflower run of FedAvg or FedSAM with the same run config: the same
partition, the same clients each round (``Participation.sample``'s rule), the same mini-batches
(the clients' own shuffling: flatflower.client.train's ``round_generator`` and ``batch_indices``), SGD with
the round's lr, momentum and weight decay, gradient clipping at ``clip-norm``, FedSAM's second
gradient at w + rho g/||g||, the example-weighted average and the central evaluation of the new
global model on the test split. Its global models are therefore an engine's, to float rounding
(a test checks it), and its time is the arithmetic of the federation alone. It keeps no per-client
state, validates nothing and writes nothing: what is left over in an engine's round is the
price of its framework (messages, validation, run directory, threads).

Only what the throughput bench needs: it times rounds (CPU and wall) and is no engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

LOOP_ALGORITHMS = ("fedavg", "fedsam")


def measure_loop(config: dict[str, Any], clients: int) -> list[dict[str, Any]]:
    """Rounds 2 .. R - 1 of the loop on ``config`` (a run config) with ``clients`` partitions:
    [{"round", "wall_seconds", "cpu_seconds", "client_steps", "examples"}] (round 1 warms up and
    round R is left out, as in an engine's timing)."""
    last = int(config.get("num-server-rounds", 10))
    return [row for row, _ in run_loop(config, clients) if 2 <= row["round"] < last]


def run_loop(config: dict[str, Any], clients: int) -> Iterator[tuple[dict[str, Any], list[torch.Tensor]]]:
    """Each round of the loop: (its timing row, the new global model's trainable parameters)."""
    from flatflower.client.train import batch_indices, round_generator
    from flatflower.common.augment import train_augment
    from flatflower.common.config import RunConfig
    from flatflower.common.data import dataset_for, partitions_for
    from flatflower.common.evaluate import evaluate
    from flatflower.common.models import build_model
    from flatflower.strategies.participation import Participation

    cfg = RunConfig.from_mapping({**config, "num-partitions": clients})
    participation = Participation(cfg)  # the server's sampling rule
    if cfg.algorithm not in LOOP_ALGORITHMS:
        raise ValueError(f"the plain loop runs {', '.join(LOOP_ALGORITHMS)}, not {cfg.algorithm}")
    rho = cfg.params.rho if cfg.algorithm == "fedsam" else 0.0
    data = dataset_for(cfg)
    parts = partitions_for(cfg, clients)
    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    for server_round in range(1, cfg.num_server_rounds + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        total = [torch.zeros_like(p) for p in global_params]
        steps = examples = 0
        for pid in participation.sample(server_round, list(range(clients)), cfg.fraction_train):
            own = torch.from_numpy(parts[pid])
            with torch.no_grad():
                for p, g in zip(params, global_params):
                    p.copy_(g)
            model.train()
            opt = torch.optim.SGD(params, lr=cfg.round_lr(server_round), momentum=cfg.momentum,
                                  weight_decay=cfg.weight_decay)
            augment = train_augment(cfg.train_transform, cfg.seed, server_round, pid)
            for idx in batch_indices(len(own), cfg.batch_size, cfg.local_epochs, cfg.local_steps,
                                     round_generator(cfg.seed, server_round, pid)):
                x, y = data.train.get(own[idx], augment=augment)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                if rho > 0:
                    _sam_step(params, model, x, y, rho)
                if cfg.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                opt.step()
                steps += 1
            with torch.no_grad():
                for t, p in zip(total, params):
                    t.add_(p, alpha=len(own))
            examples += len(own)
        with torch.no_grad():
            global_params = [t / examples for t in total]
            for p, g in zip(params, global_params):
                p.copy_(g)
        evaluate(model, data.test, cfg.eval_batch_size)
        yield ({"round": server_round, "wall_seconds": time.perf_counter() - wall,
                "cpu_seconds": time.process_time() - cpu, "client_steps": steps, "examples": examples},
               global_params)


def _sam_step(params: list[torch.Tensor], model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              rho: float) -> None:
    """Replace the gradients by SAM's: the gradient at w + rho g/||g|| (FedSAM eq. 4)."""
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        scale = rho / (norm + 1e-12)
        eps = [p.grad * scale for p in params]
        for p, e in zip(params, eps):
            p.add_(e)
    for p in params:
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p, e in zip(params, eps):
            p.sub_(e)
