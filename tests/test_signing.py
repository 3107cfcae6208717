"""Signed model versions (`[models.trust]`): real keys and certificates made here with
`cryptography`, real `model-signing` signatures over real version folders, then tampering."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from agent.cli import main as cli_main
from agent.config import ConfigError, TrustConfig, load_config
from agent.models import loading
from agent.models.backends.base import BackendOptions
from agent.models.manager import ModelManager
from agent.models.records import format_inventory
from agent.models.trust import SIGNATURE_FILE, TrustPolicy, sign_version
from tests.test_hot_swap import direct, mlp_bytes, wait_for

X = np.ones((2, 16), dtype=np.float32)


def make_key(folder: Path, name: str, curve: ec.EllipticCurve | None = None) -> tuple[Path, Path]:
    """An EC private key (PEM, unencrypted) and its public key, as `openssl` would write."""
    key = ec.generate_private_key(curve or ec.SECP256R1())
    private = folder / f"{name}.key.pem"
    public = folder / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def fingerprint(public: Path) -> str:
    key = serialization.load_pem_public_key(public.read_bytes())
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()[:16]


def write_version(root: Path, version: int, seed: int, *extra: str) -> Path:
    folder = root / "mlp" / str(version)
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(mlp_bytes(seed))
    for name in extra:
        (folder / name).write_text(f"{name}\n")
    return folder


def manager_for(root: Path, trust: TrustConfig | None, events: list[dict] | None = None):
    sink = events if events is not None else []
    return ModelManager(
        root,
        BackendOptions(),
        settle_s=0.0,
        on_event=sink.append,
        trust=TrustPolicy(trust) if trust is not None else None,
    )


def sync(manager: ModelManager) -> dict:
    for _ in range(3):
        manager.sync()
    return manager.inventory()["models"]["mlp"]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    keydir = tmp_path / "keys"
    keydir.mkdir()
    return {
        "release": make_key(keydir, "release"),
        "p384": make_key(keydir, "p384", ec.SECP384R1()),
        "stranger": make_key(keydir, "stranger"),
    }


@pytest.fixture
def serving_v1(tmp_path: Path, keys) -> Iterator[tuple[Path, ModelManager, list[dict]]]:
    """v1 signed with the release key and serving, for the tampering tests to add v2 to."""
    root = tmp_path / "models"
    sign_version(write_version(root, 1, 101), keys["release"][0])
    trust = TrustConfig(require_signature=True, public_keys=[keys["release"][1]])
    events: list[dict] = []
    manager = manager_for(root, trust, events)
    assert sync(manager)["serving"] == 1
    yield root, manager, events
    manager.close()


def test_a_signed_version_is_ready_and_shows_who_signed_it(serving_v1, keys):
    _, manager, _ = serving_v1
    entry = manager.inventory()["models"]["mlp"]["versions"]["1"]
    assert entry["state"] == "ready"
    public = keys["release"][1]
    assert entry["signed"] == {"by": f"{public.name} (sha256:{fingerprint(public)})"}
    assert "signed by: release.pub.pem (sha256:" in format_inventory(manager.inventory())
    with manager.lease("mlp") as lease:
        np.testing.assert_allclose(lease.session.run({"x": X})["y"], direct(101, X), rtol=1e-5)


def _flip_a_byte(folder: Path, keys) -> None:
    sign_version(folder, keys["release"][0])
    data = bytearray((folder / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "model.onnx").write_bytes(bytes(data))


def _swap_the_model(folder: Path, keys) -> None:
    sign_version(folder, keys["release"][0])
    (folder / "model.onnx").write_bytes(mlp_bytes(666))  # a valid model, just not the signed one


def _add_a_file(folder: Path, keys) -> None:
    sign_version(folder, keys["release"][0])
    (folder / "extra.bin").write_bytes(b"\x00" * 8)


def _add_a_hidden_file(folder: Path, keys) -> None:
    sign_version(folder, keys["release"][0])
    (folder / ".weights.tmp").write_bytes(b"\x00" * 8)  # external data may name any file


def _remove_a_file(folder: Path, keys) -> None:
    (folder / "labels.txt").write_text("cat\ndog\n")
    sign_version(folder, keys["release"][0])
    (folder / "labels.txt").unlink()


def _wrong_key(folder: Path, keys) -> None:
    sign_version(folder, keys["stranger"][0])


def _signature_of_another_version(folder: Path, keys) -> None:
    shutil.copyfile(folder.parent / "1" / SIGNATURE_FILE, folder / SIGNATURE_FILE)


def _garbage_signature(folder: Path, keys) -> None:
    (folder / SIGNATURE_FILE).write_bytes(b"\x89PNG not a bundle")


def _not_a_bundle(folder: Path, keys) -> None:
    (folder / SIGNATURE_FILE).write_text('{"mediaType": "x"}')


def _forged_signature(folder: Path, keys) -> None:
    sign_version(folder, keys["release"][0])
    bundle = json.loads((folder / SIGNATURE_FILE).read_text())
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(b"0" * 70).decode()
    (folder / SIGNATURE_FILE).write_text(json.dumps(bundle))


def _no_signature(folder: Path, keys) -> None:
    pass


TAMPERING = {
    "changed byte": (_flip_a_byte, "file model.onnx changed since signing"),
    "swapped model": (_swap_the_model, "file model.onnx changed since signing"),
    "added file": (_add_a_file, "file extra.bin added after signing"),
    "added hidden file": (_add_a_hidden_file, "file .weights.tmp added after signing"),
    "removed file": (_remove_a_file, "file labels.txt removed after signing"),
    "wrong key": (_wrong_key, "model.sig is signed by a key not in public_keys"),
    "another version's signature": (
        _signature_of_another_version,
        "file model.onnx changed since signing",
    ),
    "garbage": (_garbage_signature, "model.sig is not a valid signature bundle (not JSON)"),
    "not a bundle": (_not_a_bundle, "model.sig is not a valid signature bundle (no verif"),
    "forged signature": (_forged_signature, "model.sig does not verify with release.pub.pem"),
    "no signature": (_no_signature, "no model.sig (models.trust.require_signature is on)"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampering_fails_the_version_and_the_old_one_keeps_serving(
    serving_v1, keys, monkeypatch, case
):
    root, manager, events = serving_v1
    tamper, reason = TAMPERING[case]
    loaded: list[str] = []
    real_get_backend = loading.get_backend
    monkeypatch.setattr(loading, "get_backend", lambda n: loaded.append(n) or real_get_backend(n))
    tamper(write_version(root, 2, 102), keys)
    model = sync(manager)
    entry = model["versions"]["2"]
    assert entry["state"] == "failed"
    assert entry["error"].startswith(reason), entry["error"]
    assert "\n" not in entry["error"] and "signed" not in entry
    assert loaded == []  # refused before the backend read a byte
    assert model["serving"] == 1
    with manager.lease("mlp") as lease:
        np.testing.assert_allclose(lease.session.run({"x": X})["y"], direct(101, X), rtol=1e-5)
    failed = [e for e in events if e["type"] == "model_load_failed"]
    assert [e["error"] for e in failed] == [entry["error"]]


def test_a_signature_copied_in_afterwards_brings_the_version_back(serving_v1, keys, tmp_path):
    """Copy the model, then its model.sig: the version failed in between is retried once
    the folder changes, not only when the model file does."""
    root, manager, _ = serving_v1
    folder = write_version(root, 2, 102)
    assert sync(manager)["versions"]["2"]["error"].startswith("no model.sig")
    staged = write_version(tmp_path / "build", 2, 102)
    sign_version(staged, keys["release"][0])
    shutil.copyfile(staged / SIGNATURE_FILE, folder / SIGNATURE_FILE)
    assert wait_for(lambda: sync(manager)["serving"] == 2, timeout=5)


def test_any_of_several_keys_and_a_p384_key(tmp_path, keys):
    root = tmp_path / "models"
    sign_version(write_version(root, 1, 101), keys["p384"][0])
    trust = TrustConfig(require_signature=True, public_keys=[keys["release"][1], keys["p384"][1]])
    manager = manager_for(root, trust)
    entry = sync(manager)["versions"]["1"]
    manager.close()
    assert entry["state"] == "ready", entry
    assert entry["signed"]["by"].startswith("p384.pub.pem (sha256:")


def test_without_trust_loading_is_unchanged_and_model_signing_is_not_imported(tmp_path):
    root = tmp_path / "models"
    write_version(root, 1, 101)
    script = textwrap.dedent(
        f"""
        import sys
        from agent.models.backends.base import BackendOptions
        from agent.models.manager import ModelManager
        manager = ModelManager({str(root)!r}, BackendOptions(), settle_s=0.0)
        manager.sync()
        entry = manager.inventory()["models"]["mlp"]["versions"]["1"]
        assert entry["state"] == "ready" and "signed" not in entry, entry
        loaded = [m for m in ("model_signing", "sigstore", "OpenSSL") if m in sys.modules]
        print("loaded:", loaded)
        manager.close()
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert run.returncode == 0, run.stderr
    assert "loaded: []" in run.stdout


