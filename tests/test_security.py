"""TLS and SuperNode authentication: certificate generation (fast, no processes) and real
Flower 1.39 processes on 127.0.0.1 with TLS on both SuperLink APIs and node authentication."""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import stat
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from flatflower.runtime.certs import CertError, generate_certs, parse_host, write_node_key
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.federation import (EXIT_SUPERNODE_REFUSED, FederationError, LocalFederation,
                               is_loopback)
from tests.helpers import flower_pids


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return generate_certs(tmp_path_factory.mktemp("certs"), 2,
                          ["fl.example.org", "10.1.2.3", "[2001:db8::7]"], days=30)


# ---------------------------------------------------------------- certificates (fast)
def test_server_certificate_names_and_chain(certs):
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "fl.example.org"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.1.2.3", "2001:db8::7")}
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    ca.verify_directly_issued_by(ca)  # self-signed
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    days = (server.not_valid_after_utc - server.not_valid_before_utc).days
    assert 29 <= days <= 30


def test_keys_load_and_match(certs):
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    server_key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    assert server_key.public_key() == server.public_key()
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), None)
    assert ca_key.public_key() == x509.load_pem_x509_certificate(certs.ca_cert.read_bytes()).public_key()
    assert [p.name for p in certs.node_keys] == ["node-0", "node-1"]
    assert [p.name for p in certs.node_pubs] == ["node-0.pub", "node-1.pub"]
    for private_path, public_path in zip(certs.node_keys, certs.node_pubs):
        text = private_path.read_text()
        assert text.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        private = serialization.load_ssh_private_key(text.encode(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.curve.name == "secp384r1"
        pub_text = public_path.read_text()
        assert re.fullmatch(r"ecdsa-sha2-nistp384 [A-Za-z0-9+/=]+ \S+\n", pub_text)
        assert serialization.load_ssh_public_key(pub_text.encode()) == private.public_key()
    assert certs.node_pubs[0].read_text() != certs.node_pubs[1].read_text()


def test_flower_accepts_the_node_public_key(certs):
    """The exact loader `flwr supernode register` uses."""
    from flwr.cli.supernode.register import try_load_public_key

    assert try_load_public_key(certs.node_pubs[0])


def test_private_keys_are_0600(certs):
    for path in (certs.ca_key, certs.server_key, *certs.node_keys):
        assert _mode(path) == 0o600, path
    for path in (certs.ca_cert, certs.server_cert, *certs.node_pubs):
        assert _mode(path) & 0o077 != 0o077  # readable, not secret


def test_tls_handshake_with_the_generated_files(certs):
    """OpenSSL accepts the chain and the names: localhost and 127.0.0.1 with only ca.crt trusted."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

    names = ["127.0.0.1", "localhost", "not-in-the-cert.example"]
    thread = threading.Thread(target=serve, args=(len(names),), daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    try:
        for name in names:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                if name.startswith("not-in"):
                    with pytest.raises(ssl.SSLCertVerificationError):
                        client_ctx.wrap_socket(raw, server_hostname=name)
                else:
                    with client_ctx.wrap_socket(raw, server_hostname=name) as tls:
                        tls.sendall(b"x")
    finally:
        thread.join(5)
        listener.close()


@pytest.mark.parametrize("host, kind", [
    ("fl.example.org", x509.DNSName), ("10.0.0.5", x509.IPAddress), ("::1", x509.IPAddress),
    ("[fe80::1]", x509.IPAddress), ("node-7", x509.DNSName)])
def test_hosts_are_detected_as_dns_or_ip(host, kind):
    assert isinstance(parse_host(host), kind)


@pytest.mark.parametrize("host, message", [
    ("fl.example.org:9092", "without a port"), ("bad host", "neither"), ("", "neither"),
    ("*", "wildcard names are refused"), ("*.example.org", "wildcard names are refused")])
def test_bad_hosts_are_refused(tmp_path, host, message):
    with pytest.raises(CertError, match=message):
        generate_certs(tmp_path / "c", 1, [host])
    assert not (tmp_path / "c").exists()  # nothing written


def test_cli_refuses_to_overwrite_and_force_replaces(tmp_path, capsys):
    out = tmp_path / "c"
    assert cli(["certs", str(out), "--nodes", "2", "--host", "10.9.8.7"]) == 0
    printed = capsys.readouterr().out
    assert "ca.crt" in printed and "flwr supernode register" in printed
    assert "--auth-supernode-private-key" in printed and "10.9.8.7:9092" in printed
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert len(before) == 8

    assert cli(["certs", str(out), "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--force" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in before} == before  # untouched

    out.joinpath("nodes", "node-1").chmod(0o644)  # --force must not keep a weaker mode
    assert cli(["certs", str(out), "--nodes", "2", "--force"]) == 0
    assert out.joinpath("ca.crt").read_bytes() != before[out / "ca.crt"]
    assert out.joinpath("nodes", "node-1").read_bytes() != before[out / "nodes" / "node-1"]
    assert _mode(out / "nodes" / "node-1") == 0o600


def test_printed_node_command_uses_an_address_reachable_from_other_machines(tmp_path, capsys):
    # As docs/deployment.md runs it: "superlink" (the compose service) first.
    assert cli(["certs", str(tmp_path / "c"), "--nodes", "1", "--host", "superlink",
                "--host", "a.example.org"]) == 0
    printed = capsys.readouterr().out
    assert "--superlink a.example.org:9092" in printed and "superlink:9092" not in printed.replace(
        "a.example.org:9092", "")
    assert "mkdir -p $HOME/flatflower-state" in printed


def test_cli_bad_certs_input_is_one_line(tmp_path, capsys):
    assert cli(["certs", str(tmp_path / "c"), "--nodes", "0"]) == 2
    assert cli(["certs", str(tmp_path / "c"), "--nodes", "1", "--host", "a.b:9092"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --nodes must be in [1, 10000]",
                   "error: --host 'a.b:9092' is neither an IP address nor a DNS name "
                   "(give the host without a port)"]


def test_cli_refuses_absurd_lifetimes_in_one_line_and_writes_nothing(tmp_path, capsys):
    assert cli(["certs", str(tmp_path / "c"), "--nodes", "1", "--days", "3000000"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --days must be in [1, ")
    assert "certificates end by year 9999" in err[0] and not (tmp_path / "c").exists()


def test_certs_never_write_through_a_symlink(tmp_path, capsys):
    """A planted symlink (to a file the attacker wants overwritten) is refused, with --force
    too; so is an output directory that is a symlink."""
    out, victim = tmp_path / "c", tmp_path / "victim"
    victim.write_text("precious")
    assert cli(["certs", str(out), "--nodes", "1"]) == 0
    (out / "ca.crt").unlink()
    (out / "ca.crt").symlink_to(victim)
    assert cli(["certs", str(out), "--nodes", "1", "--force"]) == 2
    assert "is a symbolic link; refusing to write through it" in capsys.readouterr().err
    assert victim.read_text() == "precious"
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert cli(["certs", str(tmp_path / "link"), "--nodes", "1"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()


def test_printed_superlink_command_keeps_the_control_api_on_loopback(tmp_path, capsys):
    assert cli(["certs", str(tmp_path / "c"), "--nodes", "1", "--host", "a.example.org"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "flower-superlink" in x]
    assert "--host 127.0.0.1 " in line and "--fleet-api-address 0.0.0.0:9092" in line
    assert "--host 0.0.0.0" not in line


def test_write_node_key(tmp_path):
    key = write_node_key(tmp_path / "k" / "intruder")
    assert _mode(key) == 0o600 and key.with_name("intruder.pub").is_file()


def test_federation_refuses_non_loopback_without_tls(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(FederationError, match="without TLS"):
            LocalFederation(1, tmp_path, tmp_path / "logs", host=host)
    fed = LocalFederation(1, tmp_path, tmp_path / "logs", host="0.0.0.0", tls=True)  # not started
    assert fed.dial_host == "127.0.0.1"


# ---------------------------------------------------------------- real processes over TLS
# A complete `flatflower local --tls` run (killed, then resumed over TLS) is in
# tests/test_reliability.py::test_killed_server_of_a_tls_deployment_resumes_to_the_uninterrupted_model.


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.slow
def test_unregistered_supernode_is_refused(tmp_path):
    before = flower_pids()
    logs = tmp_path / "logs"
    with LocalFederation(1, tmp_path / "work", logs, tls=True) as fed:
        # plain HTTP is not served
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{fed.http_port}/health", timeout=5)
        # the registered node gets the id it was registered with
        node_log = logs / "supernode-0.log"
        _wait_for(lambda: "SuperNode ID" in node_log.read_text(), 60, "the registered SuperNode")
        assert f"SuperNode ID: {fed.node_ids['node-0']}" in node_log.read_text()
        # a fresh key nobody registered
        intruder = fed.start_supernode("intruder", 0, private_key=write_node_key(tmp_path / "intruder"))
        t0 = time.monotonic()
        intruder.wait(timeout=60)
        print(f"unregistered SuperNode exited after {time.monotonic() - t0:.1f}s")
        assert intruder.returncode != 0  # Flower exits with status 1 for every error
        assert fed.flower_exit_code("intruder") == EXIT_SUPERNODE_REFUSED
        assert "Failed to activate SuperNode" in (logs / "intruder.log").read_text()
        _wait_for(lambda: "No SuperNode found with the given public key"
                  in (logs / "superlink.log").read_text(), 10, "the SuperLink's refusal")
        assert fed.procs[1][1].poll() is None  # the registered node is unaffected
    assert flower_pids() - before == set(), "Flower processes left behind"
