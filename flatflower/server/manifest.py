"""manifest.json: the digest (sha256 and size) of every file a resume reads, recorded when it
is written, verified before a resume starts.

A resume trusts what it reads: the checkpoint (server state), the clients' state files, the
privacy ledger, config.json and partition.json, vectorized.json (how the vectorised engine
batched), and the rows of metrics.jsonl and clients.jsonl it keeps. Each is checked for what
it *means* where that can be checked (server/rundir.py, server/setup.py), but a value changed
to another plausible one (a checkpoint's scalar to 1e30, client 3's state copied over client
5's, a ledger row edited) means something, and only a record of what was written can tell it
from the real thing. So:

* whole files (``files``): checkpoint.pt and the clients' state files its accepted rounds
  name (the generation of the latest checkpoint), config.json, partition.json,
  vectorized.json: path (relative to the run directory, which can be moved or copied) ->
  sha256 and size of the bytes written;
* append-only logs (``prefixes``): privacy.jsonl, metrics.jsonl, clients.jsonl: the size
  and sha256 of the file as it was when the latest checkpoint was written; a resume verifies
  that prefix (rows appended after it belong to rounds it redoes).

Crash-safe without a second checkpoint: a file is replaced in three steps, (1) the manifest
accepts the old and the new version, (2) the file is replaced atomically, (3) the manifest
accepts the new one only; a crash between any two leaves a manifest that accepts what is on
disk. A resume verifies only what it reads (the client-state files of the checkpoint found
on disk), so a generation's files pruned by the clients never matter.

Sealed (issue 58): every write of the manifest carries an HMAC-SHA256 of its content under the
user's record key (server/recordkey.py), a secret kept outside the run directory, so a file
rewritten *together with* its manifest entry (sha256 is no secret) is refused: the seal no
longer matches. A resume goes on only from a manifest sealed by this user's key; one that is
not sealed (an older flatflower's), sealed by another key (a directory copied from another
machine or user) or missing altogether is refused in one line, unless the user accepts the
directory as it is (``--trust-run-dir``: its files are still checked against the digests,
and the resume seals them under the user's key). A seal that names this user's key but does
not match is refused always. ``flatflower report`` checks the same (tools/report.py).

What it is not: protection against whoever can read the key (the user, root, a process of the
user's, anyone who can replace files in the user's home), nor against an older sealed state
of the same directory restored as a whole (a rollback): the seal binds the manifest to the
key, not to a moment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from flatflower.server import recordkey
from flatflower.server.files import RunWriteError, open_file, write_json

MANIFEST = "manifest.json"
FORMAT = 1
WHOLE = ("config.json", "partition.json", "vectorized.json")  # recorded as written, besides the checkpoint's
LOGS = ("metrics.jsonl", "clients.jsonl", "privacy.jsonl")  # append-only: their prefix is recorded
_LOCK = threading.Lock()  # the server and the vectorised engine's thread write the manifest
_CHUNK = 1 << 20


class ManifestError(RuntimeError):
    """A file a resume reads is not what the run wrote (one line naming it)."""


def digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_digest(path: Path, size: int | None = None) -> dict[str, Any]:
    """sha256 and size of ``path``'s first ``size`` bytes (all of it when None), never
    through a link."""
    h, n = hashlib.sha256(), 0
    with open_file(path, "rb") as f:
        while size is None or n < size:
            chunk = f.read(_CHUNK if size is None else min(_CHUNK, size - n))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return {"size": n, "sha256": h.hexdigest()}


class Manifest:
    """The manifest of one run directory, as its writer keeps it (one process at a time holds
    the run directory: server/rundir.py's lock). Appended logs are hashed incrementally: each
    checkpoint reads only the bytes appended since the last one."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / MANIFEST
        self._logs: dict[str, tuple[int, Any]] = {}  # log -> (bytes hashed, its sha256 object)

    # ------------------------------------------------------------------ reading and writing it
    def read(self) -> dict[str, Any] | None:
        """The manifest (None when the run directory has none); ManifestError when damaged."""
        return read(self.run_dir)

    def _write(self, data: Mapping[str, Any]) -> None:
        """The manifest, sealed under the user's record key (server/recordkey.py)."""
        try:
            key = recordkey.load(create=True)
        except recordkey.RecordKeyError as err:
            raise RunWriteError(f"cannot seal {self.path}: {err}") from None
        assert key is not None  # create=True: made when missing
        body = {"format": FORMAT, "what": "sha256 and size of the files a resume reads, sealed under the "
                "user's record key (docs/run-directory.md)", **{k: v for k, v in data.items() if k != "seal"}}
        write_json(self.path, recordkey.seal(body, key))

    @contextlib.contextmanager
    def replacing(self, rel: str, new: Mapping[str, Any], key: str = "files") -> Iterator[None]:
        """Replace the file ``rel`` (the block writes it, atomically): the manifest accepts its
        old and its new version while the block runs, the new one after. Nothing is recorded
        in a run directory without a manifest (a fresh run's first is the first checkpoint's;
        an older flatflower's run directory gets one at its first checkpoint). ``key``:
        "prefixes" for a log rewritten whole (a resume drops the rows past its checkpoint)."""
        with _LOCK:
            current = self._read_for_update()
            if current is None:
                yield
                return
            current[key][rel] = _versions([new], current[key].get(rel, []))
            self._write(current)
            yield
            current[key][rel] = [dict(new)]
            self._write(current)

    def _read_for_update(self) -> dict[str, Any] | None:
        try:
            return self.read()
        except ManifestError:
            return None  # a damaged manifest is rewritten at the next checkpoint; a resume refuses it

    # ------------------------------------------------------------------ the checkpoint's generation
    def log_digest(self, name: str) -> dict[str, Any] | None:
        """sha256 and size of the log ``name`` as it is now (None when it does not exist),
        reading only what was appended since the last call."""
        path = self.run_dir / name
        if not path.is_file():
            self._logs.pop(name, None)
            return None
        size = path.stat().st_size
        done, h = self._logs.get(name, (0, None))
        if h is None or size < done:
            done, h = 0, hashlib.sha256()
        with open_file(path, "rb") as f:
            f.seek(done)
            while done < size:
                chunk = f.read(min(_CHUNK, size - done))
                if not chunk:
                    break
                h.update(chunk)
                done += len(chunk)
        self._logs[name] = (done, h)
        return {"size": done, "sha256": h.copy().hexdigest()}

    def forget_log(self, name: str) -> None:
        """``name`` was rewritten (a resume truncated it): hash it anew."""
        self._logs.pop(name, None)

    @contextlib.contextmanager
    def checkpoint(self, round_: int, checkpoint: bytes, client_files: Iterable[Path]) -> Iterator[None]:
        """Write the checkpoint (the block) with its generation: its own digest, the clients'
        state files its accepted rounds name, the logs' prefixes, the other files read back."""
        files = {"checkpoint.pt": digest(checkpoint)}
        for path in client_files:
            if path.is_file() and not self.rel(path).startswith("../"):  # inside the run directory only
                files[self.rel(path)] = file_digest(path)
        prefixes = {name: d for name in LOGS if (d := self.log_digest(name)) is not None}
        with _LOCK:  # vectorized.json may be replaced meanwhile (by the engine's thread, under the lock)
            for name in WHOLE:
                if (self.run_dir / name).is_file():
                    files[name] = file_digest(self.run_dir / name)
            old = self._read_for_update() or {"files": {}, "prefixes": {}}
            pending = {"round": round_, "files": {}, "prefixes": {}}
            for key, new in (("files", files), ("prefixes", prefixes)):
                for rel in {*new, *old[key]}:
                    pending[key][rel] = _versions([new[rel]] if rel in new else [], old[key].get(rel, []))
            self._write(pending)
            yield
            self._write({"round": round_, "files": {k: [v] for k, v in files.items()},
                         "prefixes": {k: [v] for k, v in prefixes.items()}})

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.run_dir)).as_posix()


