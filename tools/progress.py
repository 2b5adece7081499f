"""What a running command prints: each round as metrics.jsonl gets it, then the outcome."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.config import RunConfig

EXIT_OK, EXIT_FAILED = 0, 1


class Progress:
    """Prints each new metrics.jsonl line of a run as it appears."""

    def __init__(self, run_dir: Path, rounds: int):
        self.path, self.rounds, self.seen, self.last = run_dir / "metrics.jsonl", rounds, 0, None

    def __call__(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for line in lines[self.seen:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # being written
            self.seen += 1
            self.last = row
            extra = ""
            if row["round"] > 0:
                ok = row["clients_replied"] - row["clients_rejected"]
                extra = f"  clients {ok}/{row['clients_sampled']}  {row['seconds']:.1f}s"
            print(f"round {row['round']:>3}/{self.rounds}  test accuracy {100 * row['test_accuracy']:6.2f}%"
                  f"  loss {row['test_loss']:.4f}{extra}", flush=True)
            for what, entries in (("failed", row.get("failures", [])), ("refused", row.get("rejections", []))):
                for e in entries:
                    stage = f"{e['stage']} reply " if "stage" in e else ""
                    print(f"    client {e['partition']} (node {e['node']}) {stage}{what}: {e['reason']}",
                          flush=True)


def finish(cfg: RunConfig, ok: bool, progress: Progress, details: str = "") -> int:
    """Print the outcome (final accuracy, or one ``error:`` line with the reason); the exit code."""
    run_dir = Path(cfg.run_dir)
    progress()
    if ok and progress.last is not None:
        print(f"final test accuracy {100 * progress.last['test_accuracy']:.2f}% after round "
              f"{progress.last['round']}; run directory: {run_dir}")
        return EXIT_OK
    reason = failure_reason(run_dir) or details
    print(f"error: run failed{': ' + reason if reason else ''} (run directory {run_dir}, logs in logs/)",
          file=sys.stderr)
    return EXIT_FAILED


def failure_reason(run_dir: Path) -> str:
    """The one-line reason a failed run wrote to its summary.json ('' if none)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(summary.get("error", "")) if isinstance(summary, dict) and summary.get("status") == "failed" else ""
