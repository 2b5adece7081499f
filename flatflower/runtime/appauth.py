"""A SuperNode and its ClientApp worker authenticate each other (no other user of the machine
can act as either).

A SuperNode's Runtime API (``--port``, 9094 in the docs) hands a task, with the global model, to
whoever asks for one: by default any local user of the node's machine could take the node's
tasks, read every round's model and answer in the node's name. Both directions are closed here:

* **the worker proves itself to the SuperNode** with Flower's own SuperExec authentication
  (flwr 1.39, ``--superexec-auth-secret-file`` of ``flower-supernode --isolation process``):
  the requests that hand out tasks (``AcquireTask``, ``ClaimTask``, ``PullPendingTasks``) carry
  an HMAC-SHA256 of their body, a timestamp and a one-time nonce under a secret only the node's
  user can read; without it the SuperNode answers "SuperExec authentication failed" and never
  gives out a task token (each token, 256 random bytes, is what every other Runtime API call
  needs). The secret lives in a file of mode 0600 in a directory of mode 0700
  (:func:`create_secret`); the worker refuses one that other users could read
  (:func:`read_secret`).
* **the SuperNode proves itself to the worker**: on loopback, where the worker and its SuperNode
  share the machine, the kernel says which user owns the socket that listens on the Runtime API's
  port (``/proc/net/tcp``); the worker takes no task from one owned by another user
  (:func:`check_listener`), so a user who binds the port first (before the SuperNode starts, or
  while it restarts) cannot hand the worker a task, a FAB to install, or collect its replies.
  Across containers or machines the Runtime API's TLS certificate does that (``--root-certificates``).

What this cannot stop: root, and any process of the node's own user (either can read the secret
and the worker's memory); docs/deployment.md ("Who can act as a node") says so.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import sys
from pathlib import Path

SECRET_BYTES = 32  # 256 bits, written as 64 hex characters (Flower reads the file's exact bytes)
# the Runtime API methods that hand out tasks: Flower's SuperExec signs exactly these
# (flwr/supercore/superexec/run_superexec.py, _SUPEREXEC_AUTH_METHODS)
SIGNED_METHODS = frozenset({"/flwr.proto.Runtime/AcquireTask", "/flwr.proto.Runtime/PullPendingTasks",
                            "/flwr.proto.Runtime/ClaimTask"})
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


class AppAuthError(ValueError):
    """A secret file or a Runtime API that cannot be trusted (one line, for the operator)."""


def create_secret(path: str | os.PathLike) -> bool:
    """Write a new random secret to ``path`` (mode 0600; a missing directory is made 0700).
    An existing private secret is kept (False), so a recipe can run this on every start."""
    path = Path(path).expanduser()
    if path.exists():
        read_secret(path)  # one that others can read is refused, not silently kept
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(SECRET_BYTES))
    return True


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret's exact bytes (as Flower's SuperNode reads them), refused in one line if the
    file is missing, empty, not this user's, or readable or writable by anyone else."""
    path = Path(path).expanduser()
    try:
        info = path.stat()
        data = path.read_bytes()
    except OSError as err:
        raise AppAuthError(f"cannot read the SuperExec auth secret {path}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AppAuthError(f"the SuperExec auth secret {path} is not a regular file")
    if info.st_mode & 0o077:
        raise AppAuthError(f"the SuperExec auth secret {path} has mode {stat.S_IMODE(info.st_mode):04o}: "
                           "other users can read it; chmod 600 it (and make a new secret)")
    if info.st_uid != os.geteuid():
        raise AppAuthError(f"the SuperExec auth secret {path} belongs to uid {info.st_uid}, "
                           f"not to this user (uid {os.geteuid()})")
    if not data.strip():
        raise AppAuthError(f"the SuperExec auth secret {path} is empty")
    return data


def interceptor(secret: bytes):
    """Flower's HTTP interceptor that signs the task-handing requests with ``secret``."""
    from flwr.supercore.interceptors.http import SuperExecAuthHttpInterceptor

    return SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods=SIGNED_METHODS)


def _loopback_target(address: str) -> tuple[ipaddress._BaseAddress, int] | None:
    """(IP, port) of a loopback ``host:port``; None for any other host (not checkable here)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
        return (ip, int(port)) if ip.is_loopback else None
    except ValueError:
        return None


def listener_uids(ip: ipaddress._BaseAddress, port: int) -> set[int]:
    """The users owning a socket that listens on TCP ``ip:port`` (or on a wildcard address, which
    takes that connection too) on this machine (this network namespace), from the kernel's
    socket table."""
    uids: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, uid = fields[1], fields[3], fields[7]
            hexaddr, _, hexport = local.partition(":")
            if state == _LISTEN and int(hexport, 16) == port:
                bound = _proc_ip(hexaddr)
                if bound == ip or bound.is_unspecified:
                    uids.add(int(uid))
    return uids


def _proc_ip(hexaddr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hexaddr)
    # /proc/net/tcp{,6} prints each 32-bit word of the address in host byte order
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def check_listener(address: str) -> None:
    """Refuse (:class:`AppAuthError`) a loopback Runtime API unless the sockets listening on it
    are all this user's (none listening is refused too: a task is never taken from an address
    nobody of ours serves). A non-loopback address cannot be checked here: its TLS certificate
    or a private network is what authenticates it."""
    target = _loopback_target(address)
    if target is None:
        return
    uids = listener_uids(*target)
    if not uids:
        raise AppAuthError(f"nothing listens on the Runtime API at {address} any more")
    others = uids - {os.geteuid()}
    if others:
        raise AppAuthError(f"the Runtime API at {address} is served by uid "
                           f"{', '.join(map(str, sorted(others)))}, not by this worker's user "
                           f"(uid {os.geteuid()}): refusing to take tasks from it")
