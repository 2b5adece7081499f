"""``flatflower flatness RUN_DIR``: how flat a saved model's minimum is, measured once.

The numbers of common/flatness.py (``measure``) for one model of a run directory (final, init
or checkpoint) on the run's evaluation split (``test``) or on the union of its clients'
training data (``train``): the loss and accuracy, the sharpness at radius rho, the Hessian's
top eigenvalue (power iteration) and its trace (Hutchinson). The defaults spend more
Hessian-vector products than the per-round metrics (100 power steps at most, 100 probes), as
this command is for precise numbers (``--tol`` sets power iteration's stopping rule); a table on stdout, ``--json`` for a file.

Bad input (a missing run directory or model, a damaged file, an out-of-range option, an
existing --json file without --force) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from common.config import cli_float, cli_int
from common.flatness import DEFAULT_RHO, HVP_METHODS, TOLERANCE, measure
from tools.prepare import Parser
from tools.saved import MODEL_FILES, SPLITS, SavedRun, check_device

EXIT_USAGE = 2
ITERS, PROBES = 100, 100  # this command's defaults: more precise than the per-round 20 and 10


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flatflower flatness", description=__doc__.split("\n\n")[0].replace("``", "'"),
               allow_abbrev=False)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (flatflower local / simulate)")
    p.add_argument("--model", choices=tuple(MODEL_FILES), default="final",
                   help="final (model_final.pt, default), init (model_init.pt, before round 1) or "
                        "checkpoint (the global model of checkpoint.pt)")
    p.add_argument("--split", choices=SPLITS, default="test",
                   help="test (the server's evaluation split, default) or train (the union of "
                        "all clients' training data, partition.json)")
    p.add_argument("--rho", type=cli_float, default=DEFAULT_RHO,
                   help=f"radius of the sharpness perturbation (default {DEFAULT_RHO})")
    p.add_argument("--iters", type=cli_int, default=ITERS,
                   help=f"power-iteration steps at most (default {ITERS})")
    p.add_argument("--tol", type=cli_float, default=TOLERANCE,
                   help=f"power iteration stops once the eigenvalue changes by less than this, "
                        f"relative (default {TOLERANCE:g}; a small eigengap needs a smaller one)")
    p.add_argument("--probes", type=cli_int, default=PROBES,
                   help=f"Rademacher probes of the Hutchinson trace (default {PROBES})")
    p.add_argument("--seed", type=cli_int, default=0, help="seed of the random vectors (default 0)")
    p.add_argument("--batch-size", type=cli_int, default=None,
                   help="examples per chunk of the whole-split sums (default: the run's eval-batch-size)")
    p.add_argument("--hvp", choices=HVP_METHODS, default="double-backward",
                   help="Hessian-vector products by double backward (default) or torch.func "
                        "(forward-over-reverse); the same numbers")
    p.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:i")
    p.add_argument("--threads", type=cli_int, default=1,
                   help="torch CPU threads (default 1, as a run's server: several threads on a busy "
                        "machine can be far slower; 0 = torch's default)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON here")
    p.add_argument("--force", action="store_true", help="write over an existing --json file")
    return p


def check(args: argparse.Namespace) -> None:
    """ValueError for an option out of range, or a --json file that would be overwritten."""
    if args.rho <= 0:
        raise ValueError(f"--rho must be a finite number > 0, not {args.rho}")
    if not 0 <= args.tol < 1:
        raise ValueError(f"--tol must be in [0, 1), not {args.tol}")
    for name in ("iters", "probes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, not {getattr(args, name)}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, not {args.seed}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, not {args.threads}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, not {args.batch_size}")
    check_device(args.device)
    if args.json is not None:
        if args.json.is_dir():
            raise ValueError(f"--json {args.json} is a directory")
        if (args.json.exists() or args.json.is_symlink()) and not args.force:
            raise ValueError(f"--json {args.json} exists (--force writes over it)")


def flatness(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers of ``args.model`` of ``args.run_dir`` on ``args.split`` (SavedRunError for a
    run directory that cannot give them)."""
    import torch

    run = SavedRun.open(args.run_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = run.dataset()
    model = run.model(args.model, data).to(args.device)
    split = run.split(args.split, data)
    numbers = measure(model, split, batch_size=args.batch_size or run.cfg.eval_batch_size,
                      rho=args.rho, iters=args.iters, probes=args.probes, seed=args.seed,
                      hvp=args.hvp, tol=args.tol)
    return {**numbers, "split": args.split, "model": args.model, "run_dir": str(run.path)}


def render(numbers: dict[str, Any], args: argparse.Namespace) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Flatness of {numbers['run_dir']}: model {numbers['model']}, "
                        f"{numbers['split']} split ({numbers['examples']} examples)")
    for column, justify in (("measure", "left"), ("value", "right"), ("what", "left")):
        table.add_column(column, justify=justify)
    rows = (("loss", f"{numbers['loss']:.6g}", "mean cross-entropy over the whole split, eval mode"),
            ("accuracy", f"{numbers['accuracy']:.2%}", ""),
            ("sharpness", f"{numbers['sharpness']:.6g}", f"L(w + rho g/|g|) - L(w), rho = {numbers['rho']:g}"),
            ("hessian max eig", f"{numbers['hessian_max_eig']:.6g}",
             f"power iteration, at most {args.iters} steps, tol {args.tol:g}"),
            ("hessian trace", f"{numbers['hessian_trace']:.6g}", f"Hutchinson, {args.probes} probes"))
    for row in rows:
        table.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN or infinity: such a number is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flatflower flatness``: 0, or 2 on bad input (one ``error:`` line)."""
    args = build_parser().parse_args(argv)
    try:
        check(args)
        numbers = flatness(args)
    except ValueError as err:  # check's, and SavedRunError
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(render(numbers, args), end="")
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({k: finite_or_none(v) for k, v in numbers.items()},
                                            indent=2) + "\n")
        except OSError as err:
            print(f"error: cannot write {args.json}: {err.strerror or err}", file=sys.stderr)
            return EXIT_USAGE
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
