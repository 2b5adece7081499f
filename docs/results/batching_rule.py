"""Where batching clients pays on a CPU (docs/benchmarks.md, "Batching on a CPU").

    PYTHONPATH=$PWD python docs/results/batching_rule.py --out docs/results/batching-cpu/run1.json

For each model, input shape and batch size: the CPU time (the process's, all threads) of one
vmapped gradient of CLIENTS clients (the vectorised engine's step: FunctionalBatch under vmap)
against as many single gradients (the in-process engine's: ModelBatch), each the median of
REPEATS interleaved repeats after a warm-up; beside it the model's convolution FLOPs per
client step (flatflower.runtime.engines.vectorized.conv_flops), the input of the engine's rule
(batching_rule), whose limit (CONV_FLOPS_LIMIT) is read off these records; the rule itself
never times anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.func import vmap

from flatflower.client.batch import ModelBatch
from flatflower.client.layout import Layout
from flatflower.common.models import build_model
from flatflower.runtime.engines.vectorized import FunctionalBatch, conv_flops

CLIENTS = 16
REPEATS = 5
CASES = [  # (model, input shape, batch sizes)
    ("logreg", (1, 8, 8), (16, 32, 64)), ("mlp", (1, 8, 8), (16, 32, 64)),
    ("logreg", (1, 28, 28), (16, 32, 64)), ("mlp", (1, 28, 28), (16, 32, 64)),
    ("cnn", (1, 8, 8), (8, 16, 32, 48, 64)), ("cnn", (1, 28, 28), (4, 8, 16, 32)),
    ("lenet5", (1, 28, 28), (4, 8, 16, 32, 64)), ("lenet", (1, 28, 28), (8, 16, 32)),
    ("cnn", (3, 32, 32), (4, 16, 32)), ("lenet5", (3, 32, 32), (8, 16, 32)),
    ("cifar-cnn", (3, 32, 32), (8, 16, 32)),
]


def measure(name: str, shape: tuple[int, ...], batch: int) -> dict:
    """One row: the two CPU times (medians) and the rule's inputs and answer."""
    model = build_model(name, shape, 10, seed=0)
    layout = Layout.of(model)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    params = [p.detach().unsqueeze(0).expand(CLIENTS, *p.shape).clone() for p in layout.params]
    xs, ys = x.unsqueeze(0).expand(CLIENTS, *x.shape), y.unsqueeze(0).expand(CLIENTS, *y.shape)
    batched = vmap(lambda w, x, y: FunctionalBatch(model, layout.names, w, x, y, None).grad()[1])
    single = ModelBatch(model, x, y)
    model.train()
    work = {"batched": lambda: batched(params, xs, ys), "single": lambda: [single.grad() for _ in range(CLIENTS)]}
    seconds: dict[str, list[float]] = {k: [] for k in work}
    for run in work.values():
        run()  # warm-up
    for _ in range(REPEATS):
        for kind, run in work.items():
            start = time.process_time()
            run()
            seconds[kind].append(time.process_time() - start)
    flops = conv_flops(model, x)
    cpu = {k: statistics.median(v) for k, v in seconds.items()}
    return {"model": name, "input_shape": list(shape), "batch_size": batch, "clients": CLIENTS,
            "conv_flops": flops, "cpu_batched_s": cpu["batched"], "cpu_single_s": cpu["single"],
            "batched_over_single": cpu["batched"] / cpu["single"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for name, shape, batches in CASES:
        for batch in batches:
            rows.append(measure(name, shape, batch))
            print(json.dumps(rows[-1]), flush=True)
    record = {"command": "python docs/results/batching_rule.py --out " + str(args.out),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "machine": platform.machine(), "processor": platform.processor(),
              "repeats": REPEATS, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
