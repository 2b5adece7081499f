"""`flatflower landscape`: filter-normalised loss surfaces and the init-to-final interpolation of
real (in-process) runs, their NPZ, and the refusals of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flatflower.common.flatness import SplitLoss, perturbed
from tests.helpers import fast_config
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.landscape import raw_directions, trainable
from flatflower.tools.saved import SavedRun

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two digits-CNN runs (FedAvg seed 0, FedSAM seed 1) and a digits-MLP run: one round, two
    clients each."""
    root = tmp_path_factory.mktemp("landscape")
    out = {}
    for name, algorithm, model, seed in (("avg", "fedavg", "cnn", 0), ("sam", "fedsam", "cnn", 1),
                                         ("mlp", "fedavg", "mlp", 0)):
        cfg = fast_config(algorithm=algorithm, dataset="digits", model=model, seed=seed,
                          num_server_rounds=1, batch_size=32, run_dir=str(root / name))
        out[name], _ = run_inprocess(cfg, num_clients=2)
    return out


def landscape(*argv) -> int:
    """``flatflower landscape ...`` in this process: its exit code (also from argparse's exits)."""
    try:
        return cli(["landscape", *map(str, argv)])
    except SystemExit as exit:
        return exit.code


def split_loss(run_dir: Path, which: str = "final") -> SplitLoss:
    run = SavedRun.open(run_dir)
    return SplitLoss(run.model(which), run.split("test"), run.cfg.eval_batch_size)


@pytest.fixture(scope="module")
def surface(runs, tmp_path_factory) -> dict:
    """A 3 x 3 surface of both CNN runs, its NPZ loaded."""
    out = tmp_path_factory.mktemp("surface")
    assert landscape(runs["avg"], runs["sam"], "--steps", 3, "--span", 0.5,
                     "--out", out / "s.png", "--data", out / "s.npz") == 0
    return {"png": out / "s.png", **dict(np.load(out / "s.npz"))}


def test_the_centre_is_the_models_loss_and_the_figure_is_written(runs, surface):
    assert surface["png"].read_bytes().startswith(PNG_MAGIC)
    np.testing.assert_array_equal(surface["coords"], [-0.5, 0.0, 0.5])
    assert surface["loss"].shape == surface["accuracy"].shape == (2, 3, 3)
    for i, name in enumerate(("avg", "sam")):
        loss, accuracy = split_loss(runs[name]).value()
        assert surface["loss"][i, 1, 1] == loss and surface["accuracy"][i, 1, 1] == accuracy
        assert surface["loss"][i].min() < surface["loss"][i].max()  # the grid moved the model
    assert list(surface["labels"]) == [SavedRun.open(runs[n]).label for n in ("avg", "sam")]


def test_directions_are_filter_normalised_and_biases_zero(runs, surface):
    for i, name in enumerate(("avg", "sam")):
        weights = SavedRun.open(runs[name]).state_dict("final")
        for k in (0, 1):
            for param, w in weights.items():
                d = torch.from_numpy(surface[f"dir{k}/{param}"][i])
                assert d.shape == w.shape
                if w.dim() < 2:
                    assert not d.any(), param
                else:
                    torch.testing.assert_close(d.flatten(1).norm(dim=1), w.double().flatten(1).norm(dim=1),
                                               rtol=1e-6, atol=0)


def test_a_grid_value_recomputed_from_the_npz_directions_matches(runs, surface):
    for i, name in enumerate(("avg", "sam")):
        measure = split_loss(runs[name])
        names = [n for n, _ in measure.model.named_parameters()]
        delta = [torch.from_numpy(-0.5 * surface[f"dir0/{n}"][i] + 0.5 * surface[f"dir1/{n}"][i]).float()
                 for n in names]
        with perturbed(measure.params, delta):
            loss, accuracy = measure.value()
        assert loss == pytest.approx(surface["loss"][i, 0, 2], rel=1e-5)
        assert accuracy == pytest.approx(surface["accuracy"][i, 0, 2], abs=1 / len(measure) + 1e-12)


