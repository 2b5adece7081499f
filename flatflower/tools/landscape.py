"""``flatflower landscape RUN_DIR [RUN_DIR ...]``: loss surfaces around saved global models.

Surfaces (Li et al., NeurIPS 2018, "Visualizing the Loss Landscape of Neural Nets"): L(w + a d0)
(``--dims 1``) or L(w + a d0 + b d1) (``--dims 2``) for a, b on ``--steps`` points over
[-S, S], w a run's saved model. d0 and d1 are *filter-normalised* Gaussian directions: for each
trainable weight tensor of dim >= 2, a Gaussian tensor drawn on the CPU from a generator seeded
with ``--seed`` (tensors in state_dict order, all of d0 before d1), whose every filter (output
row, index 0) is rescaled to the norm of the same row of w. 1-D parameters (biases) get
direction zero, Li et al.'s default. Buffers are never perturbed. The same seed gives the same
raw directions for the same architecture; each run normalises them against its own weights.

Interpolation (``--interpolate``, Goodfellow et al., ICLR 2015): L((1 - a) w_init + a w_final)
for a over [-S, 1 + S] (default S = 0.5), from model_init.pt to model_final.pt; a barrier
between the two is a bump in the curve. Its direction is d0 = w_final - w_init (the points are
w_final + (a - 1) d0).

L is the mean cross-entropy over the whole split, with accuracy, in evaluation mode
(common/flatness.py: SplitLoss). The runs are drawn on one figure (2-D: one contour panel per
run on shared levels and one colour bar; 1-D: one curve per run, loss and accuracy); runs of
another architecture (state_dict names or shapes) are refused. ``--data`` writes an NPZ:

* ``coords`` (N,): the grid values of a (and b);
* ``loss``, ``accuracy``: (runs, N) or (runs, N, N) with [run, i, j] at (a_i, b_j), in RUN_DIR order;
* ``dir0/<name>``, ``dir1/<name>`` (2-D only): the normalised directions of each trainable
  parameter, stacked per run (shape (runs, *param_shape)), since each run's are its own;
* ``runs``, ``labels``, ``mode`` (``surface`` | ``interpolate``), ``split``, ``model``, ``span``, ``seed``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flatflower.common.flatness import SplitLoss, perturbed
from flatflower.tools.parsers import DEFAULT_SPAN, INTERPOLATE_SPAN
from flatflower.tools.parsers import landscape as build_parser
from flatflower.tools.saved import SavedRun, SavedRunError, check_device


@dataclass
class Surface:
    """One run's losses and accuracies on the grid, and its directions (name -> tensor)."""

    run: SavedRun
    loss: np.ndarray
    accuracy: np.ndarray
    directions: list[OrderedDict]


def grid(lo: float, hi: float, steps: int) -> np.ndarray:
    """``steps`` evenly spaced values over [lo, hi]; one within rounding of 0 or 1 is exactly
    that, so the grid's centre is w itself and interpolation's a = 0, 1 are the saved models
    (a = 0 up to the rounding of w_final - (w_final - w_init))."""
    coords = np.linspace(lo, hi, steps)
    snapped: set[int] = set()
    for exact in (0.0, 1.0):  # the point nearest each, if within rounding and not taken already
        i = int(np.argmin(np.abs(coords - exact)))
        if i not in snapped and abs(coords[i] - exact) < 1e-9 * (hi - lo):
            coords[i] = exact
            snapped.add(i)
    return coords


def trainable(model: torch.nn.Module) -> OrderedDict:
    """name -> parameter, the trainable ones, in state_dict order."""
    params = dict(model.named_parameters())
    return OrderedDict((n, params[n]) for n in model.state_dict() if n in params and params[n].requires_grad)


def raw_directions(params: OrderedDict, seed: int, count: int) -> list[OrderedDict]:
    """``count`` Gaussian directions (float64, CPU): one tensor per parameter of dim >= 2, drawn
    in order from one generator seeded with ``seed``; zero for 1-D parameters."""
    gen = torch.Generator().manual_seed(seed)
    return [OrderedDict((n, torch.randn(p.shape, generator=gen, dtype=torch.float64) if p.dim() >= 2
                         else torch.zeros(p.shape, dtype=torch.float64)) for n, p in params.items())
            for _ in range(count)]


