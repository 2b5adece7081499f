"""The attack x aggregator tables of docs/reliability.md (a benchmark, not a test).

Partitions 0..k-1 of ten are malicious (tests/malicious.py; ``--attackers k``, 1 by default);
digits, Dirichlet 0.5, 20 rounds, FedSAM and FedTOGA, in-process. Each cell is the final test
accuracy (%) and, in brackets, its difference from the clean run under the same aggregator.
The JSON (``--out``) is written after every run, and a run already in it is not run again:
an interrupted bench resumes where it stopped.

    .venv/bin/python tests/attack_bench.py [--rounds 20] [--out docs/attack-bench.json]
    .venv/bin/python tests/attack_bench.py --attackers 2 --rounds 15 \\
        --attacks clean ALIE "IPM e=4" "sign flip x4.5" --out stronger.json
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
from flatflower.client.app import app as honest_app  # noqa: E402
from flatflower.common.config import RunConfig  # noqa: E402
from flatflower.server.run import run_server  # noqa: E402
from flatflower.runtime.engines.inprocess import InProcessGrid  # noqa: E402

ATTACKS = {"clean": "", "data lie": "data-lie", "weight inflation": "weight-inflation",
           "sign flip x4.5": "sign-flip:4.5", "replay": "replay", "scaled x50": "scale:50",
           # colluding (malicious.colluding_grid): every attacker sends the same update
           "ALIE": "alie", "IPM e=0.5": "ipm:0.5", "IPM e=4": "ipm:4"}
ONE_ATTACKER = ["clean", "data lie", "weight inflation", "sign flip x4.5", "replay", "scaled x50"]
AGGREGATORS = {"mean": {}, "mean + outlier-norm-factor 5": {"outlier-norm-factor": 5.0},
               "median": {"aggregator": "median"}, "trimmed-mean": {"aggregator": "trimmed-mean"},
               "krum": {"aggregator": "krum"}, "multi-krum": {"aggregator": "multi-krum"},
               "bulyan": {"aggregator": "bulyan"}, "norm-clip": {"aggregator": "norm-clip"},
               "centered-clip": {"aggregator": "centered-clip"}}


def one(root: Path, algorithm: str, aggregator: str, attack: str, rounds: int, clients: int,
        attackers: int) -> float:
    spec = ATTACKS[attack]
    config = {"algorithm": algorithm, "dataset": "digits", "partition": "dirichlet",
              "dirichlet-alpha": 0.5, "num-server-rounds": rounds, "seed": 0, "num-partitions": clients,
              "checkpoint-every": 0, "aggregator-f": attackers, **AGGREGATORS[aggregator],
              "run-dir": str(root / f"{algorithm}-{aggregator}-{attack}".replace(" ", "_"))}
    cfg = RunConfig.from_mapping(config)
    bad = range(attackers)
    if spec.partition(":")[0] in malicious.COLLUDING:
        grid = malicious.colluding_grid(honest_app, clients, cfg.to_dict(), spec, bad, copy_messages=False)
    elif spec:
        grid = InProcessGrid(malicious.malicious_app({p: spec for p in bad}), clients, cfg.to_dict())
    else:
        grid = InProcessGrid(honest_app, clients, cfg.to_dict(), copy_messages=False)
    run_dir = run_server(grid, cfg)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return 100 * rows[-1]["test_accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--attackers", type=int, default=1, help="partitions 0..k-1 attack (and aggregator-f = k)")
    parser.add_argument("--algorithms", nargs="+", default=["fedsam", "fedtoga"])
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    parser.add_argument("--attacks", nargs="+", default=ONE_ATTACKER, choices=list(ATTACKS))
    parser.add_argument("--out", type=Path, default=Path("attack-bench.json"))
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    setup = {"rounds": args.rounds, "clients": args.clients, "attackers": args.attackers}
    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    results: dict[str, dict] = saved.get("results", {}) if saved.get("setup") == setup else {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            for aggregator in args.aggregators:
                for attack in ["clean", *(a for a in args.attacks if a != "clean")]:
                    row = results.setdefault(algorithm, {}).setdefault(aggregator, {})
                    if attack in row:
                        continue
                    t0 = time.monotonic()
                    row[attack] = one(Path(tmp), algorithm, aggregator, attack, args.rounds,
                                      args.clients, args.attackers)
                    args.out.write_text(json.dumps({"setup": setup, "results": results}, indent=1))
                    print(f"{algorithm:8} {aggregator:30} {attack:17} {row[attack]:6.2f}%  "
                          f"({time.monotonic() - t0:.0f}s)", flush=True)
    for algorithm, table in results.items():
        attacks = [a for a in ATTACKS if any(a in row for row in table.values())]
        print(f"\n{algorithm} (final accuracy %, [difference from the clean run])\n")
        print("| aggregator | " + " | ".join(attacks) + " |")
        print("|---|" + "---|" * len(attacks))
        for aggregator, row in table.items():
            cells = [f"{row['clean']:.1f}"] + [f"{row[a]:.1f} [{row[a] - row['clean']:+.1f}]"
                                               if a in row else "" for a in attacks[1:]]
            print(f"| {aggregator} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
