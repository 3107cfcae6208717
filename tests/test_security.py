"""TLS, mutual TLS and passwords against a Mosquitto configured by the test itself."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.conftest import agent_config


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _cert(
    subject: str, key, issuer_name: x509.Name | None, issuer_key, *, ca: bool, path: Path
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost, a client certificate, and a rogue CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert("test-ca", ca_key, None, ca_key, ca=True, path=d / "ca.pem")
    server_key = _key()
    _cert("localhost", server_key, ca.subject, ca_key, ca=False, path=d / "server.pem")
    client_key = _key()
    _cert("edge-agent", client_key, ca.subject, ca_key, ca=False, path=d / "client.pem")
    rogue_key = _key()
    _cert("rogue-ca", rogue_key, None, rogue_key, ca=True, path=d / "rogue.pem")
    _write_key(server_key, d / "server.key")
    _write_key(client_key, d / "client.key")
    return {
        "ca": d / "ca.pem",
        "server_cert": d / "server.pem",
        "server_key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
        "rogue": d / "rogue.pem",
    }


def _tls_broker(pki: dict[str, Path], *, mutual: bool) -> EmbeddedBroker:
    lines = [
        f"cafile {pki['ca']}",
        f"certfile {pki['server_cert']}",
        f"keyfile {pki['server_key']}",
        f"require_certificate {'true' if mutual else 'false'}",
    ]
    return EmbeddedBroker(extra_config=lines)


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _tls_env(pki: dict[str, Path], ca: Path, client: bool) -> dict[str, str]:
    env = {
        "MQTT__HOST": '"localhost"',
        "MQTT__TLS__ENABLED": "true",
        "MQTT__TLS__CA_FILE": f'"{ca}"',
        "MQTT__RECONNECT_MIN_S": "0.1",
        "MQTT__RECONNECT_MAX_S": "0.3",
    }
    if client:
        env["MQTT__TLS__CERT_FILE"] = f'"{pki["client_cert"]}"'
        env["MQTT__TLS__KEY_FILE"] = f'"{pki["client_key"]}"'
    return env


def _start(tmp_path: Path, broker: EmbeddedBroker, repository: Path, **env: str) -> Agent:
    agent = Agent(agent_config(tmp_path, broker, repository, **env))
    agent.start()
    return agent


def test_tls_with_a_ca_file(pki, repository, tmp_path):
    with _tls_broker(pki, mutual=False) as broker:
        agent = _start(tmp_path, broker, repository, **_tls_env(pki, pki["ca"], client=False))
        try:
            assert agent.wait_ready(10), agent.transport.last_error
        finally:
            agent.stop()


def test_mutual_tls_and_a_wrong_ca_is_an_error_and_a_retry(pki, repository, tmp_path, caplog):
    with _tls_broker(pki, mutual=True) as broker:
        agent = _start(tmp_path, broker, repository, **_tls_env(pki, pki["ca"], client=True))
        try:
            assert agent.wait_ready(10), agent.transport.last_error
        finally:
            agent.stop()
        # A CA that did not sign the broker's certificate: refused, retried, never a crash.
        rogue = _start(tmp_path, broker, repository, **_tls_env(pki, pki["rogue"], client=True))
        try:
            assert _wait(lambda: rogue.transport.last_error is not None)
            assert not rogue.transport.connected.is_set()
            assert "certificate verify failed" in (rogue.transport.last_error or "")
            first = rogue.transport.last_error
            time.sleep(0.5)  # still retrying, still alive
            assert rogue.transport.last_error == first and not rogue.transport.connected.is_set()
        finally:
            rogue.stop()
        # Without a client certificate the broker refuses the handshake.
        anonymous = _start(tmp_path, broker, repository, **_tls_env(pki, pki["ca"], client=False))
        try:
            assert _wait(lambda: anonymous.transport.last_error is not None)
            assert not anonymous.transport.connected.is_set()
        finally:
            anonymous.stop()


def test_password_from_a_file_and_a_wrong_one(repository, tmp_path, make_client):
    passwords = tmp_path / "mosquitto.passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwords), "agent", "s3cret-pw"],
        check=True,
        capture_output=True,
    )
    lines = ["allow_anonymous false", f"password_file {passwords}"]
    with EmbeddedBroker(extra_config=lines) as broker:
        good = tmp_path / "good.txt"
        good.write_text("s3cret-pw\n")
        bad = tmp_path / "bad.txt"
        bad.write_text("wrong\n")
        wrong = _start(
            tmp_path,
            broker,
            repository,
            MQTT__USERNAME='"agent"',
            MQTT__PASSWORD_FILE=f'"{bad}"',
            MQTT__RECONNECT_MIN_S="0.1",
            MQTT__RECONNECT_MAX_S="0.2",
        )
        try:
            assert _wait(lambda: wrong.transport.last_error is not None)
            assert "refused" in (wrong.transport.last_error or "")
            assert not wrong.transport.connected.is_set()
            # The operator fixes the file: the next attempt reads it again and connects.
            bad.write_text("s3cret-pw\n")
            assert _wait(lambda: wrong.transport.connected.is_set()), wrong.transport.last_error
        finally:
            wrong.stop()
        agent = _start(
            tmp_path, broker, repository, MQTT__USERNAME='"agent"', MQTT__PASSWORD_FILE=f'"{good}"'
        )
        try:
            assert agent.wait_ready(10)
            from agent.client import AgentClient

            with AgentClient(
                broker.host,
                broker.port,
                device_id=agent.config.device_id,
                username="agent",
                password="s3cret-pw",
            ) as client:
                reply = client.request(
                    "decoder", {"token": np.array([[1]], dtype=np.int64)}, params={"max_steps": 2}
                )
                assert len(list(reply)) == 2
            # The client commands take the agent's config: its username and password file.
            from tests.test_cli import run_cli

            config = tmp_path / "client.toml"
            config.write_text(
                f'device_id = "{agent.config.device_id}"\n[mqtt]\nhost = "{broker.host}"\n'
                f'port = {broker.port}\nusername = "agent"\npassword_file = "{good}"\n'
            )
            listed = run_cli("models", "-c", str(config), "--json")
            assert listed.returncode == 0, listed.stderr
            assert "decoder" in listed.stdout
        finally:
            agent.stop()


def test_a_tls_file_broken_at_a_reconnect_costs_attempts_not_the_connection_thread(
    pki, repository, tmp_path
):
    """A botched rotation (the CA file overwritten with junk) while the broker restarts:
    each attempt says which file cannot be used and backs off; once the file is mended the
    agent connects again (the io thread died on it and the box stayed offline)."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki["ca"].read_bytes())
    with _tls_broker(pki, mutual=False) as broker:
        agent = _start(tmp_path, broker, repository, **_tls_env(pki, ca, client=False))
        try:
            assert agent.wait_ready(10), agent.transport.last_error
            ca.write_text("not a certificate\n")
            broker.stop()
            broker.start()
            assert _wait(lambda: "mqtt.tls.ca_file" in (agent.transport.last_error or ""))
            time.sleep(0.5)  # attempts go on
            assert agent.transport.thread_problem() is None
            ca.write_bytes(pki["ca"].read_bytes())
            assert _wait(lambda: agent.transport.connected.is_set(), 15)
        finally:
            agent.stop()


