"""Issue 45's GPU figures in one call (docs/benchmarks.md, "One GPU, measured"): run on a lent
GPU machine by docs/results/run_gpu_bench.sh; it writes docs/results/gpu-bench/<device>.json and
prints a table. Without CUDA it says so in one line and exits 0; ``--cpu-dry-run`` runs the same
code on the CPU with one round and a few steps (to check the script, not to measure).

Figures: the study preset's (fashion-mnist-bench, FedSAM, 10 clients x 60 steps of 50) round time
in each engine, the GPU's busy fraction (profiled device time / wall), host syncs per local step
(torch.cuda.set_sync_debug_mode's warnings), peak memory, ResNet-18's cost per step of each
algorithm against SGD (tools/bench.py's compute section), a longer run (100 FedSAM rounds,
vectorised) and, last, the study round vectorised with ``compile = on`` (round 1 compiles). The
JSON is written after every section, so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.bench import Settings, _round_seconds, bench_compute
from flatflower.tools.presets import load_preset

OUT = Path(__file__).parent / "gpu-bench"


def study(algorithm: str, rounds: int, steps: int | None, device: str, run_dir: Path) -> tuple[dict, int | None]:
    preset = load_preset("fashion-mnist-bench")
    config = {**preset.values(algorithm), "algorithm": algorithm, "num-server-rounds": rounds,
              "seed": 0, "tensorboard": False, "server-device": device, "run-dir": str(run_dir)}
    if steps:
        config["local-steps"] = steps
    return config, preset.clients


def timed_run(config: dict, clients: int, device: str, vectorized: bool, profile: bool) -> dict:
    """One run: per-round seconds, wall, host syncs (CUDA), busy fraction, peak memory."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_sync_debug_mode("warn")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        if profile:
            with torch.profiler.profile(activities=activities) as prof:
                run_dir, _ = run_inprocess(config, clients, node_config={"device": device}, vectorized=vectorized)
        else:
            run_dir, _ = run_inprocess(config, clients, node_config={"device": device}, vectorized=vectorized)
        wall = time.perf_counter() - t0
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = sum(len(r.get("sampled_partitions", [])) for r in rows if r["round"] >= 1)
    steps = trained * config.get("local-steps", 0) or None
    out = {"engine": "vectorised" if vectorized else "in-process", "compile": config.get("compile", "off"),
           "rounds": config["num-server-rounds"],
           "round_seconds": _round_seconds(run_dir), "wall_seconds": wall,
           "final_test_accuracy": rows[-1].get("test_accuracy"),
           "host_syncs": syncs if cuda else None, "host_syncs_per_step": syncs / steps if cuda and steps else None,
           "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
    if profile and cuda:
        busy_us = sum(e.self_device_time_total for e in prof.key_averages())
        out["gpu_busy_fraction"] = busy_us / 1e6 / wall
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="check the script on the CPU (not a measurement)")
    parser.add_argument("--long-rounds", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT, help="where <device>.json goes (default: %(default)s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu bench: skipped, no CUDA device on this machine")
        return 0
    device = "cpu" if args.cpu_dry_run else "cuda"
    dry = args.cpu_dry_run
    name = "cpu-dry-run" if dry else torch.cuda.get_device_name(0).replace(" ", "-")
    report: dict = {"device": name, "torch": torch.__version__, "study": [], "long": None, "resnet18": [],
                    "study_compiled": None}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"

    def save() -> None:  # after every section: a run cut short by its time limit keeps what it measured
        path.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for vectorized in (False, True):
            for profile in (False, True):  # timed, then profiled (busy fraction)
                config, clients = study("fedsam", 1 if dry else 3, 2 if dry else 60, device,
                                        work / f"study-{vectorized}-{profile}")
                row = timed_run(config, clients, device, vectorized, profile)
                row["profiled"] = profile
                report["study"].append(row)
                save()
                print(f"study fedsam {row['engine']:>10} profiled={profile}: rounds {row['round_seconds']}", flush=True)
        config, clients = study("fedsam", 2 if dry else args.long_rounds, 2 if dry else None, device, work / "long")
        report["long"] = timed_run(config, clients, device, True, False)
        save()
        print(f"long fedsam run: {report['long']['wall_seconds']:.1f} s", flush=True)
    settings = Settings(quick=dry, model="lenet5" if dry else "resnet18", input_shape=(1, 28, 28) if dry else (3, 32, 32),
                        num_classes=10, batch_size=8 if dry else 128, steps=1 if dry else 10, repeats=1 if dry else 3,
                        device=device, full_overhead=False)
    report["resnet18"] = bench_compute(settings, say=lambda s: print(s, flush=True))
    save()
    with tempfile.TemporaryDirectory() as tmp:  # last: compiling takes a while (round 1 holds it)
        config, clients = study("fedsam", 2 if dry else 4, 2 if dry else 60, device, Path(tmp) / "compiled")
        report["study_compiled"] = timed_run({**config, "compile": "on"}, clients, device, True, False)
        save()
        print(f"study fedsam vectorised, compile = on: rounds {report['study_compiled']['round_seconds']}", flush=True)
    print(f"\n{'engine':>10} {'profiled':>8} {'round s (median)':>17} {'busy':>6} {'syncs/step':>10} {'peak MiB':>9}")
    for r in [*report["study"], report["study_compiled"]]:
        med = sorted(r["round_seconds"])[len(r["round_seconds"]) // 2]
        engine = r["engine"] + (" compiled" if r["compile"] == "on" else "")
        print(f"{engine:>10} {r.get('profiled', False)!s:>8} {med:>17.3f} {r.get('gpu_busy_fraction') or 0:>6.2f} "
              f"{r['host_syncs_per_step'] or 0:>10.2f} {r['peak_memory_mib'] or 0:>9.0f}")
    print(f"\n{'algorithm':>14} {'cost vs SGD':>11}")
    for r in report["resnet18"]:
        print(f"{r['algorithm']:>14} {r['cost_vs_sgd']:>11.2f}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
