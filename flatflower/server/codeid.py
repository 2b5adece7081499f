"""The code a run ran, recorded in its run directory (config.json's ``code``), and the resume's
check that it still runs that code (issue 58, item 4).

Recorded when a run starts and at each resume: the sha256 of each referenced user module's
source (the run config's ``algorithm``, ``model``, ``dataset`` and ``train-transform`` when
they are ``package.module:callable``: the module's file, or, for a package, every ``.py`` file
under its folder) as this process finds it, and of the installed flatflower (every ``.py`` file
of the package, read once per process, with its version). config.json is sealed with the
manifest (server/manifest.py), so the record cannot be rewritten to match other code.

A resume whose code differs is refused in one line naming each module that changed
(:class:`CodeChanged`), unless the user accepts it (``--allow-code-change``; the ServerApp's
form: ``FLATFLOWER_ALLOW_CODE_CHANGE=<run dir>``); it then goes on, and config.json records the
change under ``resume_notes`` (the round it resumed at, and what changed).

What it covers: the code the server process imports from this machine's files, which in a
simulation (in-process, vectorised, Ray on one machine, ``flatflower local``) is the clients'
code too. What not: code a module imports from elsewhere (another package, a data file it
reads), a module changed in a process that already imported it (Python keeps the old one: the
file is hashed), and in a deployment the nodes' own copies (each node runs what it has;
docs/deployment.md).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flatflower.common.references import is_reference
from flatflower.server.rundir import RunDirError, _version

KEYS = ("algorithm", "model", "dataset", "train-transform")  # run-config keys that may name user code
FLAG = "--allow-code-change"
ENV = "FLATFLOWER_ALLOW_CODE_CHANGE"  # the ServerApp's form of FLAG: the run directory's path
_CHUNK = 1 << 20


class CodeChanged(RunDirError):
    """A resume would run other code than the run ran (one line naming the modules)."""


def _file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()


def tree_digest(files: list[Path], root: Path) -> str:
    """sha256 over the files' paths (relative to ``root``) and contents, in path order."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + _file_sha256(path))
    return h.hexdigest()


def python_files(folder: Path) -> list[Path]:
    """The ``.py`` files under ``folder`` (links and ``__pycache__`` left out)."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not os.path.islink(os.path.join(root, d))]
        out += [Path(root) / f for f in files if f.endswith(".py") and os.path.isfile(os.path.join(root, f))
                and not os.path.islink(os.path.join(root, f))]
    return out


@functools.cache
def flatflower_identity() -> dict[str, Any]:
    """The installed flatflower: its version, and the sha256 of its package's ``.py`` files
    (read once per process: the code it imported)."""
    root = Path(__file__).resolve().parents[1]
    files = python_files(root)
    return {"version": _version("flatflower"), "sha256": tree_digest(files, root), "files": len(files)}


def module_identity(name: str) -> dict[str, Any]:
    """The source of module ``name`` as this process finds it: its file (a package: the
    ``.py`` files under its folder) and their sha256 (None when it is not found here, or is
    not a file: a built-in)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        spec = None
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not os.path.isfile(origin):
        return {"file": None, "files": 0, "sha256": None}
    origin_path = Path(origin).resolve()
    if spec.submodule_search_locations:  # a package: everything under its folder
        folder = origin_path.parent
        files = python_files(folder)
        return {"file": str(folder), "files": len(files), "sha256": tree_digest(files, folder)}
    return {"file": str(origin_path), "files": 1, "sha256": _file_sha256(origin_path).hex()}


def identity(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``code``: flatflower's identity and each referenced module's, by module
    name, with the keys that reference it."""
    modules: dict[str, dict[str, Any]] = {}
    for key in KEYS:
        text = run_config.get(key)
        if is_reference(text):
            name = str(text).split(":", 1)[0]
            entry = modules.get(name)
            if entry is None:
                entry = modules[name] = {"references": {}, **module_identity(name)}
            entry["references"][key] = text
    return {"flatflower": flatflower_identity(), "modules": modules}


def _short(digest: Any) -> str:
    return str(digest)[:12] if isinstance(digest, str) else "not found"


def changes(recorded: Any, current: Mapping[str, Any]) -> list[str]:
    """What differs between config.json's recorded ``code`` and ``current`` (:func:`identity`),
    one phrase per module; [] when nothing did, or nothing was recorded (an older run)."""
    if not isinstance(recorded, dict):
        return []
    out = []
    modules = recorded.get("modules")
    was: dict[str, Any] = modules if isinstance(modules, dict) else {}
    for name, now in current["modules"].items():
        before = was.get(name)
        if isinstance(before, dict) and before.get("sha256") != now["sha256"]:
            keys = ", ".join(f"{k} = {v!r}" for k, v in now["references"].items())
            out.append(f"module {name} ({keys}; {now['file'] or 'not found here'}): sha256 "
                       f"{_short(before.get('sha256'))} -> {_short(now['sha256'])}")
    before = recorded.get("flatflower")
    now = current["flatflower"]
    if isinstance(before, dict) and before.get("sha256") != now["sha256"]:
        out.append(f"flatflower {before.get('version', '?')} (sha256 {_short(before.get('sha256'))}) -> "
                   f"{now['version']} (sha256 {_short(now['sha256'])}, {Path(__file__).resolve().parents[1]})")
    return out


def check(recorded: Any, current: Mapping[str, Any], run_dir: Path, allowed: bool) -> str | None:
    """CodeChanged (one line naming each module) when the code differs from the run's record
    and the user did not allow it; with ``allowed``, the note config.json records (None:
    the same code)."""
    changed = changes(recorded, current)
    if not changed:
        return None
    if not allowed:
        raise CodeChanged(f"cannot resume {run_dir}: its code changed since the run last started: "
                          f"{'; '.join(changed)}; resume with {FLAG} to go on with the new code (the "
                          f"ServerApp: {ENV}={run_dir}), which config.json then records")
    return f"resumed with changed code ({FLAG}): {'; '.join(changed)}"