def test_the_same_seed_gives_the_same_directions_another_seed_others(runs, surface, tmp_path):
    # the two runs' directions are the same raw directions, rescaled row by row
    name = "0.weight"
    a, b = (torch.from_numpy(surface[f"dir0/{name}"][i]).flatten(1) for i in (0, 1))
    torch.testing.assert_close(torch.nn.functional.cosine_similarity(a, b, dim=1),
                               torch.ones(len(a), dtype=torch.float64))
    params = trainable(SavedRun.open(runs["avg"]).model())
    same, other = raw_directions(params, 0, 2), raw_directions(params, 1, 2)
    assert all(torch.equal(same[k][n], raw_directions(params, 0, 2)[k][n]) for k in (0, 1) for n in params)
    assert not torch.equal(same[0][name], other[0][name]) and not torch.equal(same[0][name], same[1][name])
    # through the command: seed 0 again gives the NPZ's directions, seed 1 others
    for seed, equal in ((0, True), (1, False)):
        assert landscape(runs["avg"], "--dims", 1, "--steps", 3, "--span", 0.5, "--seed", seed,
                         "--out", tmp_path / f"{seed}.png", "--data", tmp_path / f"{seed}.npz") == 0
        again = np.load(tmp_path / f"{seed}.npz")
        assert again["loss"].shape == (1, 3)
        assert np.array_equal(again[f"dir0/{name}"][0], surface[f"dir0/{name}"][0]) is equal


def test_interpolation_ends_are_the_initial_and_final_models(runs, tmp_path, capsys):
    assert landscape(runs["avg"], runs["sam"], "--interpolate", "--steps", 5,
                     "--out", tmp_path / "i.png", "--data", tmp_path / "i.npz") == 0
    assert (tmp_path / "i.png").read_bytes().startswith(PNG_MAGIC)
    data = np.load(tmp_path / "i.npz")
    np.testing.assert_array_equal(data["coords"], [-0.5, 0.0, 0.5, 1.0, 1.5])  # default span 0.5
    assert data["loss"].shape == (2, 5) and "dir1/0.weight" not in data
    for i, name in enumerate(("avg", "sam")):
        assert data["loss"][i, 1] == pytest.approx(split_loss(runs[name], "init").value()[0], rel=1e-6)
        assert data["loss"][i, 3] == split_loss(runs[name], "final").value()[0]
        run = SavedRun.open(runs[name])
        init, final = run.state_dict("init"), run.state_dict("final")
        for param in final:
            np.testing.assert_allclose(data[f"dir0/{param}"][i], (final[param] - init[param]).double().numpy())
    assert "10/10 grid points (100%)" in capsys.readouterr().err


def test_runs_of_another_architecture_are_refused(runs, tmp_path, capsys):
    assert landscape(runs["avg"], runs["mlp"], "--steps", 3, "--out", tmp_path / "x.png") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "architecture" in err
    assert str(runs["mlp"]) in err and not (tmp_path / "x.png").exists()


def damaged(runs, tmp_path) -> Path:
    run = Path(shutil.copytree(runs["avg"], tmp_path / "damaged"))
    (run / "model_final.pt").write_bytes(b"not a model")
    return run


def unfinished(runs, tmp_path) -> Path:
    run = Path(shutil.copytree(runs["avg"], tmp_path / "unfinished"))
    (run / "model_final.pt").unlink()
    return run


BAD = {
    "no model_final.pt": (unfinished, [], "no model_final.pt"),
    "a damaged model file": (damaged, [], "model_final.pt"),
    "no such directory": (lambda runs, tmp: tmp / "nowhere", [], "no such run directory"),
    "--steps 2": (None, ["--steps", "2"], "--steps must be >= 3"),
    "--span 0": (None, ["--span", "0"], "--span must be > 0"),
    "--span -1": (None, ["--span=-1"], "--span must be > 0"),
    "--batch-size 0": (None, ["--batch-size", "0"], "--batch-size must be >= 1"),
    "--threads -1": (None, ["--threads=-1"], "--threads must be >= 0"),
    "config.json naming an unknown model": (lambda runs, tmp: _unknown_model(runs, tmp), [], "unknown model 'nosuch'"),
    "--device cuda:9": (None, ["--device", "cuda:9"], "no such CUDA device"),
    "--device gpu": (None, ["--device", "gpu"], "is not cpu, cuda or cuda:i"),
    "an unknown split": (None, ["--split", "valid"], "invalid choice: 'valid'"),
    "an unknown model": (None, ["--model", "best"], "invalid choice: 'best'"),
    "--dims 3": (None, ["--dims", "3"], "invalid choice: 3"),
    "--interpolate --dims 2": (None, ["--interpolate", "--dims", "2"], "--interpolate is 1-D"),
    "--interpolate without model_init.pt": (
        lambda runs, tmp: _without(runs, tmp, "model_init.pt"), ["--interpolate"], "no model_init.pt"),
}


