"""train-transform (common/augment.py): crop-flip checked by hand and against torchvision's
functional transforms, applied before the standardisation and to local training batches only,
drawn from its own generator (runs repeat bit for bit, the engines agree, none changes nothing),
and refused where the data are not images."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from flatflower.client.train import round_generator
from flatflower.common.augment import (Augment, TransformError, augment_generator, check_train_transform, crop_flip,
                            train_augment)
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.datasets import Split, load_dataset
from flatflower.runtime.engines import vectorized as vec
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.prepare import UsageError, preflight
from tests.helpers import user_module_file

IMAGES = {"dataset": "digits", "model": "cnn", "partition": "iid", "local-steps": 3, "batch-size": 16,
          "num-server-rounds": 2, "fraction-evaluate": 0.0, "tensorboard": False}


def draws(seed: int, n: int, padding: int = 4):
    g = torch.Generator().manual_seed(seed)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=g)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=g)
    flip = torch.rand(n, generator=g) < 0.5
    return top.tolist(), left.tolist(), flip.tolist()


# ---------------------------------------------------------------------- crop-flip
def test_crop_flip_on_a_hand_checkable_image() -> None:
    """3x3 image 1..9, padding 1: the padded image is 5x5 with a zero border; each sample is
    the 3x3 window at (top, left), mirrored when flipped."""
    x = (torch.arange(9, dtype=torch.float32) + 1).view(1, 1, 3, 3).repeat(64, 1, 1, 1)
    out = crop_flip(x, torch.Generator().manual_seed(5), padding=1)
    padded = np.zeros((5, 5))
    padded[1:4, 1:4] = np.arange(1, 10).reshape(3, 3)
    top, left, flip = draws(5, 64, padding=1)
    for i in range(64):
        window = padded[top[i]:top[i] + 3, left[i]:left[i] + 3]
        expected = window[:, ::-1] if flip[i] else window
        assert np.array_equal(out[i, 0].numpy(), expected), i
    assert out.shape == x.shape
    # (0, 0) without a flip puts the zero border on the top and left
    assert {(t, l, f) for t, l, f in zip(top, left, flip)} >= {(1, 1, False), (1, 1, True)}


def test_crop_flip_matches_torchvision_functional_pad_crop_flip() -> None:
    from torchvision.transforms import functional as TF

    x = torch.rand(32, 3, 8, 6)  # H != W: the crop keeps H x W
    out = crop_flip(x, torch.Generator().manual_seed(1))
    top, left, flip = draws(1, 32)
    for i in range(32):
        ref = TF.crop(TF.pad(x[i], [4]), top[i], left[i], 8, 6)
        if flip[i]:
            ref = TF.hflip(ref)
        assert torch.equal(out[i], ref)


def test_crop_flip_draws_every_offset_and_flips_half() -> None:
    top, left, flip = draws(2, 20000)
    assert set(top) == set(left) == set(range(9))
    assert abs(np.mean(flip) - 0.5) < 0.02
    assert max(np.bincount(top)) / min(np.bincount(top)) < 1.1


def test_zero_padding_is_zero_of_the_raw_image_not_of_the_standardised_one() -> None:
    """Split.get applies the transform to x / scale, then standardises: a padded pixel reads
    (0 - mean) / std."""
    split = Split(torch.full((4, 1, 2, 2), 255, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64),
                  mean=(0.5,), std=(0.25,), scale=255.0)
    plain, _ = split.get(slice(None))
    assert torch.allclose(plain, torch.full_like(plain, 2.0))
    shifted, _ = split.get(slice(None), augment=lambda x: torch.zeros_like(x))
    assert torch.allclose(shifted, torch.full_like(shifted, -2.0))


def test_the_augmentation_generator_is_its_own_stream() -> None:
    a, b = augment_generator(0, 1, 2), round_generator(0, 1, 2)
    assert torch.randint(0, 2**30, (8,), generator=a).tolist() != torch.randint(0, 2**30, (8,), generator=b).tolist()
    same = [torch.rand(4, generator=augment_generator(0, 1, 2)).tolist() for _ in range(2)]
    assert same[0] == same[1]
    assert torch.rand(4, generator=augment_generator(0, 2, 2)).tolist() != same[0]
    assert train_augment("none", 0, 1, 2) is None
    assert isinstance(train_augment("crop-flip", 0, 1, 2), Augment)


# ---------------------------------------------------------------- user transforms
TRANSFORMS = '''
import torch

CALLS = []

def noise(x, generator):
    CALLS.append(tuple(x.shape))
    return x + 0.01 * torch.randn(x.shape, generator=generator).to(x.device)

def shrink(x, generator):
    return x[:, :, 1:, 1:]

def ints(x, generator):
    return x.long()

def boom(x, generator):
    raise RuntimeError("bad pixel")
'''


@pytest.fixture
def transforms(tmp_path, monkeypatch):
    yield from user_module_file(tmp_path, monkeypatch, "augs", TRANSFORMS)


@pytest.mark.parametrize(("attr", "match"), [
    ("shrink", "returned shape (4, 1, 7, 7) for a batch of shape (4, 1, 8, 8); it must keep the shape"),
    ("ints", "returned torch.int64; it must return floating point"),
    ("boom", "calling it raised RuntimeError: bad pixel"),
    ("nowhere", "has no attribute 'nowhere'"),
])
def test_a_bad_user_transform_is_one_line_before_anything_starts(transforms, attr, match) -> None:
    with pytest.raises(ValueError) as err:
        check_train_transform(f"{transforms}:{attr}", load_dataset("digits"))
    assert match in str(err.value) and "\n" not in str(err.value)


def test_a_user_transform_sees_local_training_batches_only(transforms, tmp_path) -> None:
    """Counted calls: one per local step of every client, none for the self-reports or the
    federated and central evaluations (which run too)."""
    module = sys.modules.get(transforms) or __import__(transforms)
    cfg = {**IMAGES, "train-transform": f"{transforms}:noise", "fraction-evaluate": 1.0,
           "run-dir": str(tmp_path / "run")}
    run_dir, _ = run_inprocess(cfg, 3)
    calls = [c for c in module.CALLS if c[0] == 16]  # check_train_transform's probe is 4 samples
    assert len(calls) == 2 * 3 * 3  # rounds x clients x local steps
    assert all(c == (16, 1, 8, 8) for c in calls)
    assert len(module.CALLS) == len(calls) + 1  # and the ServerApp's one check
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


# ----------------------------------------------------------------- runs
def final_bytes(run_dir) -> bytes:
    return (run_dir / "model_final.pt").read_bytes()


def final_state(run_dir) -> dict:
    return torch.load(run_dir / "model_final.pt")


def test_crop_flip_runs_repeat_bit_for_bit_and_change_the_training(tmp_path) -> None:
    cfg = {**IMAGES, "train-transform": "crop-flip"}
    a, _ = run_inprocess({**cfg, "run-dir": str(tmp_path / "a")}, 3)
    b, _ = run_inprocess({**cfg, "run-dir": str(tmp_path / "b")}, 3)
    plain, _ = run_inprocess({**IMAGES, "run-dir": str(tmp_path / "plain")}, 3)
    assert torch.equal(torch.cat([t.flatten() for t in final_state(a).values()]),
                       torch.cat([t.flatten() for t in final_state(b).values()]))
    assert not torch.equal(final_state(a)["0.weight"], final_state(plain)["0.weight"])


def test_the_in_process_and_vectorised_engines_agree_with_crop_flip(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(vec, "MIN_GROUP", 1)
    monkeypatch.setattr(vec, "batching_pays", lambda call: True)
    grouped = []
    train_group = vec.train_group
    monkeypatch.setattr(vec, "train_group", lambda calls: grouped.append(len(calls)) or train_group(calls))
    cfg = {**IMAGES, "train-transform": "crop-flip", "model": "mlp"}
    inp, _ = run_inprocess({**cfg, "run-dir": str(tmp_path / "inp")}, 4)
    vect, _ = run_inprocess({**cfg, "run-dir": str(tmp_path / "vec")}, 4, vectorized=True)
    assert grouped and max(grouped) > 1  # the vectorised engine really batched the clients
    a, b = final_state(inp), final_state(vect)
    num = math.sqrt(sum(float((a[k].double() - b[k].double()).norm()) ** 2 for k in a))
    den = math.sqrt(sum(float(b[k].double().norm()) ** 2 for k in a))
    assert num / den < 1e-6
    plain, _ = run_inprocess({**cfg, "train-transform": "none", "run-dir": str(tmp_path / "plain")}, 4)
    assert not torch.equal(final_state(plain)["1.weight"], a["1.weight"])


# ------------------------------------------------------------------ refusals
def test_crop_flip_needs_images_before_anything_starts(tmp_path) -> None:
    cfg = RunConfig.from_mapping({"dataset": "synthetic", "model": "logreg", "partition": "iid",
                                  "train-transform": "crop-flip", "num-partitions": 2})
    with pytest.raises(UsageError, match=r"train-transform='crop-flip' needs image data \(C, H, W\); the samples "
                                         r"of dataset 'synthetic' have shape \(20,\)"):
        preflight(cfg, 2)
    with pytest.raises(TransformError, match="needs image data"):
        run_inprocess({"dataset": "synthetic", "model": "logreg", "partition": "iid", "train-transform": "crop-flip",
                       "num-server-rounds": 1, "run-dir": str(tmp_path / "run")}, 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "needs image data" in summary["error"]


def test_config_refuses_an_unknown_transform() -> None:
    with pytest.raises(ConfigError, match="train-transform='crop-flp' is not one of: none, crop-flip, or a "
                                          "package.module:callable \\(did you mean 'crop-flip'\\?\\)"):
        RunConfig.from_mapping({"train-transform": "crop-flp"})
    assert RunConfig.from_mapping({"train-transform": "mypkg.aug:jitter"}).train_transform == "mypkg.aug:jitter"
