"""The record key: a secret of this user's, kept outside every run directory, under which a run
directory's manifest.json is sealed (an HMAC-SHA256), so that a file a resume or ``flatflower
report`` reads cannot be rewritten together with its manifest entry by anyone who cannot read
the key.

Where it is: ``$FLATFLOWER_RECORD_KEY`` when set (a path: on a shared machine, a container, or
a home directory others can write), else ``$XDG_CONFIG_HOME/flatflower/record.key``, else
``~/.config/flatflower/record.key``. It is created on first use (a run's start): 32 random
bytes from the operating system, written as 64 hex digits to a file of mode 0600, in a
directory created with mode 0700, atomically (a temporary file linked to its name, so two runs
starting at once end up with the same key). A key file that is a link, not a regular file,
owned by another user, readable or writable by others, or not 64 hex digits is refused in one
line (:class:`RecordKeyError`), never used or replaced.

What a seal says: the manifest was written by a flatflower process that could read this key.
What it does not: anyone who can read the key (the user, root, a process running as the user,
whoever can write the user's home directory and so replace the key) can seal anything; and a
seal binds a manifest to the key, not to one run directory or one moment (an earlier sealed
state of the same directory, restored from a backup, is still sealed). docs/run-directory.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "FLATFLOWER_RECORD_KEY"  # the key file's path, when not the default
ALGORITHM = "hmac-sha256"
SEALED, UNSEALED, OTHER_KEY, BROKEN = "sealed", "unsealed", "another key", "broken"


class RecordKeyError(RuntimeError):
    """The record key cannot be read or created (one line naming the file)."""


@dataclass(frozen=True)
class RecordKey:
    path: Path
    secret: bytes

    @property
    def id(self) -> str:
        """What a seal names its key by: a digest of the key, never the key."""
        return hashlib.sha256(b"flatflower record key id\0" + self.secret).hexdigest()[:16]

    def mac(self, data: dict[str, Any]) -> str:
        return hmac.new(self.secret, canonical(data), hashlib.sha256).hexdigest()


def key_path() -> Path:
    """Where this user's record key is (``$FLATFLOWER_RECORD_KEY``, else the XDG config folder)."""
    given = os.environ.get(ENV, "").strip()
    if given:
        return Path(given).expanduser().absolute()
    base = os.environ.get("XDG_CONFIG_HOME", "").strip()
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "flatflower" / "record.key"


def canonical(data: dict[str, Any]) -> bytes:
    """The bytes a seal covers: ``data`` without its seal, as sorted, compact JSON."""
    return json.dumps({k: v for k, v in data.items() if k != "seal"}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode()


_CACHE: dict[tuple, RecordKey] = {}


def load(create: bool = True) -> RecordKey | None:
    """This user's record key, created when missing and ``create`` (None when missing and not
    ``create``); RecordKeyError when it cannot be used."""
    path = key_path()
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            return None
        return _create(path)
    except OSError as err:
        raise RecordKeyError(f"cannot read the record key {path}: {err.strerror or err}") from None
    cached = _CACHE.get((str(path), st.st_ino, st.st_mtime_ns, st.st_size))
    if cached is not None and _safe(path, st) is None:
        return cached
    key = _read(path)
    _CACHE[(str(path), st.st_ino, st.st_mtime_ns, st.st_size)] = key
    return key


def _safe(path: Path, st: os.stat_result) -> str | None:
    """Why the key file at ``path`` must not be used (None: it may)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (a key is a file of its own)"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        return (f"is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}; "
                f"`chmod 600 {path}`)")
    return None


def _read(path: Path) -> RecordKey:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        why = "is a symbolic link (a key is a file of its own)" if err.errno == errno.ELOOP else err.strerror
        raise RecordKeyError(f"the record key {path} {why}: records cannot be sealed or checked") from None
    with os.fdopen(fd, "rb") as f:
        problem = _safe(path, os.fstat(f.fileno()))
        if problem:
            raise RecordKeyError(f"the record key {path} {problem}: it is not used (records cannot be "
                                 f"sealed or checked); fix it, or point {ENV} at another file")
        text = f.read(200)
    try:
        secret = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != 32:
        raise RecordKeyError(f"the record key {path} is not a flatflower record key (64 hex digits): it is "
                             f"not used; move it away (a new one is made) or point {ENV} at another file")
    return RecordKey(path, secret)


def _create(path: Path) -> RecordKey:
    """A new key at ``path`` (mode 0600, its folder 0700 when this creates it), atomically: a
    key another process created meanwhile is the one returned."""
    try:
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.parent, 0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32).hex().encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another process's key won the race: use it
                os.link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    except OSError as err:
        raise RecordKeyError(f"cannot create the record key {path}: {err.strerror or err} (set {ENV} to a "
                             "file in a folder you can write, outside the run directories)") from None
    return _read(path)


def seal(data: dict[str, Any], key: RecordKey) -> dict[str, Any]:
    """``data`` with its seal: the key's id and the HMAC-SHA256 of the rest under the key."""
    body = {k: v for k, v in data.items() if k != "seal"}
    return {**body, "seal": {"algorithm": ALGORITHM, "key_id": key.id, "hmac": key.mac(body)}}


def check(data: dict[str, Any], key: RecordKey | None) -> str:
    """SEALED (under ``key``), UNSEALED (no seal: an older flatflower's, or one removed),
    OTHER_KEY (sealed under a key that is not ``key``, or there is no key here) or BROKEN
    (sealed under ``key``, but the content is not what was sealed, or the seal is damaged)."""
    found = data.get("seal")
    if found is None:
        return UNSEALED
    if not (isinstance(found, dict) and found.get("algorithm") == ALGORITHM
            and isinstance(found.get("key_id"), str) and isinstance(found.get("hmac"), str)):
        return BROKEN
    if key is None or found["key_id"] != key.id:
        return OTHER_KEY
    try:
        mac = key.mac(data)
    except (TypeError, ValueError):
        return BROKEN
    return SEALED if hmac.compare_digest(mac, found["hmac"]) else BROKEN


def sealed_by(data: dict[str, Any]) -> str:
    """The key id a manifest's seal names ("none" when it has none)."""
    found = data.get("seal")
    key_id = found.get("key_id") if isinstance(found, dict) else None
    return key_id[:16] if isinstance(key_id, str) and key_id.isalnum() else "none"


def accepts(env: str, run_dir: str | os.PathLike) -> bool:
    """Whether the environment value ``env`` (run directories, separated by ``os.pathsep``)
    names ``run_dir``: how the command line hands the user's acceptance of a run directory
    (``--trust-run-dir``, ``--allow-code-change``) to the ServerApp, in this process or one it
    starts, for that directory only."""
    target = os.path.realpath(os.path.expanduser(run_dir))
    return any(os.path.realpath(os.path.expanduser(v.strip())) == target
               for v in os.environ.get(env, "").split(os.pathsep) if v.strip())
