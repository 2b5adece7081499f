"""``--fast-poll``: shorter waits inside the pinned Flower's SuperNode and ServerApp (opt-in).

Flower 1.39.0 hard-codes how long its processes wait between polls: a SuperNode sleeps 3 s
after an empty pull from the SuperLink and 0.5 s between looks for its ClientApp's reply
(``flwr/supernode/start_client_internal.py`` L276, L483, L519), and object pulls back off from
1 s, doubling to 10 s (``flwr/supercore/constant.py`` L48-49). No option changes them. This
module shortens them, by replacing the waits in those modules of *exactly* flwr 1.39.0 (any
other version is refused: its code may differ) — a patch of Flower's internals, so it is
off by default (in ``flatflower local`` and in docker compose) and only turned on by
``--fast-poll``.

    python -m flatflower.common.fastpoll supernode [flower-supernode arguments]   (a fast SuperNode)

The ServerApp patches itself when ``FLATFLOWER_FAST_POLL=1`` is in its environment (the SuperLink
started by ``flatflower local --fast-poll`` passes it on).
"""

from __future__ import annotations

import os
import sys
import time as _time
from types import SimpleNamespace

PINNED = "1.39.0"
ENV = "FLATFLOWER_FAST_POLL"
WAITS = {3: 0.05, 0.5: 0.02}  # Flower's sleep -> ours
BACKOFF = {"initial_backoff": 0.02, "backoff_cap": 0.5}  # object pulls (Flower: 1 s, 10 s)


class FastPollError(RuntimeError):
    """Fast polling is not available (another Flower version)."""


def check_version() -> None:
    from importlib.metadata import version

    installed = version("flwr")
    if installed != PINNED:
        raise FastPollError(f"--fast-poll patches waits inside flwr {PINNED} and is refused with "
                            f"flwr {installed}; run without --fast-poll")


def _fast_time() -> SimpleNamespace:
    """The ``time`` module, except that Flower's fixed waits are shortened."""
    fast = SimpleNamespace(**{k: getattr(_time, k) for k in dir(_time) if not k.startswith("__")})
    fast.sleep = lambda seconds: _time.sleep(WAITS.get(seconds, seconds))
    return fast


def _fast_pulls() -> None:
    from flwr.supercore.inflatable import inflatable_utils

    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__ = {**fn.__kwdefaults__, **BACKOFF}  # both are keyword-only in 1.39.0


def patch_supernode() -> None:
    check_version()
    from flwr.supernode import start_client_internal

    start_client_internal.time = _fast_time()
    _fast_pulls()


def patch_serverapp() -> None:
    """In the ServerApp process: object pulls of replies back off briefly (the grid's own 3 s
    poll is not used: strategies poll through ``exchange``)."""
    check_version()
    _fast_pulls()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "supernode":
        print("usage: python -m flatflower.common.fastpoll supernode [flower-supernode arguments]", file=sys.stderr)
        return 2
    try:
        patch_supernode()
    except FastPollError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *argv[1:]]
    flower_supernode()
    return 0


if __name__ == "__main__":
    os.environ.setdefault(ENV, "1")
    sys.exit(main())
