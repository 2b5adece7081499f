"""The attack x aggregator table of docs/reliability.md (a benchmark, not a test).

One client of ten is malicious (tests/malicious.py); digits, Dirichlet 0.5, 20 rounds,
FedSAM and FedTOGA, in-process. Each cell is the final test accuracy (%) and, in brackets,
its difference from the clean run under the same aggregator.

    .venv/bin/python tests/attack_bench.py [--rounds 20] [--out docs/attack-bench.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import malicious  # noqa: E402
from tools.inprocess import run_inprocess  # noqa: E402

ATTACKS = {"clean": "", "data lie": "data-lie", "weight inflation": "weight-inflation",
           "sign flip x4.5": "sign-flip:4.5", "replay": "replay", "scaled x50": "scale:50"}
AGGREGATORS = {"mean": {}, "mean + outlier-norm-factor 5": {"outlier-norm-factor": 5.0},
               "median": {"aggregator": "median"}, "trimmed-mean": {"aggregator": "trimmed-mean"},
               "krum": {"aggregator": "krum"}, "multi-krum": {"aggregator": "multi-krum"},
               "bulyan": {"aggregator": "bulyan"}, "norm-clip": {"aggregator": "norm-clip"}}
ATTACKER = 0


def one(root: Path, algorithm: str, aggregator: str, attack: str, rounds: int) -> float:
    config = {"algorithm": algorithm, "dataset": "digits", "partition": "dirichlet",
              "dirichlet-alpha": 0.5, "num-server-rounds": rounds, "seed": 0,
              "checkpoint-every": 0, **AGGREGATORS[aggregator],
              "run-dir": str(root / f"{algorithm}-{aggregator}-{attack}".replace(" ", "_"))}
    app = malicious.malicious_app({ATTACKER: ATTACKS[attack]}) if ATTACKS[attack] else None
    run_dir, _ = run_inprocess(config, 10, client_app=app)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return 100 * rows[-1]["test_accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--algorithms", nargs="+", default=["fedsam", "fedtoga"])
    parser.add_argument("--out", type=Path, default=Path("attack-bench.json"))
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            for aggregator in AGGREGATORS:
                for attack in ATTACKS:
                    t0 = time.monotonic()
                    acc = one(Path(tmp), algorithm, aggregator, attack, args.rounds)
                    results.setdefault(algorithm, {}).setdefault(aggregator, {})[attack] = acc
                    print(f"{algorithm:8} {aggregator:30} {attack:17} {acc:6.2f}%  "
                          f"({time.monotonic() - t0:.0f}s)", flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    for algorithm, table in results.items():
        print(f"\n{algorithm} (final accuracy %, [difference from the clean run])\n")
        print("| aggregator | " + " | ".join(ATTACKS) + " |")
        print("|---|" + "---|" * len(ATTACKS))
        for aggregator, row in table.items():
            cells = [f"{row['clean']:.1f}"] + [f"{row[a]:.1f} [{row[a] - row['clean']:+.1f}]"
                                               for a in list(ATTACKS)[1:]]
            print(f"| {aggregator} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
