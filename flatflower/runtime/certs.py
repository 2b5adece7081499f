"""Certificates and SuperNode keys for a Flower federation with TLS and node authentication.

``generate_certs(out_dir, nodes, hosts)`` writes, with the ``cryptography`` package only (no
``openssl`` or ``ssh-keygen`` binaries)::

    ca.crt, ca.key              self-signed CA (ECDSA P-384); ca.crt goes to every machine,
                                ca.key to none (keep it offline; only needed to sign again)
    server.pem, server.key      the SuperLink's certificate, signed by the CA, valid for
                                localhost, 127.0.0.1, ::1 and every host given
    nodes/node-<i>              SuperNode i's ECDSA P-384 private key, OpenSSH format
                                (``flower-supernode --auth-supernode-private-key``)
    nodes/node-<i>.pub          its public key, OpenSSH format (``flwr supernode register``)

Private keys are written with mode 0600. Existing files are never overwritten unless
``force=True``.

The SuperLink uses one certificate for both its gRPC Fleet API (SuperNodes) and its HTTPS
Control/Runtime API (``flwr`` CLI, ServerApp, and its own SuperExec, which connects to
127.0.0.1 even when the SuperLink binds 0.0.0.0); hence the loopback names are always in it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
MAX_NODES = 10_000


class CertError(ValueError):
    """Bad input (invalid host, existing files without force): one line for the user."""


@dataclass(frozen=True)
class CertFiles:
    """Paths of everything :func:`generate_certs` wrote (all absolute)."""

    out_dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # private keys, OpenSSH format
    hosts: tuple[str, ...]  # the server certificate's subjectAltNames, in order

    @property
    def node_pubs(self) -> tuple[Path, ...]:
        return tuple(public_key_path(key) for key in self.node_keys)

    def all_paths(self) -> list[Path]:
        return [self.ca_cert, self.ca_key, self.server_cert, self.server_key,
                *[p for key in self.node_keys for p in (key, public_key_path(key))]]


def public_key_path(private_key: Path) -> Path:
    return private_key.with_name(private_key.name + ".pub")


def planned_files(out_dir: Path, nodes: int) -> CertFiles:
    """Where :func:`generate_certs` writes for ``out_dir`` and ``nodes``."""
    out = Path(out_dir).expanduser().resolve()
    return CertFiles(out, out / "ca.crt", out / "ca.key", out / "server.pem", out / "server.key",
                     tuple(out / "nodes" / f"node-{i}" for i in range(nodes)), ())


# ---------------------------------------------------------------------------- names
def parse_host(host: str) -> x509.GeneralName:
    """An IP address (v4/v6, brackets allowed) becomes an IPAddress SAN, anything else a DNSName."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    if "*" in name:
        raise CertError(f"--host {host!r}: wildcard names are refused (a leaked key would then "
                        "serve any host); list each host")
    label_chars = set("abcdefghijklmnopqrstuvwxyz0123456789-.")
    if (not name or len(name) > 253 or not set(name.lower()) <= label_chars
            or any(not label for label in name.rstrip(".").split("."))):
        hint = " (give the host without a port)" if ":" in name else ""
        raise CertError(f"--host {host!r} is neither an IP address nor a DNS name{hint}")
    return x509.DNSName(name.lower())


def subject_alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """localhost, 127.0.0.1, ::1 and ``hosts``, without duplicates."""
    out: list[x509.GeneralName] = []
    for host in (*LOOPBACK_HOSTS, *hosts):
        name = parse_host(host)
        if name not in out:
            out.append(name)
    return out


def _name_str(name: x509.GeneralName) -> str:
    return str(name.value)


# ---------------------------------------------------------------------------- writing
def _write(path: Path, data: bytes, private: bool) -> None:
    """Write ``data`` to a new file (an old one is removed first, never written through: a
    planted symlink cannot redirect it); a private file has mode 0600 from the start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if private else 0o644
    if path.is_symlink() or path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # against a umask that would widen it
        os.write(fd, data)
    finally:
        os.close(fd)


def _refuse_symlinks(files: CertFiles) -> None:
    """CertError if the output directory, its nodes/ folder or any file to write is a symlink."""
    for path in (files.out_dir, files.out_dir / "nodes", *files.all_paths()):
        if path.is_symlink():
            raise CertError(f"{path} is a symbolic link; refusing to write through it")


def max_days(now: dt.datetime | None = None) -> int:
    """The longest validity X.509 (and ``cryptography``) allows: up to 9999-12-31."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return (dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc) - now).days


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_node_key(path: Path, comment: str | None = None) -> Path:
    """A fresh ECDSA P-384 key pair in OpenSSH format: ``path`` (0600) and ``path.pub``."""
    path = Path(path)
    key = _new_key()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    _write(path, private, private=True)
    _write(public_key_path(path), public + f" {comment or path.name}\n".encode(), private=False)
    return path


