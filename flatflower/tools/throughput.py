"""``flatflower bench``'s simulation throughput: client·steps per second and seconds per round
of the same federation on each simulation engine (in-process, vectorised, Ray), and on the
papers' own kind of simulation, a plain sequential PyTorch loop (``loop``: tools/loop.py, the
yardstick: FedAvg and FedSAM).

For each model (the MLP and the CNN on digits, LeNet on ``synthetic-cifar10``: random images
of CIFAR-10's shape, not CIFAR-10; LeNet-5 on Fashion-MNIST where it is installed), number of
clients N and engine, a short run of the real ServerApp and ClientApps: by default every client
trains every round (fraction-train 1, fraction-evaluate 0, 1 local epoch of batch 32, iid
partition; the fraction, epochs and batch size are settings), without the clients' self-report
passes, TensorBoard files or checkpoints. It is timed round by round: a round runs from its train messages going out to the
next round's (so it includes aggregation, central evaluation and the run directory's writes),
in wall time and in CPU time of all the engine's threads (in-process engines: this process) or
processes (Ray: the ``flatflower simulate`` process and every process below it). Round 1
(imports, warm-up, the partition handshake) is not timed, and the last round only ends the one
before it. The engines' runs alternate (A, B, C, A, B, C, ...) and each engine's figure is its
fastest timed round: load from other processes only ever adds time. A round's client·steps are
the local steps its clients took (clients.jsonl).

CPU time is the figure to compare on a shared machine: another process's load stretches wall
time but hardly the CPU time a run needs. It is not a latency: the in-process engine's clients
train in parallel threads (its CPU time can exceed its wall time), and time spent waiting is
not CPU time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINES = ("inprocess", "vectorized", "ray", "loop")
# model -> the dataset it trains on
MODEL_DATA = {"mlp": "digits", "cnn": "digits", "lenet": "synthetic-cifar10", "lenet5": "fashion-mnist"}
INPUTS = {
    "digits": "scikit-learn digits (1x8x8, 1437 train images)",
    "synthetic-cifar10": "synthetic-cifar10: seeded random uint8 images of CIFAR-10's shape and "
                         "normalisation (3x32x32, 5000 train), not CIFAR-10",
    "fashion-mnist": "Fashion-MNIST (1x28x28, 60,000 train images)",
}
POLL = 0.005  # seconds between looks at a Ray run's progress.json
LOADED = 0.7  # a 1-minute load average above this x the CPU count makes wall times suspect


@dataclass
class ThroughputSettings:
    models: tuple[str, ...] = ("mlp", "cnn", "lenet")
    clients: tuple[int, ...] = (10, 100, 500)
    engines: tuple[str, ...] = ("inprocess", "vectorized")
    algorithms: tuple[str, ...] = ("fedavg",)
    rounds: int = 4  # per run; rounds 2 .. rounds - 1 are timed
    repeats: int = 2  # interleaved runs per engine
    ray_max_clients: int = 500  # Ray runs with more clients are skipped
    timeout: float = 900.0  # seconds per Ray run
    fraction: float = 1.0  # fraction-train: the share of the N clients each round trains
    local_epochs: int = 1
    batch_size: int = 32

    def validate(self) -> None:
        unknown = [m for m in self.models if m not in MODEL_DATA]
        if unknown:
            raise ValueError(f"throughput models: unknown {', '.join(unknown)} "
                             f"(valid: {', '.join(MODEL_DATA)})")
        bad = [e for e in self.engines if e not in ENGINES]
        if bad:
            raise ValueError(f"throughput engines: unknown {', '.join(bad)} (valid: {', '.join(ENGINES)})")
        from flatflower.strategies.registry import get

        def known(name: str) -> bool:
            try:
                return get(name) is not None
            except ValueError:
                return False

        bad = [a for a in self.algorithms if not known(a)]
        if bad:
            raise ValueError(f"throughput algorithms: unknown {', '.join(bad)}")
        if not (self.models and self.clients and self.engines and self.algorithms):
            raise ValueError("throughput: models, clients, engines and algorithms must not be empty")
        if min(self.clients) < 1:
            raise ValueError("throughput clients must be >= 1")
        if self.rounds < 3:
            raise ValueError("--throughput-rounds must be >= 3 (round 1 is not timed, the last one "
                             "only ends the one before)")
        if self.repeats < 1:
            raise ValueError("--throughput-repeats must be >= 1")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"--throughput-fraction must be in (0, 1] (got {self.fraction:g})")
        if self.local_epochs < 1 or self.batch_size < 1:
            raise ValueError("--throughput-epochs and --throughput-batch-size must be >= 1")
        if "loop" in self.engines:
            from flatflower.tools.loop import LOOP_ALGORITHMS

            bad = [a for a in self.algorithms if a not in LOOP_ALGORITHMS]
            if bad:
                raise ValueError(f"throughput engine loop runs {', '.join(LOOP_ALGORITHMS)} only, "
                                 f"not {', '.join(bad)}")


def run_config(algorithm: str, model: str, run_dir: Path, rounds: int,
               settings: ThroughputSettings | None = None) -> dict[str, Any]:
    from flatflower.strategies.registry import get as get_spec

    settings = settings or ThroughputSettings()
    return {**get_spec(algorithm).example_config(), "dataset": MODEL_DATA[model], "model": model, "partition": "iid",
            "local-epochs": settings.local_epochs, "local-steps": 0, "batch-size": settings.batch_size,
            "fraction-train": settings.fraction, "fraction-evaluate": 0.0,
            "client-eval": False, "tensorboard": False, "checkpoint-every": 0,
            "num-server-rounds": rounds, "run-dir": str(run_dir)}


# ------------------------------------------------------------------------ CPU time of processes
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> dict[int, tuple[int, float, float]] | None:
    """pid -> (parent pid, its own CPU seconds, its reaped children's), from /proc in clock
    ticks (None off Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
        table[int(entry)] = (int(fields[1]), (utime + stime) / _TICK, (cutime + cstime) / _TICK)
    return table


def _process_cpu_seconds(pid: int, ticks: float) -> float:
    """CPU seconds of process ``pid`` (all its threads, exited ones included) to the nanosecond:
    its CPU-time clock (Linux's clock_getcpuclockid(pid): ``~pid << 3 | CPUCLOCK_SCHED``);
    the clock-tick count from /proc where that clock cannot be read."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        return ticks


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds used so far by process ``root`` and every process below it (those that
    exited and were waited for included, to the clock tick); None where /proc cannot tell."""
    table = _proc_table()
    if table is None or root not in table:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        _, own, reaped = table[pid]
        total += _process_cpu_seconds(pid, own) + reaped
        todo += children.get(pid, [])
    return total


# ------------------------------------------------------------------------ one run, round by round
def _rounds(stamps: dict[int, tuple[float, float | None]], rounds: int) -> dict[int, tuple[float, float | None]]:
    """Round r (2 .. rounds - 1) -> (wall seconds, CPU seconds), from the stamps (wall clock,
    CPU clock) taken when each round's train messages went out."""
    out = {}
    for r in range(2, rounds):
        if r in stamps and r + 1 in stamps:
            (w0, c0), (w1, c1) = stamps[r], stamps[r + 1]
            out[r] = (w1 - w0, None if c0 is None or c1 is None else c1 - c0)
    return out


def _client_work(run_dir: Path) -> dict[int, tuple[int, int]]:
    """Round -> (client·steps, examples) of its accepted clients, from clients.jsonl."""
    work: dict[int, list[int]] = {}
    path = run_dir / "clients.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if row.get("status") == "accepted":
            acc = work.setdefault(int(row["round"]), [0, 0])
            acc[0] += int(row["steps"])
            acc[1] += int(row["examples"])
    return {r: (s, e) for r, (s, e) in work.items()}


def measure_inprocess(cfg: dict[str, Any], clients: int, vectorized: bool) -> list[dict[str, Any]]:
    """One run on the in-process grid (``vectorized``: the vectorised engine's); its timed rounds.
    The ServerApp gets the grid with its ``push_messages`` wrapped to stamp each round's first
    train push (as server/progress.py watches it), so nothing of the engines is changed."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    stamps: dict[int, tuple[float, float]] = {}

    def stamp(rnd: int, _sent: int) -> None:
        stamps.setdefault(rnd, (time.perf_counter(), time.process_time()))

    run_dir, _ = run_inprocess(cfg, clients, server_app=watching_train(stamp), vectorized=vectorized)
    return _timed_rows(run_dir, _rounds(stamps, int(cfg["num-server-rounds"])))


def watching_train(on_train: Callable[[int, int], None]) -> Callable[[Any, Any], None]:
    """flatflower's ServerApp with its grid's ``push_messages`` wrapped to call ``on_train(round,
    messages)`` for each push of train messages (as server/progress.py watches them), before
    they go: nothing of the engines is changed."""
    from flwr.app import MessageType

    from flatflower.server.app import app as server_app

    def serve(grid, context) -> None:
        push = grid.push_messages

        def push_messages(messages):
            messages = list(messages)
            train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
            if train:
                on_train(int(train[0].metadata.group_id or 0), len(train))
            return push(messages)

        grid.push_messages = push_messages
        server_app(grid, context)

    return serve


def _timed_rows(run_dir: Path, timed: dict[int, tuple[float, float | None]]) -> list[dict[str, Any]]:
    work = _client_work(run_dir)
    return [{"round": r, "wall_seconds": wall, "cpu_seconds": cpu,
             "client_steps": work.get(r, (0, 0))[0], "examples": work.get(r, (0, 0))[1]}
            for r, (wall, cpu) in sorted(timed.items())]


def measure_ray(cfg: dict[str, Any], clients: int, timeout: float) -> list[dict[str, Any]]:
    """One ``flatflower simulate`` (Flower's Ray engine) in a subprocess; its timed rounds. A thread
    here watches the run directory's progress.json: when it says a round's train messages went
    out, it reads the CPU time of the process tree (within ``POLL`` seconds); the wall time is
    the server's own (progress.json's ``started``)."""
    run_dir = Path(cfg["run-dir"])
    rounds = int(cfg["num-server-rounds"])
    named = {"algorithm", "dataset", "model", "partition", "num-server-rounds", "run-dir"}
    args = [sys.executable, "-m", "flatflower.tools.cli", "simulate", "--engine", "ray", "--clients", str(clients),
            "--algorithm", cfg["algorithm"], "--dataset", cfg["dataset"], "--model", cfg["model"],
            "--partition", cfg["partition"], "--rounds", str(rounds), "--run-dir", str(run_dir),
            "--timeout", str(int(timeout))]
    for key, value in cfg.items():
        if key not in named:
            args += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    stamps: dict[int, tuple[float, float | None]] = {}
    progress = run_dir / "progress.json"
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])
        done = threading.Event()

        def watch() -> None:
            seen = None
            while not done.is_set():
                with contextlib.suppress(OSError, ValueError, TypeError):
                    mtime = progress.stat().st_mtime_ns
                    if mtime != seen:
                        seen = mtime
                        state = json.loads(progress.read_text())
                        r = int(state.get("round", 0))
                        if state.get("stage") == "train" and r not in stamps:
                            stamps[r] = (float(state["started"]), tree_cpu_seconds(proc.pid))
                done.wait(POLL)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            code = proc.wait(timeout=timeout + 120)
        except subprocess.TimeoutExpired:  # Ctrl-C tears its federation down; then its whole group
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = "timeout"
        finally:
            done.set()
            watcher.join()
    if code != 0:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-400:]
        raise RuntimeError(f"flatflower simulate --engine ray ended with {code}: {tail}")
    return _timed_rows(run_dir, _rounds(stamps, rounds))


# ------------------------------------------------------------------------ the section
def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _summary(engine: str, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's figures from all its timed rounds: the fastest by wall time and by CPU time."""
    wall = min(measured, key=lambda r: r["wall_seconds"])
    with_cpu = [r for r in measured if r["cpu_seconds"] is not None]
    cpu = min(with_cpu, key=lambda r: r["cpu_seconds"]) if with_cpu else None
    row = {"engine": engine, "timed_rounds": len(measured),
           "client_steps_per_round": wall["client_steps"], "examples_per_round": wall["examples"],
           "round_seconds": wall["wall_seconds"],
           "client_steps_per_wall_second": wall["client_steps"] / wall["wall_seconds"],
           "cpu_seconds_per_round": cpu["cpu_seconds"] if cpu else None,
           "client_steps_per_cpu_second": cpu["client_steps"] / cpu["cpu_seconds"] if cpu else None,
           "examples_per_cpu_second": cpu["examples"] / cpu["cpu_seconds"] if cpu else None,
           "round_seconds_all": [r["wall_seconds"] for r in measured],
           "cpu_seconds_all": [r["cpu_seconds"] for r in measured]}
    return row


def bench_throughput(settings: ThroughputSettings, workdir: Path, say=lambda text: None) -> dict[str, Any]:
    """Every (algorithm, model, N) with each engine, interleaved; the rows of the table."""
    from flatflower.runtime.engines import quiet_flower

    loads = [load_average()]  # before the section and before each run
    rows: list[dict[str, Any]] = []
    combos = [(a, m, n) for a in settings.algorithms for m in settings.models for n in settings.clients]
    t0 = time.perf_counter()
    for i, (algorithm, model, clients) in enumerate(combos, 1):
        base = {"algorithm": algorithm, "model": model, "dataset": MODEL_DATA[model], "clients": clients}
        runnable, skipped = [], {}
        for engine in settings.engines:
            if engine == "ray" and clients > settings.ray_max_clients:
                skipped[engine] = f"N > {settings.ray_max_clients} (--throughput-ray-max-clients)"
            else:
                runnable.append(engine)
        measured: dict[str, list[dict[str, Any]]] = {e: [] for e in runnable}
        errors: dict[str, str] = {}
        for rep in range(settings.repeats):
            for engine in runnable:
                if engine in errors:
                    continue
                say(f"throughput: {algorithm} {model} N={clients} {engine} "
                    f"(run {rep + 1}/{settings.repeats}; {i}/{len(combos)})")
                loads.append(load_average())
                run_dir = workdir / f"tp-{algorithm}-{model}-{clients}-{engine}-{rep}"
                cfg = run_config(algorithm, model, run_dir, settings.rounds, settings)
                try:
                    if engine == "ray":
                        measured[engine] += measure_ray(cfg, clients, settings.timeout)
                    elif engine == "loop":
                        from flatflower.tools.loop import measure_loop

                        measured[engine] += measure_loop(cfg, clients)
                    else:
                        with quiet_flower():
                            measured[engine] += measure_inprocess(cfg, clients, engine == "vectorized")
                except Exception as err:  # noqa: BLE001 - reported in its row, the others go on
                    errors[engine] = f"{type(err).__name__}: {err}"[-400:]
        found = {}
        for engine in settings.engines:
            if engine in skipped:
                found[engine] = {**base, "engine": engine, "skipped": skipped[engine]}
            elif engine in errors or not measured[engine]:
                found[engine] = {**base, "engine": engine, "error": errors.get(engine, "no timed round")}
            else:
                found[engine] = {**base, **_summary(engine, measured[engine])}
        reference, loop = found.get("inprocess", {}), found.get("loop", {})
        for row in found.values():
            if "round_seconds" in row and "round_seconds" in reference:
                row["speedup_vs_inprocess_wall"] = reference["round_seconds"] / row["round_seconds"]
                both = row["cpu_seconds_per_round"] and reference["cpu_seconds_per_round"]
                row["speedup_vs_inprocess_cpu"] = (reference["cpu_seconds_per_round"] / row["cpu_seconds_per_round"]
                                                   if both else None)
            if row.get("cpu_seconds_per_round") and loop.get("cpu_seconds_per_round"):
                row["cpu_vs_loop"] = row["cpu_seconds_per_round"] / loop["cpu_seconds_per_round"]
                row["wall_vs_loop"] = row["round_seconds"] / loop["round_seconds"]
            rows.append(row)
    loads.append(load_average())
    cpus = os.cpu_count() or 1
    known = [x for x in loads if x is not None]
    return {"algorithms": list(settings.algorithms), "models": list(settings.models),
            "clients": list(settings.clients), "engines": list(settings.engines),
            "fraction": settings.fraction, "local_epochs": settings.local_epochs,
            "batch_size": settings.batch_size,
            "rounds": settings.rounds, "timed_rounds_per_run": settings.rounds - 2,
            "repeats": settings.repeats,
            "inputs": {m: INPUTS[MODEL_DATA[m]] for m in settings.models},
            "cpus": cpus, "load_average_1min_start": loads[0], "load_average_1min_end": loads[-1],
            "load_average_1min_max": max(known) if known else None,
            "loaded": bool(known) and max(known) > LOADED * cpus,
            "seconds": time.perf_counter() - t0, "rows": rows}


def render(section: dict[str, Any]) -> str:
    """The throughput table, what it ran on, and the load it ran under."""
    from flatflower.tools.report import render_table

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    several = len(section["algorithms"]) > 1
    table = []
    for r in section["rows"]:
        row = {"algorithm": r["algorithm"]} if several else {}
        row.update({"model": r["model"], "N": r["clients"], "engine": r["engine"]})
        if "round_seconds" not in r:
            row["s/round (min)"] = "skipped" if "skipped" in r else "error"
            table.append(row)  # the other cells: "-" (render_table)
            continue
        row.update({
            "s/round (min)": f"{r['round_seconds']:.3f}",
            "CPU-s/round": num(r["cpu_seconds_per_round"], ".3f"),
            "client·steps/round": r["client_steps_per_round"],
            "client·steps/CPU-s": num(r["client_steps_per_cpu_second"], ".0f"),
            "client·steps/wall-s": f"{r['client_steps_per_wall_second']:.0f}",
            "speed-up vs in-process (CPU / wall)": (f"{num(r.get('speedup_vs_inprocess_cpu'), '.2f')} / "
                                          f"{num(r.get('speedup_vs_inprocess_wall'), '.2f')}"
                                          if "speedup_vs_inprocess_wall" in r else "-"),
        })
        if "loop" in section["engines"]:
            row["x the loop (CPU / wall)"] = (f"{r['cpu_vs_loop']:.2f} / {r['wall_vs_loop']:.2f}"
                                              if "cpu_vs_loop" in r else "-")
        table.append(row)
    keys = list(dict.fromkeys(k for row in table for k in row))  # the columns: the first row's
    table = [{k: row.get(k, "-") for k in keys} for row in table]
    last = section["rounds"] - 1
    timed = "round 2" if last == 2 else f"rounds 2-{last}"
    fraction, epochs = section.get("fraction", 1.0), section.get("local_epochs", 1)
    who = "every client" if fraction == 1 else f"{fraction:g} of the N clients"
    title = (f"throughput{'' if several else ' of ' + section['algorithms'][0]}: fastest of "
             f"{section['repeats']} interleaved run(s) x {section['timed_rounds_per_run']} timed round(s) per "
             f"engine ({timed} of {section['rounds']}); {who} a round, {epochs} local epoch(s) "
             f"of batch {section.get('batch_size', 32)}")
    lines = [render_table(table, title)]
    if "ray" not in section["engines"]:
        lines.append("  Ray: not run (--full, or --throughput-engines ...,ray)")
    if "loop" in section["engines"]:
        lines.append("  loop: the papers' own kind of simulation, a plain sequential PyTorch loop "
                     "(tools/loop.py); 'x the loop' = an engine's time over the loop's")
    for model, what in section["inputs"].items():
        lines.append(f"  input of {model}: {what}")
    for r in section["rows"]:
        for what in ("skipped", "error"):
            if what in r:
                lines.append(f"  {what}: {r['algorithm']} {r['model']} N={r['clients']} {r['engine']}: {r[what]}")
    loads = ", ".join(f"{label} {num(section[key], '.2f')}" for label, key in
                      (("start", "load_average_1min_start"), ("highest", "load_average_1min_max"),
                       ("end", "load_average_1min_end")))
    lines.append(f"  load average (1 min): {loads}; {section['cpus']} CPUs (this bench itself adds 1-2)")
    if section["loaded"]:
        lines.append(f"  warning: the load average is above {LOADED} x the CPU count: wall-clock figures "
                     "(s/round, client·steps/wall-s) are unreliable on a loaded machine; compare the "
                     "CPU-time ones (client·steps/CPU-s, the CPU speed-up)")
    return "\n".join(lines)