def _unknown_model(runs, tmp_path) -> Path:
    run = Path(shutil.copytree(runs["avg"], tmp_path / "unknown"))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": "nosuch"}))
    return run


def _without(runs, tmp_path, name) -> Path:
    run = Path(shutil.copytree(runs["avg"], tmp_path / "without"))
    (run / name).unlink()
    return run


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_code_2(runs, tmp_path, capsys, case):
    make, flags, text = BAD[case]
    run = make(runs, tmp_path) if make else runs["avg"]
    assert landscape(run, "--steps", 3, *flags, "--out", tmp_path / "x.png") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and text in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("existing", ["--out", "--data"])
def test_an_existing_output_is_kept_without_force(runs, tmp_path, capsys, existing):
    out, data = tmp_path / "l.png", tmp_path / "l.npz"
    kept = {"--out": out, "--data": data}[existing]
    kept.write_bytes(b"keep")
    argv = [runs["avg"], "--dims", 1, "--steps", 3, "--out", out, "--data", data]
    assert landscape(*argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {kept} exists (--force writes over it)\n"  # said before any grid point
    assert kept.read_bytes() == b"keep" and len(list(tmp_path.iterdir())) == 1
    assert landscape(*argv, "--force") == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and np.load(data)["loss"].shape == (1, 3)


def test_the_default_figure_goes_where_the_report_goes_and_the_help_lists_the_command(runs, capsys):
    from flatflower.tools.report import default_out

    out = default_out([runs["avg"]]).with_name("landscape.png")
    assert landscape(runs["avg"], "--dims", 1, "--steps", 3) == 0
    assert out == runs["avg"] / "landscape.png" and out.read_bytes().startswith(PNG_MAGIC)
    out.unlink()
    with pytest.raises(SystemExit):
        cli(["--help"])
    assert "landscape" in capsys.readouterr().out


def test_progress_is_shown_every_5_percent_of_a_long_surface_and_at_the_end(capsys):
    from flatflower.tools.landscape import Progress

    progress = Progress(40, quiet=0.0)  # a long surface: past its quiet first seconds
    for _ in range(40):
        progress.step()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == [f"{2 * k}/40" for k in range(1, 21)]
    assert lines[-1].startswith("landscape: 40/40 grid points (100%)") and "ETA" not in lines[-1]


@pytest.mark.parametrize("split, model", [("train", "final"), ("test", "init")])
def test_split_and_model_choose_what_is_measured(runs, tmp_path, split, model):
    assert landscape(runs["avg"], "--dims", 1, "--steps", 3, "--split", split, "--model", model,
                     "--out", tmp_path / "l.png", "--data", tmp_path / "l.npz") == 0
    run = SavedRun.open(runs["avg"])
    measure = SplitLoss(run.model(model), run.split(split), run.cfg.eval_batch_size)
    assert len(measure) == len(run.dataset().train if split == "train" else run.dataset().test)
    assert np.load(tmp_path / "l.npz")["loss"][0, 1] == measure.value()[0]


def test_contour_levels_are_geometric_over_a_wide_range():
    from flatflower.tools.landscape import contour_levels

    np.testing.assert_allclose(contour_levels(np.array([1.0, 2.0]), 3), [1.0, 1.5, 2.0])
    np.testing.assert_allclose(contour_levels(np.array([0.5, np.inf, 50.0]), 3), [0.5, 5.0, 50.0])


def test_the_grid_holds_0_and_1_exactly_and_never_moves_a_point_onto_them():
    """0 and 1 are exact grid values where the grid passes them; with a huge span the point
    at 0 stays at 0 (a rounding tolerance of the span's size once moved it to 1)."""
    from flatflower.tools.landscape import grid

    assert grid(-1e30, 1e30, 3).tolist() == [-1e30, 0.0, 1e30]
    coords = grid(-0.5, 1.5, 21)
    assert 0.0 in coords.tolist() and 1.0 in coords.tolist()
    assert np.allclose(coords, np.linspace(-0.5, 1.5, 21))
    assert grid(-1.0, 1.0, 4).tolist() == np.linspace(-1.0, 1.0, 4).tolist()  # no point near 0 or 1
