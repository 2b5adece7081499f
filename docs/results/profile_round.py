"""Where a simulated round's time goes (docs/benchmarks.md, "Where a round's time goes").

    PYTHONPATH=$PWD python docs/results/profile_round.py --engine vectorized --clients 100 \
        --algorithm fedsam --model mlp --epochs 5 [--compile] [--ops] [--out FILE.json]

One run of the bench's throughput setting (tools/throughput.py: iid, batch 32, every client
every round, no self-reports) on the in-process or vectorised engine. Each stage of a round is
timed (wall seconds summed over the threads that ran it, rounds 2 onwards): the clients'
opening of their train messages, their local training, their replies, and the server's
sampling, validation (collect), aggregation (finish_round), clients.jsonl rows and the rest of
the round (central evaluation, run files). ``--ops``: the vectorised engine's training runs in
one thread, which torch.profiler then records (its CPU ops, and its kernels on a GPU): the ops
that take the training's time (the profiler's own cost is in that stage's figure then). Also
recorded: the process's CPU time over the wall time of the timed rounds (how many cores a
round keeps busy). The nodes' device is ``auto`` (CUDA when present). Flower's and the
clients' INFO lines are off, as in the bench and the CLI. Nothing of the engines is changed;
the stages are wrapped here.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

import flatflower.client.app as client_app
import flatflower.runtime.engines.inprocess as inprocess
import flatflower.server.run as server_run
import flatflower.strategies.strategy as strategy
from flatflower.runtime.engines import quiet_flower
from flatflower.tools.throughput import ThroughputSettings, measure_inprocess, run_config

STAGES = {  # stage -> (object, attribute) wrapped
    "client: open the train message": (client_app.TrainCall, "open"),
    "client: local training (in-process)": (client_app, "local_train"),
    "client: local training (vectorised group)": (inprocess, "train_together"),
    "client: reply": (client_app.TrainCall, "reply"),
    "server: sample and send": (strategy.FlatStrategy, "configure_train"),
    "server: validate replies": (strategy.FlatStrategy, "collect"),
    "server: aggregate": (strategy.FlatStrategy, "finish_round"),
    "server: clients.jsonl rows": (server_run, "client_rows"),
}


class Stages:
    """Wall seconds per stage, summed over threads, from the start of round 2; the vectorised
    training's torch.profiler op table."""

    def __init__(self, device: str, ops: bool):
        self.seconds: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.counting = False
        self.ops: list[dict] = []
        self.device, self.profile_ops = device, ops

    def wrap(self, label: str, owner, name: str) -> None:
        original = getattr(owner, name)
        profiled = name == "train_together" and self.profile_ops

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                if profiled and self.counting:
                    return self._profiled(original, *args, **kwargs)
                return original(*args, **kwargs)
            finally:
                if self.counting:
                    with self.lock:
                        self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    def _profiled(self, original, *args, **kwargs):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            out = original(*args, **kwargs)
        for event in prof.key_averages():
            self.ops.append({"op": event.key, "count": event.count, "self_cpu_us": event.self_cpu_time_total,
                             "device_us": getattr(event, "self_device_time_total", 0.0)})
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("inprocess", "vectorized"), default="vectorized")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--algorithm", default="fedsam")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ops", action="store_true",
                        help="torch.profiler over the vectorised training (adds its own overhead to that stage)")
    parser.add_argument("--compile", action="store_true", help="run-config compile = on (the vectorised step compiled)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--label", default="", help="what code was measured (recorded in --out)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the nodes' device = auto
    stages = Stages(device, args.ops)
    for label, (owner, name) in STAGES.items():
        stages.wrap(label, owner, name)
    configure = strategy.FlatStrategy.configure_train

    def start_counting(self, server_round, *rest, **kwargs):
        if server_round == 2:
            stages.counting = True
        return configure(self, server_round, *rest, **kwargs)

    strategy.FlatStrategy.configure_train = start_counting
    workdir = Path(tempfile.mkdtemp(prefix="flatflower-profile-"))
    settings = ThroughputSettings(local_epochs=args.epochs)
    cfg = run_config(args.algorithm, args.model, workdir / "run", args.rounds, settings)
    cfg["batching"] = "on"  # the vectorised engine batches, whatever this CPU's calibration says
    cfg["compile"] = "on" if args.compile else "off"  # its first round (not timed) compiles
    with quiet_flower():  # Flower's and the clients' INFO lines off, as the bench and the CLI have them
        rows = measure_inprocess(cfg, args.clients, args.engine == "vectorized")
    timed = len(rows) + 1  # rounds 2 .. rounds: counting ran from round 2's send to the run's end
    round_s = sorted(r["wall_seconds"] for r in rows)
    ops = collections.defaultdict(lambda: {"count": 0, "self_cpu_us": 0.0, "device_us": 0.0})
    for op in stages.ops:
        for key in ("count", "self_cpu_us", "device_us"):
            ops[op["op"]][key] += op[key]
    top = sorted(ops.items(), key=lambda kv: -kv[1]["self_cpu_us"])[:15]
    result = {
        "label": args.label, "engine": args.engine, "clients": args.clients, "algorithm": args.algorithm, "model": args.model,
        "epochs": args.epochs, "compile": cfg["compile"], "device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "round_seconds_best": round_s[0], "round_seconds_median": round_s[len(round_s) // 2],
        # the process's CPU time over the wall time of the timed rounds: how many cores a round keeps busy
        "cpu_over_wall": round(sum(r["cpu_seconds"] for r in rows) / sum(r["wall_seconds"] for r in rows), 3),
        "stage_ms_per_round": {k: round(1000 * v / timed, 2) for k, v in stages.seconds.items()},
        "top_ops_ms_per_round": {k: round(v["self_cpu_us"] / 1000 / timed, 2) for k, v in top},
        "all_ops_ms_per_round": round(sum(v["self_cpu_us"] for v in ops.values()) / 1000 / timed, 2),
    }
    print(f"{args.engine}, {args.clients} clients, {args.algorithm}, {args.model}, {args.epochs} epoch(s): "
          f"round {result['round_seconds_best']:.3f} s best, {result['round_seconds_median']:.3f} s median, "
          f"CPU / wall {result['cpu_over_wall']:.2f}")
    for label, ms in sorted(result["stage_ms_per_round"].items()):
        print(f"  {label:45s} {ms:8.1f} ms/round")
    if top:
        print(f"  vectorised training's ops, all (self CPU): {result['all_ops_ms_per_round']:.1f} ms/round; the top ones:")
        for op, ms in result["top_ops_ms_per_round"].items():
            print(f"    {op:43s} {ms:8.2f} ms/round")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