def filter_normalised(direction: OrderedDict, params: OrderedDict) -> OrderedDict:
    """Each row (filter: index 0) of each tensor rescaled to the norm of the same row of w."""
    out = OrderedDict()
    for n, d in direction.items():
        w = params[n].detach().double().cpu()
        if d.dim() < 2:
            out[n] = torch.zeros_like(d)
            continue
        rows_d, rows_w = d.reshape(len(d), -1), w.reshape(len(w), -1)
        scale = rows_w.norm(dim=1) / (rows_d.norm(dim=1) + 1e-10)
        out[n] = (rows_d * scale[:, None]).reshape(d.shape)
    return out


class Progress:
    """``landscape: k/total grid points (p%), elapsed, ETA`` on stderr: every 5% of the points
    once the surface has taken ``quiet`` seconds (a short one stays quiet), and at the end;
    nothing with ``silent``."""

    def __init__(self, total: int, quiet: float = 2.0, silent: bool = False):
        self.total, self.done, self.shown, self.quiet, self.silent = total, 0, 0, quiet, silent
        self.start = time.monotonic()

    def step(self) -> None:
        from flatflower.tools.progress import duration

        self.done += 1
        if self.silent:
            return
        elapsed = time.monotonic() - self.start
        step = self.done * 20 // self.total
        if (step > self.shown and elapsed >= self.quiet) or self.done == self.total:
            self.shown = step
            eta = elapsed / self.done * (self.total - self.done)
            print(f"landscape: {self.done}/{self.total} grid points ({100 * self.done // self.total}%), "
                  f"{duration(elapsed)}" + (f", ETA {duration(eta)}" if self.done < self.total else ""),
                  file=sys.stderr, flush=True)


def evaluate(split_loss: SplitLoss, points: np.ndarray, delta_at: Callable[[np.ndarray], dict],
             progress: Progress) -> tuple[np.ndarray, np.ndarray]:
    """(loss, accuracy) of w + ``delta_at(point)`` at every point (its last axis: coordinates)."""
    loss, accuracy = np.empty(points.shape[:-1]), np.empty(points.shape[:-1])
    for index in np.ndindex(*points.shape[:-1]):
        delta = delta_at(points[index])
        with perturbed(split_loss.params, [delta[n] for n in split_loss.names]):
            loss[index], accuracy[index] = split_loss.value()
        progress.step()
    return loss, accuracy


def surface_points(coords: np.ndarray, dims: int) -> np.ndarray:
    """The grid's points, shape (N,) * dims + (dims,): [i, j] is (coords[i], coords[j])."""
    return np.stack(np.meshgrid(*[coords] * dims, indexing="ij"), axis=-1)


def random_directions(params: OrderedDict, seed: int, dims: int) -> list[OrderedDict]:
    """``dims`` filter-normalised directions for the weights ``params`` (float64, CPU)."""
    return [filter_normalised(d, params) for d in raw_directions(params, seed, dims)]