def generate_certs(out_dir: Path, nodes: int, hosts: Sequence[str] = (), *,
                   days: int = DEFAULT_DAYS, force: bool = False) -> CertFiles:
    """Write a CA, a server certificate for ``hosts`` (+ loopback) and ``nodes`` node key pairs."""
    if not 1 <= nodes <= MAX_NODES:
        raise CertError(f"--nodes must be in [1, {MAX_NODES}]")
    if not 1 <= days <= max_days():
        raise CertError(f"--days must be in [1, {max_days()}] (certificates end by year 9999)")
    sans = subject_alt_names(hosts)  # validates the hosts before anything is written
    if Path(out_dir).expanduser().is_symlink():
        raise CertError(f"{out_dir} is a symbolic link; refusing to write through it")
    files = planned_files(out_dir, nodes)
    _refuse_symlinks(files)
    existing = [p for p in files.all_paths() if p.exists() or p.is_symlink()]
    if existing and not force:
        shown = ", ".join(str(p.relative_to(files.out_dir)) for p in existing[:3])
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        raise CertError(f"{files.out_dir} already holds {shown}{more}; "
                        "use --force to replace them (or choose another directory)")

    now = dt.datetime.now(dt.timezone.utc)
    not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = _new_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flatflower"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "flatflower federation CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = _new_key()
    server_cn = _name_str(sans[len(LOOPBACK_HOSTS)]) if len(sans) > len(LOOPBACK_HOSTS) else "localhost"
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flatflower"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, server_cn)]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    pem = serialization.Encoding.PEM
    _write(files.ca_key, _pem_key(ca_key), private=True)
    _write(files.ca_cert, ca_cert.public_bytes(pem), private=False)
    _write(files.server_key, _pem_key(server_key), private=True)
    _write(files.server_cert, server_cert.public_bytes(pem), private=False)
    for key_path in files.node_keys:
        write_node_key(key_path, comment=f"flatflower-{key_path.name}")
    return CertFiles(files.out_dir, files.ca_cert, files.ca_key, files.server_cert,
                     files.server_key, files.node_keys, tuple(_name_str(n) for n in sans))


DOCKER_SUPERLINK = "superlink"  # docker/compose.yml


def summary(files: CertFiles, fleet_port: int = 9092, http_port: int = 8000) -> str:
    """What was written and the next commands (for ``flatflower certs``)."""
    d = files.out_dir
    extra = [h for h in files.hosts if h not in LOOPBACK_HOSTS]
    # "superlink" is the compose service name, which only containers on A resolve.
    outside = [h for h in extra if h != DOCKER_SUPERLINK] or extra
    addr = outside[0] if outside else "127.0.0.1"
    addr = f"[{addr}]" if ":" in addr else addr
    n = len(files.node_keys)
    lines = [
        f"wrote to {d}:",
        "  ca.crt      CA certificate (copy to every machine)",
        "  ca.key      CA private key, 0600 (keep offline; no Flower process needs it)",
        f"  server.pem  SuperLink certificate for {', '.join(files.hosts)}",
        "  server.key  SuperLink private key, 0600 (stays on the SuperLink machine)",
        f"  nodes/node-0 .. node-{n - 1}      SuperNode private keys, 0600 (node-i goes to node i only)",
        f"  nodes/node-0.pub .. node-{n - 1}.pub  public keys (registered on the SuperLink)",
        "",
        "next, on the SuperLink machine:",
        "  mkdir -p $HOME/flatflower-state   # the SuperLink does not create its database's directory",
        f"  flower-superlink --ssl-ca-certfile {d}/ca.crt --ssl-certfile {d}/server.pem "
        f"--ssl-keyfile {d}/server.key --enable-supernode-auth --isolation subprocess "
        "--disable-runtime-dependency-installation --database $HOME/flatflower-state/superlink.db "
        f"--host 127.0.0.1 --port {http_port} --fleet-api-address 0.0.0.0:{fleet_port}",
        "  # (the Control API, which runs anything submitted to it, stays on 127.0.0.1; only "
        "the Fleet API faces the nodes)",
        "  # $FLWR_HOME/config.toml:",
        "  #   [superlink.my-federation]",
        f"  #   address = \"127.0.0.1:{http_port}\"",
        f"  #   root-certificates = \"{d}/ca.crt\"",
    ]
    lines += [f"  flwr supernode register {d}/nodes/node-{i}.pub my-federation --name node-{i}"
              for i in range(n)]
    lines += ["then on node i (with ca.crt and its own nodes/node-i only):",
              f"  flower-supernode --root-certificates ca.crt --superlink {addr}:{fleet_port} "
              f"--auth-supernode-private-key node-i --port 9094 --isolation process "
              f"--node-config 'partition-id=i num-partitions={n}'",
              "  flatflower-worker --runtime-api-address 127.0.0.1:9094 --insecure   "
              "# its warm ClientApp worker"]
    if not extra:
        lines.append("(this certificate is valid for loopback only; for other machines, "
                     "regenerate with --host <the SuperLink's name or IP>)")
    return "\n".join(lines)