def test_check_config_loads_the_tls_and_password_files_as_run_does(pki, tmp_path):
    """`check-config` (systemd's ExecStartPre) fails on what `run` would: a key encrypted
    with a passphrase (no prompt on a service), a key of another certificate, a CA that is
    not PEM, a password file that is not text; one line each (a password file without a
    username, never read, is a warning)."""
    from tests.test_cli import run_cli

    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        _key().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    binary = tmp_path / "password.bin"
    binary.write_bytes(b"\xff\xfe\x00secret")
    (tmp_path / "models").mkdir()
    cases = {
        "encrypted with a passphrase": (pki["client_cert"], encrypted, pki["ca"]),
        "KEY_VALUES_MISMATCH": (pki["client_cert"], pki["server_key"], pki["ca"]),
        "mqtt.tls.ca_file": (pki["client_cert"], pki["client_key"], junk),
    }
    for says, (cert, key, ca) in cases.items():
        config = tmp_path / "agent.toml"
        config.write_text(
            f'[mqtt.tls]\nenabled = true\nca_file = "{ca}"\ncert_file = "{cert}"\n'
            f'key_file = "{key}"\n[models]\nrepository = "{tmp_path / "models"}"\n'
        )
        result = run_cli("check-config", "--config", str(config), "--quiet")
        assert result.returncode == 2 and says in result.stderr, (says, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    models = tmp_path / "models"
    config.write_text(
        f'[mqtt]\nusername = "agent"\npassword_file = "{binary}"\n'
        f'[models]\nrepository = "{models}"\n'
    )
    result = run_cli("check-config", "--config", str(config), "--quiet")
    assert result.returncode == 2 and "not UTF-8" in result.stderr and "secret" not in result.stderr
    # Without a username the file is never read: a warning, and the config runs.
    config.write_text(f'[mqtt]\npassword_file = "{binary}"\n[models]\nrepository = "{models}"\n')
    result = run_cli("check-config", "--config", str(config), "--quiet")
    assert result.returncode == 0 and "warning: " in result.stderr
    assert "without mqtt.username" in result.stderr
