"""flatflower's public Python API (docs/api.md): the names in ``__all__`` are public and kept
stable; everything else (the modules of flatflower.common, .client, .server, .strategies,
.runtime, .tools) may change between versions.

- :func:`run_simulation`: a federated run in this process, returning a :class:`RunResult`
  (its :class:`History`, final model and summary);
- :func:`algorithms`: every algorithm with its keys and defaults;
- :func:`server_strategy`: an algorithm's server half as a Flower strategy for your own
  ServerApp; :data:`client_app` and :data:`server_app`: flatflower's own Flower apps;
- :func:`local_training`: an algorithm's client half for your own ClientApp;
- :class:`RunConfig` and :class:`ConfigError`: the run config and its one-line refusal;
- your own algorithm (docs/own-algorithm.md): :class:`AlgorithmSpec` over a :class:`ServerRule`
  and a :class:`ClientRule`, their keys declared with :class:`Params` and :func:`key`
  (flatflower.params), their arithmetic in flatflower.tensors; ``algorithm =
  "package.module:callable"`` runs it, ``flatflower check-algorithm`` checks it.

The public names load on first use (a module ``__getattr__``), and the first of them registers
the algorithms (strategies/registry.py), so a RunConfig can be built right away; ``import
flatflower`` alone imports neither PyTorch nor Flower, which keeps ``flatflower --help`` fast.
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors
    from flatflower._halves import TrainingResult, algorithms, local_training, server_strategy
    from flatflower._simulation import History, RunResult, run_simulation
    from flatflower.client.algorithms.base import ClientRule
    from flatflower.client.app import app as client_app
    from flatflower.common.config import ConfigError, RunConfig
    from flatflower.common.params import Params, key
    from flatflower.server.app import app as server_app
    from flatflower.strategies.base import ServerRule
    from flatflower.strategies.registry import AlgorithmSpec

_PUBLIC = {
    "run_simulation": ("flatflower._simulation", "run_simulation"),
    "RunResult": ("flatflower._simulation", "RunResult"),
    "History": ("flatflower._simulation", "History"),
    "algorithms": ("flatflower._halves", "algorithms"),
    "server_strategy": ("flatflower._halves", "server_strategy"),
    "local_training": ("flatflower._halves", "local_training"),
    "TrainingResult": ("flatflower._halves", "TrainingResult"),
    "client_app": ("flatflower.client.app", "app"),
    "server_app": ("flatflower.server.app", "app"),
    "RunConfig": ("flatflower.common.config", "RunConfig"),
    "ConfigError": ("flatflower.common.config", "ConfigError"),
    "AlgorithmSpec": ("flatflower.strategies.registry", "AlgorithmSpec"),
    "ServerRule": ("flatflower.strategies.base", "ServerRule"),
    "ClientRule": ("flatflower.client.algorithms.base", "ClientRule"),
    "Params": ("flatflower.common.params", "Params"),
    "key": ("flatflower.common.params", "key"),
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'flatflower' has no attribute {name!r}")
    _import_module("flatflower.strategies.registry")  # registers the algorithms' keys with the run config
    module, attr = _PUBLIC[name]
    value = getattr(_import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