# -- certificate mode --------------------------------------------------------------------


def make_certificate(
    folder: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path, Path]:
    """A CA (issuer None) or a signing certificate issued by ``issuer``: PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    is_ca = issuer is None
    builder = builder.add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), True)
    builder = builder.add_extension(
        x509.KeyUsage(
            digital_signature=not is_ca,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=is_ca,
            crl_sign=is_ca,
            encipher_only=False,
            decipher_only=False,
        ),
        True,
    )
    if not is_ca:
        san = x509.SubjectAlternativeName([x509.RFC822Name(f"{name}@example.com")])
        builder = builder.add_extension(san, False)
    certificate = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    cert_path, key_path = folder / f"{name}.crt.pem", folder / f"{name}.key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certificate, key, cert_path, key_path


def test_certificate_mode_offline(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca, ca_key, ca_path, _ = make_certificate(pki, "Release CA", None)
    _, _, signer_cert, signer_key = make_certificate(pki, "release", (ca, ca_key))
    other_ca, other_key, _, _ = make_certificate(pki, "Other CA", None)
    _, _, rogue_cert, rogue_key = make_certificate(pki, "rogue", (other_ca, other_key))
    other_ca_path = pki / "Other CA.crt.pem"
    root = tmp_path / "models"
    sign_version(
        write_version(root, 1, 101),
        signer_key,
        certificate=signer_cert,
        certificate_chain=[ca_path],
    )
    trust = TrustConfig(require_signature=True, certificate_chain=[ca_path])
    manager = manager_for(root, trust)
    model = sync(manager)
    assert model["versions"]["1"]["signed"] == {"by": "release@example.com"}
    sign_version(
        write_version(root, 2, 102),
        rogue_key,
        certificate=rogue_cert,
        certificate_chain=[other_ca_path],
    )
    model = sync(manager)
    manager.close()
    assert model["serving"] == 1
    assert model["versions"]["2"]["error"].startswith(
        "model.sig's certificate does not chain to certificate_chain"
    )


def test_a_key_signature_with_only_certificates_configured(tmp_path, keys):
    pki = tmp_path / "pki"
    pki.mkdir()
    _, _, ca_path, _ = make_certificate(pki, "Release CA", None)
    root = tmp_path / "models"
    sign_version(write_version(root, 1, 101), keys["release"][0])
    manager = manager_for(root, TrustConfig(require_signature=True, certificate_chain=[ca_path]))
    error = sync(manager)["versions"]["1"]["error"]
    manager.close()
    assert error == "model.sig is signed with a key, but models.trust has no public_keys"


# -- edge-agent sign, the configuration, the agent ------------------------------------------


def test_edge_agent_sign_then_the_agent_serves_it(broker, make_agent, tmp_path, keys, capsys):
    root = tmp_path / "models"
    folder = write_version(root, 1, 101, "labels.txt")
    private, public = keys["release"]
    assert cli_main(["sign", str(folder), "--key", str(private)]) == 0
    out = capsys.readouterr()
    assert f"wrote {folder / SIGNATURE_FILE} over 2 file(s)" in out.out
    assert "PRIVATE" not in out.out + out.err
    assert not list(folder.glob(".*"))  # the temporary signature file is gone
    agent = make_agent(
        broker,
        root,
        MODELS__TRUST__REQUIRE_SIGNATURE="true",
        MODELS__TRUST__PUBLIC_KEYS=f'["{public}"]',
    )
    assert wait_for(lambda: agent.models.inventory()["models"]["mlp"]["serving"] == 1)
    entry = agent.models.inventory()["models"]["mlp"]["versions"]["1"]
    assert entry["signed"]["by"] == f"release.pub.pem (sha256:{fingerprint(public)})"


def test_edge_agent_sign_reports_a_missing_key(tmp_path, capsys):
    folder = write_version(tmp_path / "models", 1, 101)
    assert cli_main(["sign", str(folder), "--key", str(tmp_path / "nope.pem")]) == 1
    assert "cannot sign" in capsys.readouterr().err
    assert not (folder / SIGNATURE_FILE).exists()


def test_only_ec_keys_sign_and_verify(tmp_path, capsys):
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = tmp_path / "rsa.key.pem", tmp_path / "rsa.pub.pem"
    private.write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    root = tmp_path / "models"
    folder = write_version(root, 1, 101)
    assert cli_main(["sign", str(folder), "--key", str(private)]) == 1
    err = capsys.readouterr().err
    assert "rsa.key.pem: not an EC P-256, P-384 or P-521 key" in err and "PRIVATE" not in err
    ec_private, _ = make_key(tmp_path, "ec")
    sign_version(folder, ec_private)
    manager = manager_for(root, TrustConfig(require_signature=True, public_keys=[public]))
    error = sync(manager)["versions"]["1"]["error"]
    manager.close()
    assert error == f"public key {public}: not an EC P-256, P-384 or P-521 key"


def test_trust_config_is_checked_at_load(tmp_path, keys):
    with pytest.raises(ValueError, match="require_signature needs public_keys"):
        TrustConfig(require_signature=True)
    config = tmp_path / "agent.toml"
    config.write_text(
        '[models.trust]\nrequire_signature = true\npublic_keys = ["keys/release.pub.pem"]\n'
    )
    loaded = load_config(config, {})
    assert loaded.models.trust.public_keys == [keys["release"][1]]  # relative to the file
    config.write_text('[models.trust]\nrequire_signature = true\npublic_keys = ["missing.pem"]\n')
    with pytest.raises(ConfigError, match=r"models\.trust\.public_keys: cannot read"):
        load_config(config, {})
    config.write_text('[models.trust]\ncertificate_chain = ["agent.toml"]\n')
    with pytest.raises(ConfigError, match="is not a PEM file"):
        load_config(config, {})
