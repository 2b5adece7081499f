"""Opening a run directory's files without following a link planted there (server/rundir.py
and server/manifest.py both read and write through it)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class RunWriteError(RuntimeError):
    """Writing into the run directory failed during the run (full disk, read-only...)."""


_OPEN_FLAGS = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
               "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


def open_file(path: str | Path, mode: str = "r", **kwargs: Any) -> IO:
    """``open(path, mode)`` that never follows a symbolic link at ``path``: one planted in a run
    directory would have flatflower read, append to or truncate another file. A link is an
    OSError whose strerror says so."""
    try:
        fd = os.open(path, _OPEN_FLAGS[mode[0]] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EEXIST and os.path.islink(path)):
            raise OSError(errno.ELOOP, "it is a symbolic link, which flatflower never follows "
                                       "in a run directory", str(path)) from None
        raise
    return os.fdopen(fd, mode, **kwargs)


@contextlib.contextmanager
def writing(path: Path, mode: str = "x") -> Iterator[IO]:
    """Yield a new temporary file (``mode`` "x" text, "xb" binary) for ``path``'s new content;
    it replaces ``path`` when the block succeeds. Any failure (ENOSPC, EROFS, a torch writer
    error, a link planted at the temporary name) is one RunWriteError and leaves ``path`` as it
    was. The file is created, never opened through a link; the rename replaces a link at
    ``path`` itself, never its target."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a previous attempt's, or a link: removed, never written through
        with open_file(tmp, mode) as f:
            yield f
        tmp.replace(path)
    except Exception as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[-1][:200]
        raise RunWriteError(f"cannot write {path}: {reason}") from None


def write_json(path: Path, data: Any) -> None:
    with writing(path) as f:
        f.write(json.dumps(data, indent=1))