def losses(model: torch.nn.Module, split, batch_size: int, directions: Sequence[OrderedDict],
           points: np.ndarray, progress: Progress, offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(loss, accuracy) over the split at w + sum_k (point_k - offset) directions[k], for every
    point (last axis: its coordinates), w the model's trainable parameters."""
    split_loss = SplitLoss(model, split, batch_size)
    params = trainable(model)
    cast = [{n: d[n].to(p.device, p.dtype) for n, p in params.items()} for d in directions]

    def delta_at(point: np.ndarray) -> dict:
        return {n: sum(float(x - offset) * d[n] for x, d in zip(point, cast)) for n in params}

    return evaluate(split_loss, points, delta_at, progress)


def surface(run: SavedRun, args: argparse.Namespace, coords: np.ndarray, progress: Progress) -> Surface:
    """The run's loss surface (``--dims`` 1 or 2) around w, or its interpolation curve:
    w_final + (a - 1)(w_final - w_init)."""
    data = run.dataset()
    model = run.model("final" if args.interpolate else args.model, data).to(args.device)
    params = trainable(model)
    if args.interpolate:
        init = run.weights("init", model)
        directions = [OrderedDict((n, p.detach().double().cpu() - init[n].double()) for n, p in params.items())]
        offset = 1.0  # a = 1 is w (model_final.pt) itself
    else:
        directions = random_directions(params, args.seed, args.dims)
        offset = 0.0
    loss, accuracy = losses(model, run.split(args.split, data), args.batch_size or run.cfg.eval_batch_size,
                            directions, surface_points(coords, args.dims), progress, offset)
    return Surface(run, loss, accuracy, directions)


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def write_npz(path: Path, surfaces: Sequence[Surface], coords: np.ndarray, args: argparse.Namespace) -> Path:
    arrays = {"coords": coords,
              "loss": np.stack([s.loss for s in surfaces]),
              "accuracy": np.stack([s.accuracy for s in surfaces]),
              "runs": np.array([str(s.run.path) for s in surfaces]),
              "labels": np.array([s.run.label for s in surfaces]),
              "mode": np.array("interpolate" if args.interpolate else "surface"),
              "split": np.array(args.split), "model": np.array("init-final" if args.interpolate else args.model),
              "span": np.array(args.span), "seed": np.array(args.seed)}
    for k in range(len(surfaces[0].directions)):
        for name in surfaces[0].directions[k]:
            arrays[f"dir{k}/{name}"] = np.stack([s.directions[k][name].numpy() for s in surfaces])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez(f, **arrays)
    return path


def plot(path: Path, surfaces: Sequence[Surface], coords: np.ndarray, args: argparse.Namespace) -> Path:
    """2-D: one contour panel per run on shared levels and one colour bar; 1-D: loss and
    accuracy, one curve per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    what = f"{args.split} split"
    if args.dims == 2 and not args.interpolate:
        n = len(surfaces)
        fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 1.2, 4.2), squeeze=False, constrained_layout=True)
        levels = contour_levels(np.stack([s.loss for s in surfaces]))
        norm = matplotlib.colors.BoundaryNorm(levels, 256)
        for ax, s in zip(axes[0], surfaces):
            loss = np.where(np.isfinite(s.loss), s.loss, np.nan).T  # [b, a]: rows are the y axis
            filled = ax.contourf(coords, coords, loss, levels=levels, norm=norm, cmap="viridis")
            ax.contour(coords, coords, loss, levels=levels, colors="white", linewidths=0.4)
            ax.plot(0, 0, marker="+", color="red")
            ax.set(title=s.run.label, xlabel="d0", ylabel="d1", aspect="equal")
            ax.title.set_fontsize(9)
        fig.colorbar(filled, ax=axes[0].tolist(), label=f"loss ({what})")
        fig.suptitle(f"loss surfaces around the {args.model} models (filter-normalised, seed {args.seed})")
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, constrained_layout=True)
        for s in surfaces:
            line, = top.plot(coords, s.loss, label=s.run.label)
            bottom.plot(coords, s.accuracy, color=line.get_color())
        wide = loss_range(np.stack([s.loss for s in surfaces]))[2]
        top.set(ylabel=f"loss ({what})", yscale="log" if wide else "linear")
        bottom.set(ylabel="accuracy", xlabel="a: (1 - a) w_init + a w_final" if args.interpolate
                   else "a: w + a d0 (filter-normalised)")
        for ax in (top, bottom):
            for x in ((0.0, 1.0) if args.interpolate else (0.0,)):
                ax.axvline(x, color="grey", linewidth=0.6, linestyle=":")
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
        top.set_title("linear interpolation from the initial to the final model" if args.interpolate
                      else f"loss around the {args.model} models (filter-normalised, seed {args.seed})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def loss_range(loss: np.ndarray) -> tuple[float, float, bool]:
    """(lowest, highest finite loss, whether they differ by more than a factor of 20: then a
    log scale, or the walls of a basin would hide its floor)."""
    finite = loss[np.isfinite(loss)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    hi = max(hi, lo + 1e-6)
    return lo, hi, lo > 0 and hi / lo > 20


def contour_levels(loss: np.ndarray, count: int = 30) -> np.ndarray:
    """Levels shared by every panel, from the lowest loss to the highest, geometric over a
    wide range."""
    lo, hi, wide = loss_range(loss)
    return np.geomspace(lo, hi, count) if wide else np.linspace(lo, hi, count)


def summary(s: Surface, coords: np.ndarray, interpolate: bool) -> str:
    """One line per run: the loss at the saved model(s), the lowest, and (interpolation) the
    highest between init and final, the barrier."""
    def at(value: float) -> str:
        hit = np.flatnonzero(coords == value)
        return "not on the grid" if hit.size == 0 else f"{s.loss[(int(hit[0]),) * s.loss.ndim]:.4f}"

    if interpolate:
        between = s.loss[(coords >= 0) & (coords <= 1)]
        text = f"loss at init {at(0.0)}, at final {at(1.0)}, highest between {np.nanmax(between):.4f}"
    else:
        text = f"loss at the centre {at(0.0)}"
    return f"{s.run.label}: {text}, lowest {np.nanmin(s.loss):.4f}"


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Completes the defaults; a value out of range, or an output file that exists without
    --force, is one ``error:`` line and exit code 2 (before anything is computed)."""
    if args.interpolate:
        if args.dims == 2:
            parser.error("--interpolate is 1-D: drop --dims 2")
        if args.model is not None:
            parser.error("--interpolate goes from model_init.pt to model_final.pt: drop --model")
    args.dims = 1 if args.interpolate else (args.dims or 2)
    args.model = args.model or "final"
    args.span = args.span if args.span is not None else INTERPOLATE_SPAN if args.interpolate else DEFAULT_SPAN
    if not args.span > 0:
        parser.error(f"--span must be > 0, got {args.span}")
    if args.steps < 3:
        parser.error(f"--steps must be >= 3, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    try:
        check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    args.out = args.out or default_out(args.run_dirs)
    for path in (args.out, args.data):
        if path is not None and path.exists() and not args.force:
            parser.exit(2, f"error: {path} exists (--force writes over it)\n")


def default_out(run_dirs: Sequence[str | Path]) -> Path:
    """landscape.png where ``flatflower report`` puts report.png (tools/report.py: default_out)."""
    from flatflower.tools.report import default_out as report_out

    return report_out(run_dirs).with_name("landscape.png")


def open_runs(args: argparse.Namespace) -> list[SavedRun]:
    """The runs, each with the model(s) asked for, all of one architecture."""
    runs, first = [], None
    for run_dir in args.run_dirs:
        run = SavedRun.open(run_dir)
        for which in (("init", "final") if args.interpolate else (args.model,)):
            shapes = [(n, tuple(t.shape)) for n, t in run.state_dict(which).items()]
            if first is None:
                first = (run, shapes)
            elif shapes != first[1] and first[0] is run:  # its own init and final models differ
                raise SavedRunError(f"{run.path}: model_init.pt and model_final.pt differ in names or "
                                    "shapes (one does not fit the other): one is damaged or edited")
            elif shapes != first[1]:
                raise SavedRunError(f"{run.path}: another architecture ({run.model_name!r}) than "
                                    f"{first[0].path} ({first[0].model_name!r}): one figure compares "
                                    "models of one architecture along the same directions")
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flatflower landscape``: 0 on success, 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        runs = open_runs(args)
        coords = grid(-args.span, 1 + args.span, args.steps) if args.interpolate else \
            grid(-args.span, args.span, args.steps)
        progress = Progress(len(runs) * args.steps ** args.dims)
        surfaces = [surface(run, args, coords, progress) for run in runs]
    except SavedRunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing was written yet
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    try:
        print(f"plot: {plot(args.out, surfaces, coords, args)}")
        if args.data is not None:
            print(f"data: {write_npz(args.data, surfaces, coords, args)}")
    except OSError as err:
        print(f"error: cannot write {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2
    for s in surfaces:
        print(summary(s, coords, args.interpolate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
