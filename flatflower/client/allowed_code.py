"""A node decides what code a run config makes it import (issue 58).

``model``, ``dataset``, ``train-transform`` and ``algorithm`` accept a reference to code,
``package.module:callable``, and a node that resolves one imports that module and calls it with
its own settings. A run config is what anyone who may submit a run sends, so on a node a
reference resolves only when the node allows it, checked here before anything is imported:

- the node's own settings list it: node config ``allow-code`` (or the environment variable
  ``FLATFLOWER_ALLOW_CODE``, for launchers that cannot set a node config, such as Flower's
  simulation engine), comma-separated entries, each a module (``mymods``: it and its
  submodules, any callable), a reference (``mymods.nets:resnet``: exactly that one) or ``*``
  (anything: one person's own machine);
- or the module lies in the code the node already runs: a Flower App the node installed (a FAB
  under Flower's ``apps`` folder, which the node verified as its ``--trusted-entities`` say).

Anything else is refused in one line naming the key, the reference and how to allow it, and the
handshake's refusal tells the server why. Built-in names are no references and need no allowance.
flatflower's own engines allow what the user's command names on the nodes they start themselves:
the in-process grid ``*``, ``flatflower local`` and the Ray engine the modules of the run's
references (runtime/engines/__init__.py ``hand_user_code``).
"""

from __future__ import annotations

import importlib.machinery
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flatflower.common.references import BadReference, is_reference

ALLOW_KEY = "allow-code"  # node config key
ALLOW_ENV = "FLATFLOWER_ALLOW_CODE"
NOT_CODE = ("run-dir", "client-state-dir", "data-dir", "partition")  # paths, and fds:<Partitioner> names


def allowances(node_config: Mapping[str, Any]) -> list[str]:
    """The node's allow-list: its node config's entries, then the environment's."""
    entries = [str(node_config.get(ALLOW_KEY, "")), os.environ.get(ALLOW_ENV, "")]
    return [e.strip() for text in entries for e in text.split(",") if e.strip()]


def references(run_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The run config's (key, reference) pairs that name code."""
    return [(k, v) for k, v in run_config.items() if k not in NOT_CODE and isinstance(v, str) and is_reference(v)]


def listed(text: str, allowed: Sequence[str]) -> bool:
    """Whether ``text`` (module:callable) is covered by one of the ``allowed`` entries."""
    module = text.split(":", 1)[0]
    return any(entry == "*" or entry == text
               or (":" not in entry and (module == entry or module.startswith(entry + ".")))
               for entry in allowed)


def flower_apps_dir() -> Path:
    """Where Flower installs the FABs a node accepted: ``$FLWR_HOME/apps`` (default ~/.flwr)."""
    home = os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")
    return Path(home).expanduser().resolve() / "apps"


def in_installed_app(text: str) -> bool:
    """Whether the module of ``text`` would be imported from a Flower App the node installed,
    found without importing anything (the top-level package's location on ``sys.path``)."""
    top = text.split(":", 1)[0].split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top)
    origin = (spec.origin if spec and spec.origin not in (None, "namespace")
              else next(iter(spec.submodule_search_locations or []), None) if spec else None)
    if not origin:
        return False
    try:
        return Path(origin).resolve().is_relative_to(flower_apps_dir())
    except OSError:
        return False


def refusal(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> str | None:
    """Why this node will not run the run config's code (one line), or None."""
    allowed = allowances(node_config)
    for key, text in references(run_config):
        if listed(text, allowed) or in_installed_app(text):
            continue
        module = text.split(":", 1)[0]
        return (f"this node does not run {key}={text!r}: module {module!r} is not in its allow-list (node "
                f"config {ALLOW_KEY}, or {ALLOW_ENV}) nor in a Flower App it installed; its operator allows it "
                f"with --node-config \"{ALLOW_KEY}='{module}'\" (docs/deployment.md, \"What a node runs\")")
    return None


def check(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> None:
    """BadReference (one line) when the node does not allow the run config's code."""
    why = refusal(run_config, node_config)
    if why is not None:
        raise BadReference(why)
