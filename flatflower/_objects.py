"""A user's Python objects as run-config names: a model or a dataset handed to the API as an
object (not a name or a ``package.module:callable`` text) is registered in this process under a
generated name (flatflower.common.models.register_model, flatflower.common.datasets.register_dataset), which the run
config then carries. In-process engines only: another process knows nothing of the name.
"""

from __future__ import annotations

import copy
import itertools
import re
import threading
from typing import Any

from torch import nn

_LOCK = threading.Lock()
_COUNTER = itertools.count(1)
_NAMES: dict[int, tuple[Any, str]] = {}  # id(object) -> (the object, kept alive; its name)


def _name(obj: Any, kind: str) -> str:
    """A new run-config name for ``obj`` (the same one each time the same object is given)."""
    with _LOCK:
        known = _NAMES.get(id(obj))
        if known is not None and known[0] is obj:
            return known[1]
        label = getattr(obj, "__name__", None) or type(obj).__name__
        name = f"python-{kind}-{re.sub(r'[^A-Za-z0-9_-]', '', label) or kind}-{next(_COUNTER)}"
        _NAMES[id(obj)] = (obj, name)
        return name


def model_name(model: Any) -> str:
    """``model`` as a run-config ``model`` value: a text as it is; an ``nn.Module`` (every
    build is a deep copy of it: the run starts from its weights, whatever the seed) or a
    callable taking ``(input_shape, num_classes)`` or nothing, registered under a new name."""
    from flatflower.common.models import register_model

    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        name = _name(model, "model")
        register_model(name, lambda: copy.deepcopy(model))
        return name
    if callable(model):
        name = _name(model, "model")
        register_model(name, model)
        return name
    raise ValueError(f"model={type(model).__name__} is not a model name, a package.module:callable "
                     "reference, an nn.Module or a callable returning one")


def dataset_name(dataset: Any) -> str:
    """``dataset`` as a run-config ``dataset`` value: a text as it is; a callable (the contract
    of flatflower.common.userdata.from_callable: takes ``(data_dir)`` or nothing, returns ``(train,
    test)`` or ``{"train", "test", "num_classes"}``), or that return value itself, registered
    under a new name."""
    from flatflower.common.datasets import register_dataset

    if isinstance(dataset, str):
        return dataset
    if callable(dataset) and not isinstance(dataset, (tuple, list, dict)):
        name = _name(dataset, "dataset")
        register_dataset(name, dataset)
        return name
    if isinstance(dataset, dict) or (isinstance(dataset, (tuple, list)) and len(dataset) == 2):
        name = _name(dataset, "dataset")
        register_dataset(name, _returning(dataset))
        return name
    raise ValueError(f"dataset={type(dataset).__name__} is not a dataset name, a package.module:callable "
                     "reference, a callable, (train, test) or a dict with 'train' and 'test'")


def _returning(value: Any):
    """A callable with no arguments returning ``value`` (kept once: a name is bound once)."""
    with _LOCK:
        known = _RETURNING.get(id(value))
        if known is None:
            known = _RETURNING[id(value)] = lambda: value
        return known


_RETURNING: dict[int, Any] = {}
