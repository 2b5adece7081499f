"""A finished (or checkpointed) run, read back from its directory: its run config, a saved
model and the data splits it was measured on. ``flatflower flatness`` and ``flatflower
landscape`` start here.

Models: ``final`` (model_final.pt), ``init`` (model_init.pt, before round 1) or
``checkpoint`` (the global model of checkpoint.pt). Splits: ``test`` (the server's evaluation
split, behind ``test_accuracy``) or ``train`` (the union of every client's training data, as
partition.json records it: the papers' "global training loss").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.schema import printable
from flatflower.common.datasets import DatasetUnavailableError, FederatedDataset, Split
from flatflower.common.models import build_model
from flatflower.server.rundir import RunDirError, load_checkpoint, load_tensors
from flatflower.tools.parsers import MODEL_FILES, SPLITS
from flatflower.tools.runfiles import RunFileError, read_json, table



def check_device(text: str) -> str:
    """``text`` if this machine has that device (cpu, cuda, cuda:i); ValueError saying why not."""
    if text == "cpu":
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not cpu, cuda or cuda:i") from None
    if device.type != "cuda" or not torch.cuda.is_available() \
            or (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: no such CUDA device on this machine")
    return text


class SavedRunError(ValueError):
    """A run directory cannot give what was asked (missing, damaged, another architecture)."""


@dataclass
class SavedRun:
    path: Path
    cfg: RunConfig
    model_name: str

    @classmethod
    def open(cls, run_dir: str | Path) -> SavedRun:
        path = Path(run_dir).expanduser()
        if not path.is_dir():
            raise SavedRunError(f"{run_dir}: no such run directory")
        if not (path / "config.json").is_file():
            raise SavedRunError(f"{path}: no config.json, not a flatflower run directory")
        try:
            saved = table(read_json(path / "config.json", infinity=True), str(path / "config.json"))
            config = saved.get("config")
            if not isinstance(config, dict):
                raise TypeError("its 'config' is not a JSON object")
            cfg = RunConfig.from_mapping({**config, "resume": False})
        except RunFileError as err:
            raise SavedRunError(str(err)) from None
        except (ValueError, KeyError, TypeError, ConfigError) as err:
            raise SavedRunError(f"{path / 'config.json'} is unreadable or damaged: "
                                f"{printable(err, 200)}") from None
        model = saved.get("model")
        return cls(path, cfg, model if isinstance(model, str) and model else cfg.resolved_model())

    @property
    def label(self) -> str:
        return f"{self.cfg.algorithm} (seed {self.cfg.seed}, {self.path.name})"

    def dataset(self) -> FederatedDataset:
        from flatflower.common.data import dataset_for

        try:
            return dataset_for(self.cfg)
        except (DatasetUnavailableError, OSError, ValueError) as err:
            raise SavedRunError(f"{self.path}: its dataset {self.cfg.dataset!r} is not available "
                                f"here: {str(err).splitlines()[0][:300]}") from None

    def state_dict(self, which: str = "final") -> OrderedDict:
        """The saved model ``which`` (final | init | checkpoint) as a state dict."""
        if which not in MODEL_FILES:
            raise SavedRunError(f"--model {which!r} is not one of {', '.join(MODEL_FILES)}")
        file = self.path / MODEL_FILES[which]
        if not file.is_file():
            hint = {"final": "the run has not finished (use --model checkpoint)",
                    "checkpoint": "checkpoint-every=0, or no round was checkpointed",
                    "init": "not a flatflower run directory"}[which]
            raise SavedRunError(f"{self.path}: no {MODEL_FILES[which]} ({hint})")
        try:
            state = (load_checkpoint(self.path)["strategy"]["model"] if which == "checkpoint"
                     else load_tensors(file, "model"))
        except RunDirError as err:
            raise SavedRunError(str(err)) from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise SavedRunError(f"{file} holds no model state dict (names -> tensors)")
        return OrderedDict(state)

    def weights(self, which: str, model: nn.Module) -> OrderedDict:
        """The saved model ``which``, checked against ``model``: the same names, shapes and
        dtypes, finite values (a damaged or edited file is refused, never measured)."""
        from flatflower.common import schema

        state = self.state_dict(which)
        layout = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
        try:
            schema.tensors(layout)(state, MODEL_FILES[which])
        except ValueError as err:
            raise SavedRunError(f"{self.path}: {MODEL_FILES[which]} does not fit the run's model "
                                f"{self.model_name!r}: {printable(err, 300)}") from None
        return state

    def model(self, which: str = "final", data: FederatedDataset | None = None) -> nn.Module:
        """The run's architecture with the weights of ``which`` loaded."""
        data = data or self.dataset()
        try:
            model = build_model(self.model_name, data.input_shape, data.num_classes, seed=self.cfg.seed)
        except ValueError as err:  # config.json names a model this flatflower lacks, or one unfit
            raise SavedRunError(f"{self.path / 'config.json'}: {err}") from None
        state = self.weights(which, model)
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise SavedRunError(f"{self.path}: {MODEL_FILES[which]} does not fit the run's model "
                                f"{self.model_name!r}: {str(err).splitlines()[0][:200]}") from None
        return model

    def split(self, name: str, data: FederatedDataset | None = None) -> Split:
        """The evaluation split (``test``) or the union of the clients' training data (``train``)."""
        if name not in SPLITS:
            raise SavedRunError(f"--split {name!r} is not one of {', '.join(SPLITS)}")
        data = data or self.dataset()
        if name == "test":
            return data.test
        return data.train.subset(self.training_indices(len(data.train)))

    def training_indices(self, size: int) -> np.ndarray:
        """The sorted indices every client trained on, from partition.json."""
        file = self.path / "partition.json"
        if not file.is_file():
            raise SavedRunError(f"{self.path}: no partition.json (written after round 1), so the "
                                "clients' training data is unknown: use --split test")
        try:
            parts = table(read_json(file), str(file)).get("partitions")
            if not isinstance(parts, dict) or not parts or not all(
                    isinstance(p, list) and all(type(i) is int and abs(i) < 2**62 for i in p) for p in parts.values()):
                raise RunFileError(f"{file}: 'partitions' is not a table of lists of indices")
            indices = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts.values()]))
        except RunFileError as err:
            raise SavedRunError(str(err)) from None
        if indices.size == 0 or indices[0] < 0 or indices[-1] >= size:
            raise SavedRunError(f"{file} holds indices outside the training split (size {size})")
        return indices