def _versions(new: list, old: list) -> list:
    out = [dict(v) for v in new]
    out += [dict(v) for v in old if v not in out]
    return out


# ---------------------------------------------------------------------------- verifying
def read(run_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``run_dir`` (None: it has none); ManifestError when it is not one."""
    path = run_dir / MANIFEST
    try:
        with open_file(path) as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:
        raise ManifestError(f"{path} is unreadable or damaged ({str(err)[:120]}): the run's files cannot "
                            "be checked (restore it, or remove it to resume without the check)") from None
    try:
        _check_shape(data)
    except ValueError as err:
        raise ManifestError(f"{path} is damaged ({err}): the run's files cannot be checked (restore it, "
                            "or remove it to resume without the check)") from None
    return data


def _check_shape(data: Any) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a flatflower manifest (format {FORMAT})")
    for key in ("files", "prefixes"):
        table = data.get(key)
        if not isinstance(table, dict):
            raise ValueError(f"{key} is not a table")  # noqa: TRY004
        for rel, versions in table.items():
            if not (isinstance(versions, list) and versions and all(
                    isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
                    and isinstance(v.get("sha256"), str) and len(v["sha256"]) == 64 for v in versions)):
                raise ValueError(f"{key}.{str(rel)[:80]} is not a list of sizes and digests")
            if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts:
                raise ValueError(f"{str(rel)[:80]!r} is not a path inside the run directory")


TRUST_FLAG = "--trust-run-dir"
TRUST_ENV = "FLATFLOWER_TRUST_RUN_DIR"  # the ServerApp's form of --trust-run-dir: the run directory's path


def seal_status(run_dir: Path, data: Mapping[str, Any] | None, key: recordkey.RecordKey | None) -> str:
    """recordkey's SEALED, UNSEALED, OTHER_KEY or BROKEN for the manifest ``data`` (None: there
    is none, which is UNSEALED)."""
    return recordkey.UNSEALED if data is None else recordkey.check(dict(data), key)


def seal_problem(run_dir: Path, data: Mapping[str, Any] | None, status: str,
                 key: recordkey.RecordKey | None, what: str = "the resume") -> str | None:
    """One line saying why ``run_dir``'s records cannot be believed as this user's (None when
    the manifest is sealed by this user's key)."""
    path = run_dir / MANIFEST
    keyfile = recordkey.key_path()
    if status == recordkey.SEALED:
        return None
    if status == recordkey.BROKEN:
        return (f"{path} does not match its seal (HMAC-SHA256 under your record key {keyfile}): it, and "
                f"files it vouches for, were rewritten after the run wrote them; {what} refuses the run "
                "directory (restore it from a copy you trust)")
    if data is None:
        why = (f"{run_dir} has no {MANIFEST} (a flatflower before run files were recorded, checkpoint-every = 0, "
               "or removed)")
    elif status == recordkey.OTHER_KEY:
        mine = f"yours ({keyfile}) is {key.id}" if key is not None else f"you have none yet ({keyfile})"
        why = (f"{path} is sealed by another record key ({recordkey.sealed_by(dict(data))}; {mine}: a run "
               f"directory copied from another machine or user, or {recordkey.ENV} set otherwise)")
    else:
        why = f"{path} is not sealed (a flatflower before records were keyed, or its seal was removed)"
    return f"{why}: its files cannot be told from a forger's"


def verify(run_dir: Path, client_files: Iterable[Path], trusted: bool = False) -> int | None:
    """ManifestError naming the first file a resume reads that is not as its manifest
    records it (changed, truncated, missing, not recorded), or a manifest that is not sealed
    by this user's record key (refused unless ``trusted``: the user accepts the directory as
    it is; a seal of this user's key that does not match is refused always); the round of the
    checkpoint the manifest vouches for, or None when ``run_dir`` has no manifest (with
    ``trusted`` only).

    ``client_files``: the clients' state files the checkpoint on disk needs (the others the
    manifest lists belong to the other generation of a checkpoint write cut short)."""
    data = read(run_dir)
    try:
        key = recordkey.load(create=False)
    except recordkey.RecordKeyError as err:
        raise ManifestError(str(err)) from None
    status = seal_status(run_dir, data, key)
    problem = seal_problem(run_dir, data, status, key)
    if problem is not None and (status == recordkey.BROKEN or not trusted):
        if status != recordkey.BROKEN:
            problem += (f"; resume with {TRUST_FLAG} to accept them as they are (the ServerApp: "
                        f"{TRUST_ENV}={run_dir}), and the resume seals them under your key")
        raise ManifestError(problem)
    if data is None:
        return None
    files, prefixes = data["files"], data["prefixes"]
    if "checkpoint.pt" not in files:
        raise ManifestError(f"{run_dir / MANIFEST} records no checkpoint.pt: it is not this run's "
                            "(restore it, or remove it to resume without the check)")
    needed = {Path(os.path.relpath(p, run_dir)).as_posix() for p in client_files}
    for rel in [*(r for r in files if r in ("checkpoint.pt", *WHOLE)), *sorted(needed)]:
        path = run_dir / rel
        if rel not in files:
            if path.is_file():
                raise ManifestError(f"{path} is not in {MANIFEST}: it was not there when the checkpoint was "
                                    "written (restored from elsewhere, or another client's?); the resume "
                                    "refuses it")
            continue  # a missing client state file: the client-state check names it
        _match(path, files[rel], whole=True)
    for rel, versions in prefixes.items():
        _match(run_dir / rel, versions, whole=False)
    return data.get("round") if type(data.get("round")) is int else None


def check_files(run_dir: Path, data: Mapping[str, Any], names: Iterable[str]) -> dict[str, str | None]:
    """For each of ``names`` (files or logs the manifest records): None when it is as the run
    wrote it, else the one line saying how it is not (the analysis commands' check: they read
    these, never a checkpoint)."""
    out: dict[str, str | None] = {}
    for name in names:
        for key, whole in (("files", True), ("prefixes", False)):
            if name in data[key]:
                try:
                    _match(run_dir / name, data[key][name], whole)
                    out[name] = None
                except ManifestError as err:
                    out[name] = str(err).split("; the resume refuses it")[0].split("; restore it to resume")[0]
    return out


def _match(path: Path, versions: list[dict[str, Any]], whole: bool) -> None:
    """ManifestError unless ``path`` (whole, or its first bytes) is one of ``versions``."""
    what = "" if whole else " (its rows up to the checkpoint)"
    if not path.is_file():
        raise ManifestError(f"{path} is missing: the run wrote it and the resume reads it{what}; "
                            "restore it to resume")
    size = path.stat().st_size
    for v in versions:
        if (size == v["size"] if whole else size >= v["size"]) and file_digest(path, v["size"]) == v:
            return
    expected = versions[0]["size"]
    if size < expected:
        how = f"shorter than the run wrote it ({size} of {expected} bytes: truncated or changed)"
    elif whole and size != expected:
        how = f"changed since the run wrote it ({size} bytes, {expected} were written)"
    else:
        how = f"changed since the run wrote it (its sha256 differs from {MANIFEST}'s)"
    raise ManifestError(f"{path}{what} is {how}; the resume refuses it (restore the file)")
