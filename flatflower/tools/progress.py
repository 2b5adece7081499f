"""What a running command shows: its rounds as metrics.jsonl gets them, the current round's
clients as progress.json reports them (server/progress.py), an ETA, then the outcome.

On a terminal a live display (rich): a bar of rounds r/R with the ETA and the last accuracy,
and a bar of the current round's clients (replied / sampled). Otherwise plain lines: one per
round, and, while a round lasts longer than ``every`` seconds, one about it every ``every`` seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from flatflower.common.config import RunConfig
from flatflower.common.schema import printable
from flatflower.server.progress import read_progress
from flatflower.server.rundir import open_file

EXIT_OK, EXIT_FAILED = 0, 1
STAGES = {"handshake": "nodes answered the partition handshake", "train": "clients replied"}


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def accuracy_text(row: dict[str, Any], loss: bool = False) -> str:
    """``test accuracy 61.20%`` (``loss``: with its loss) of a metrics.jsonl row; a run with no
    evaluation set on the server (partition = local) shows its federated evaluation's
    (``federated accuracy``), and a round with neither ``no evaluation``."""
    for key in ("test", "federated"):
        accuracy = row.get(f"{key}_accuracy")
        if isinstance(accuracy, (int, float)):
            text = f"{key} accuracy {100 * accuracy:6.2f}%"
            value = row.get(f"{key}_loss")
            if loss:
                text += f"  loss {value:.4f}" if isinstance(value, (int, float)) else "  loss -"
            return text
    return "no evaluation"


def round_line(row: dict[str, Any], rounds: int, eta: float | None) -> str:
    """The plain line of one metrics.jsonl row."""
    extra = ""
    if row["round"] > 0:
        try:
            ok = row["clients_replied"] - row["clients_rejected"]
            extra = f"  clients {ok}/{row['clients_sampled']}  {row['seconds']:.1f}s"
        except (KeyError, TypeError, ValueError):  # a row a killed run's file holds past its checkpoint
            extra = "  (incomplete row)"
        if eta is not None and row["round"] < rounds:
            extra += f"  ETA {duration(eta)}"
    return f"round {row['round']:>3}/{rounds}  {accuracy_text(row, loss=True)}{extra}"


def client_lines(row: dict[str, Any]) -> list[str]:
    """One line per client that failed or whose reply was refused in the round of ``row``."""
    lines = []
    for what, entries in (("failed", row.get("failures", [])), ("refused", row.get("rejections", []))):
        for e in entries:
            stage = f"{e['stage']} reply " if "stage" in e else ""
            lines.append(printable(f"    client {e['partition']} (node {e['node']}) {stage}{what}: "
                                   f"{e['reason']}"))
    return lines


class Progress:
    """Shows a run's progress; call it to refresh (engines call it while they wait)."""

    def __init__(self, run_dir: Path, rounds: int, *, live: bool | None = None,
                 out: TextIO | None = None, every: float = 10.0):
        self.path, self.run_dir, self.rounds = run_dir / "metrics.jsonl", run_dir, rounds
        self.out = out or sys.stdout
        self.seen, self.last, self.seconds = 0, None, []
        self.every, self._said_at = every, None  # in-round lines: at most one per `every` seconds
        live = bool(getattr(self.out, "isatty", lambda: False)()) if live is None else live
        self._live = _LiveBars(self.out, rounds) if live else None

    def eta(self) -> float | None:
        """Seconds left: the mean round time so far x the rounds left (None before round 1)."""
        if not self.seconds or self.last is None:
            return None
        return sum(self.seconds) / len(self.seconds) * (self.rounds - self.last["round"])

    def __call__(self) -> None:
        for row in self._new_rows():
            self.last = row
            if row["round"] > 0 and isinstance(row.get("seconds"), (int, float)):
                self.seconds.append(float(row["seconds"]))
            if self._live:
                self._live.round_done(row, self.eta())
            else:
                print(round_line(row, self.rounds, self.eta()), file=self.out, flush=True)
            for line in client_lines(row):
                self._say(line)
        self._in_round(read_progress(self.run_dir))

    def _say(self, text: str) -> None:
        if self._live:
            self._live.bars.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def _new_rows(self) -> list[dict[str, Any]]:
        try:
            with open_file(self.path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines[self.seen:]:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                break  # being written
            self.seen += 1
            if isinstance(row, dict) and type(row.get("round")) is int:  # else damaged: not shown
                rows.append(row)
        return rows

    def _in_round(self, state: dict[str, Any] | None) -> None:
        """The round in progress (one that metrics.jsonl does not have yet)."""
        done = self.last["round"] if self.last else -1
        if not state or state.get("stage") not in STAGES or state.get("round", 0) <= done:
            return
        r, replied, sampled = state["round"], state.get("replied", 0), state.get("sampled", 0)
        what = STAGES[state["stage"]]
        if self._live:
            self._live.clients(r, replied, sampled, what)
            return
        elapsed = time.time() - float(state.get("started", time.time()))
        now = time.monotonic()
        if elapsed >= self.every and (self._said_at is None or now - self._said_at >= self.every):
            print(f"round {r:>3}/{self.rounds}  in progress: {replied}/{sampled} {what}"
                  f"  {duration(elapsed)}", file=self.out, flush=True)
            self._said_at = now

    def close(self) -> None:
        """Stop the live display (the plain lines need nothing)."""
        if self._live:
            self._live.stop()
            self._live = None


class _LiveBars:
    """The terminal display: rounds and the current round's clients (rich)."""

    def __init__(self, out: TextIO, rounds: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
        from rich.progress import Progress as RichProgress

        self.bars = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"),
                                 console=Console(file=out), transient=False)
        self.rounds = self.bars.add_task("rounds ", total=rounds, info="")
        self.round = self.bars.add_task("clients", total=1, completed=0, info="", visible=False)
        self.bars.start()

    def round_done(self, row: dict[str, Any], eta: float | None) -> None:
        info = " ".join(accuracy_text(row).split())
        if eta is not None and row["round"] > 0:
            info += f"  ETA {duration(eta)}"
        self.bars.update(self.rounds, completed=row["round"], info=info)
        self.bars.update(self.round, visible=False)

    def clients(self, r: int, replied: int, sampled: int, what: str) -> None:
        self.bars.update(self.round, description=f"round {r}", total=max(sampled, 1),
                         completed=replied, info=what, visible=True)

    def stop(self) -> None:
        self.bars.stop()


class Steps:
    """What a long command (bench, sweep) is doing now: a status line on a terminal (rich),
    plain ``<prefix>: <text>`` lines otherwise (at most one per ``every`` seconds)."""

    def __init__(self, prefix: str, *, live: bool | None = None, out: TextIO | None = None,
                 every: float = 0.0):
        self.prefix, self.out, self.every, self._said_at = prefix, out or sys.stdout, every, None
        live = bool(getattr(self.out, "isatty", lambda: False)()) if live is None else live
        self._status = None
        if live:
            from rich.console import Console

            self._status = Console(file=self.out).status("")
            self._status.start()

    def __call__(self, text: str) -> None:
        if self._status is not None:
            self._status.update(f"{self.prefix}: {text}")
            return
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= self.every:
            print(f"{self.prefix}: {text}", file=self.out, flush=True)
            self._said_at = now

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def finish(cfg: RunConfig, ok: bool, progress: Progress, details: str = "") -> int:
    """Print the outcome (final accuracy, or one ``error:`` line with the reason); the exit code."""
    run_dir = Path(cfg.run_dir)
    progress()
    progress.close()
    if ok and progress.last is not None:
        print(f"final {' '.join(accuracy_text(progress.last).split())} after round "
              f"{progress.last['round']}; run directory: {run_dir}")
        return EXIT_OK
    reason = failure_reason(run_dir) or details
    print(f"error: run failed{': ' + reason if reason else ''} (run directory {run_dir}, logs in logs/)",
          file=sys.stderr)
    return EXIT_FAILED


def failure_reason(run_dir: Path) -> str:
    """The one-line reason a failed run wrote to its summary.json ('' if none)."""
    try:
        with open_file(run_dir / "summary.json") as f:
            summary = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return ""
    failed = isinstance(summary, dict) and summary.get("status") == "failed"
    return printable(summary.get("error", ""), 500) if failed else ""
