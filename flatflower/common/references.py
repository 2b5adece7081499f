"""References to a user's own code in the run config: ``package.module:callable``.

``model``, ``dataset`` and ``train-transform`` accept, besides their built-in names, a reference
to a callable in the user's own module (``mypkg.models:resnet18``; the part after the colon may
be a dotted attribute path, ``mymodule:Zoo.small``). A reference is a text, so it crosses
processes: the ServerApp and every ClientApp resolve it themselves, on their own machine.

Where the module is looked for: ``sys.path`` as the process has it, and then the current
directory (as ``python -m`` and ``uvicorn app:main`` do; appended, so a user's folder never
shadows an installed package). The engines that start processes of their own (``flatflower
local``, Ray) hand each of them the directory the module was found in (:func:`module_roots`); in
a real deployment the module must be installed (or on ``PYTHONPATH``) on every machine.

Every failure is a :class:`BadReference` whose message is one line naming the key, the
reference and what is wrong: a text that is not a reference, a module that is not found, a
module whose import raised, a missing attribute, an attribute that is not callable.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable
from typing import Any

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
REFERENCE = re.compile(rf"^{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*$")


class BadReference(ValueError):
    """A ``module:callable`` reference that cannot be used (one line, naming the key)."""


def is_reference(text: object) -> bool:
    """Whether ``text`` has the form ``package.module:callable``."""
    return isinstance(text, str) and REFERENCE.match(text) is not None


def _import(module: str, key: str, text: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and not module.startswith(err.name) and err.name != module:
            raise BadReference(f"{key}={text!r}: importing {module} failed: No module named {err.name!r} "
                               "(a package that module needs is not installed here)") from None
        raise  # the module itself (or a parent package) is not on this path
    except BadReference:
        raise
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's module may raise anything on import
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise BadReference(f"{key}={text!r}: importing {module} raised {type(err).__name__}"
                           f"{': ' + first if first else ''}") from None


def load_module(module: str, key: str, text: str):
    """Import ``module``: from ``sys.path``, else from the current directory (appended)."""
    try:
        return _import(module, key, text)
    except ModuleNotFoundError:
        pass
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
        try:
            return _import(module, key, text)
        except ModuleNotFoundError:
            pass
    raise BadReference(f"{key}={text!r}: module {module!r} is not found on this machine (not installed, "
                       f"not on PYTHONPATH, not under {cwd}); install it, or run from the folder that "
                       "holds it") from None


def resolve(text: str, key: str) -> Callable[..., Any]:
    """The callable ``text`` (``package.module:callable``) names, or :class:`BadReference`."""
    if not is_reference(text):
        raise BadReference(f"{key}={text!r} is not a reference of the form package.module:callable")
    module_name, attr_path = text.split(":", 1)
    obj: Any = load_module(module_name, key, text)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise BadReference(f"{key}={text!r}: {getattr(obj, '__name__', module_name)} has no "
                               f"attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BadReference(f"{key}={text!r}: {attr_path} is a {type(obj).__name__}, not a callable")
    return obj


def call(fn: Callable[..., Any], args: tuple, key: str, text: str) -> Any:
    """``fn(*args)`` if it takes that many positional arguments, else ``fn()`` (the contract
    lets a user's callable take its arguments or none); any exception it raises becomes a
    :class:`BadReference` naming the key."""
    try:
        takes = _takes(fn, len(args))
    except (TypeError, ValueError):  # a builtin without a signature: try with the arguments
        takes = True
    try:
        return fn(*args) if takes else fn()
    except BadReference:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code may raise anything
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise BadReference(f"{key}={text!r}: calling it raised {type(err).__name__}"
                           f"{': ' + first if first else ''}") from None


def _takes(fn: Callable[..., Any], n: int) -> bool:
    """Whether ``fn`` accepts ``n`` positional arguments (else it must accept none)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) <= n <= len(positional):
        return True
    if not required:
        return False
    raise TypeError(f"takes {len(required)} required argument(s), the contract passes {n} or none")


def module_roots(texts: Iterable[str]) -> list[str]:
    """The directories the modules of ``texts`` (those that are references) were imported
    from, when they are not installed packages: what a process this one starts (a SuperNode,
    a Ray worker) needs on its ``PYTHONPATH`` to resolve the same references."""
    installed = {os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    roots: list[str] = []
    for text in texts:
        if not is_reference(text):
            continue
        top = text.split(":", 1)[0].split(".")[0]
        module = sys.modules.get(top)
        path = getattr(module, "__file__", None) if module is not None else None
        if not path:
            continue
        root = os.path.dirname(os.path.abspath(path))
        if os.path.basename(path) == "__init__.py":
            root = os.path.dirname(root)
        if os.path.realpath(root) not in installed and root not in roots:
            roots.append(root)
    return roots


def with_pythonpath(env: dict[str, str], roots: Iterable[str]) -> dict[str, str]:
    """``env`` with ``roots`` appended to its ``PYTHONPATH``."""
    roots = [r for r in roots if r]
    if not roots:
        return env
    current = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(current + [r for r in roots if r not in current])}
