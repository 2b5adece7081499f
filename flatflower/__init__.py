"""flatflower's public Python API (docs/api.md): the names in ``__all__`` are public and kept
stable; everything else (the modules of common/, client/, server/, strategies/, tools/) may
change between versions.

- :func:`run_simulation`: a federated run in this process, returning a :class:`RunResult`
  (its :class:`History`, final model and summary);
- :func:`algorithms`: every algorithm with its keys and defaults;
- :func:`server_strategy`: an algorithm's server half as a Flower strategy for your own
  ServerApp; :data:`client_app` and :data:`server_app`: flatflower's own Flower apps;
- :func:`local_training`: an algorithm's client half for your own ClientApp;
- :class:`RunConfig` and :class:`ConfigError`: the run config and its one-line refusal.

Importing this package registers the algorithms (strategies/registry.py), so a RunConfig can
be built right away.
"""

from __future__ import annotations

import flatflower.strategies.registry  # noqa: F401 - registers the algorithms' keys with the run config
from flatflower.client.app import app as client_app
from flatflower.common.config import ConfigError, RunConfig
from flatflower._halves import TrainingResult, algorithms, local_training, server_strategy
from flatflower._simulation import History, RunResult, run_simulation
from flatflower.server.app import app as server_app

__all__ = ["run_simulation", "RunResult", "History", "algorithms", "server_strategy", "local_training",
           "TrainingResult", "client_app", "server_app", "RunConfig", "ConfigError"]
