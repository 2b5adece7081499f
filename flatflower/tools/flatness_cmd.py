"""``flatflower flatness RUN_DIR``: how flat a saved model's minimum is, measured once.

The numbers of common/flatness.py (``measure``) for one model of a run directory (final, init
or checkpoint) on the run's evaluation split (``test``) or on the union of its clients'
training data (``train``): the loss and accuracy, the sharpness at radius rho, the Hessian's
top eigenvalues (Lanczos, converged, each with its residual; ``--method power`` for the per-round
metric's power iteration), its trace (Hutchinson, 100 probes) and, with ``--density``, its
eigenvalue density (stochastic Lanczos quadrature; common/spectrum.py). This command is for
precise numbers; a table on stdout, ``--json`` for a file.

Bad input (a missing run directory or model, a damaged file, an out-of-range option, an
existing --json file without --force) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from flatflower.common.flatness import measure
from flatflower.tools.parsers import flatness as build_parser
from flatflower.common.flatness_settings import TOLERANCE
from flatflower.tools.saved import SavedRun, check_device

EXIT_USAGE = 2


def check(args: argparse.Namespace) -> None:
    """ValueError for an option out of range, or a --json file that would be overwritten."""
    if args.rho <= 0:
        raise ValueError(f"--rho must be a finite number > 0, not {args.rho}")
    if args.tol is None:
        args.tol = 1e-8 if args.method == "lanczos" else TOLERANCE
    if not 0 <= args.tol < 1:
        raise ValueError(f"--tol must be in [0, 1), not {args.tol}")
    if args.top_k > 1 and args.method != "lanczos":
        raise ValueError("--top-k needs --method lanczos")
    for name in ("iters", "probes", "top_k", "slq_steps", "slq_starts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
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
                      hvp=args.hvp, tol=args.tol, method=args.method, top_k=args.top_k,
                      density={"steps": args.slq_steps, "starts": args.slq_starts} if args.density else None)
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
             f"Lanczos (eigsh), tol {args.tol:g}, residual {numbers['hessian_max_eig_residual']:.2g}"
             if args.method == "lanczos" else f"power iteration, at most {args.iters} steps, tol {args.tol:g}"),
            *((f"eigenvalue {i}", f"{e['eigenvalue']:.6g}", f"residual {e['residual']:.2g}")
              for i, e in enumerate(numbers.get("hessian_top_eigenvalues", [])[1:], 2)),
            ("hessian trace", f"{numbers['hessian_trace']:.6g}", f"Hutchinson, {args.probes} probes"),
            *((("hessian density", f"{len(d['nodes'])} nodes",
                f"SLQ, {args.slq_starts} starts x {args.slq_steps} steps, range [{min(d['nodes']):.4g}, "
                f"{max(d['nodes']):.4g}] (--json)"),) if (d := numbers.get("hessian_density")) else ()))
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
