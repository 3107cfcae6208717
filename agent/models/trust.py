"""Signed model versions: `model.sig` checked before a version may load (`[models.trust]`).

Anyone who can write into the watched folder could otherwise make the agent serve their
model: `model.sha256` catches a torn copy, not a swapped file, since whoever swaps the file
writes the checksum too. With ``require_signature`` a version loads only if its folder holds a
``model.sig`` made by the OpenSSF `model-signing` library (a Sigstore bundle holding a DSSE
envelope over an in-toto manifest of every file's sha256) that verifies offline against a
configured public key or certificate chain, and the folder's files match the manifest.

What is signed: every file under the version folder, except ``model.sig`` itself. Nothing
else is excluded, on purpose: an ONNX model's external data may name any file in its folder
(hidden ones and ``*.tmp`` included), so an excluded name could carry unsigned weights. The
agent itself writes nothing into version folders (on-box engine builds publish a whole new
version, which must then be signed too); keep an ONNX Runtime ``engine_cache_path`` outside
them. Files are hashed through symbolic links (the scanner keeps links inside the repository).

`model_signing` and `cryptography` are imported on the first verification only, so an agent
without ``[models.trust]`` never loads them (decision 0025). Verification runs on the loading
thread, inside :func:`agent.models.loading.open_version`, and reads each file once.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import importlib
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import TrustConfig
from agent.models.backends.base import ModelLoadError

__all__ = ["SIGNATURE_FILE", "TrustPolicy", "key_label", "sign_version"]

SIGNATURE_FILE = "model.sig"
MAX_SIGNATURE_BYTES = 8 * 1024 * 1024  # a bundle lists one digest per file: kilobytes
_MAX_NAMED = 3  # files named in a reason; the rest are counted
CURVES = ("secp256r1", "secp384r1", "secp521r1")


def _module(name: str) -> Any:
    """The library's modules, imported on first use and typed loosely (it has no hints)."""
    return importlib.import_module(name)


def hashing_config() -> Any:
    """How a version folder is hashed, the same when signing and verifying: sha256 per file,
    through symbolic links, everything but ``model.sig`` (git files included: no exception
    for names the model could read). One worker: a box keeps serving while it verifies."""
    hashing = _module("model_signing.hashing")
    return (
        hashing.Config()
        .use_file_serialization(hashing_algorithm="sha256", max_workers=1)
        .set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=False)
        .set_allow_symlinks(True)
    )


def _one_line(text: object, limit: int = 200) -> str:
    """Library messages and file names in a reason: printable, one line, bounded."""
    line = " ".join(str(text).split())
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass(frozen=True)
class _Key:
    """A configured public key: the bundle's hint to match it and a label for the inventory."""

    path: Path
    hint: str  # sha256 hex of the key's PEM SubjectPublicKeyInfo (model-signing's key hint)
    label: str


def key_label(path: Path, public_key: Any) -> str:
    """``name.pem (sha256:0123456789abcdef)``: the file's name and the first 16 hex digits of
    the sha256 of the key's DER SubjectPublicKeyInfo (``openssl pkey -pubin -outform DER``)."""
    serialization = _module("cryptography.hazmat.primitives.serialization")
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return f"{path.name} (sha256:{hashlib.sha256(der).hexdigest()[:16]})"


def _curve_problem(key: Any) -> str | None:
    """model-signing signs with EC keys on these curves only (RSA, Ed25519: no)."""
    curve = getattr(getattr(key, "curve", None), "name", None)
    return None if curve in CURVES else "not an EC P-256, P-384 or P-521 key"


def _load_key(path: Path) -> _Key:
    serialization = _module("cryptography.hazmat.primitives.serialization")
    try:
        public_key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"public key {path}: cannot load: {_one_line(e)}") from None
    problem = _curve_problem(public_key)
    if problem is not None:
        raise ModelLoadError(f"public key {path}: {problem}")
    pem = public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _Key(path, hashlib.sha256(pem).hexdigest(), key_label(path, public_key))


def _read_bundle(signature: Path) -> dict[str, Any]:
    """The bundle's JSON, checked just enough to tell key from certificate signatures."""
    try:
        with signature.open("rb") as f:
            raw = f.read(MAX_SIGNATURE_BYTES + 1)
    except OSError as e:
        raise ModelLoadError(f"cannot read {SIGNATURE_FILE}: {e.strerror or e}") from None
    invalid = f"{SIGNATURE_FILE} is not a valid signature bundle"
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise ModelLoadError(f"{invalid} (larger than {MAX_SIGNATURE_BYTES} bytes)")
    try:
        bundle = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ModelLoadError(f"{invalid} (not JSON)") from None
    material = bundle.get("verificationMaterial") if isinstance(bundle, dict) else None
    if not isinstance(material, dict) or not isinstance(bundle.get("dsseEnvelope"), dict):
        raise ModelLoadError(f"{invalid} (no verificationMaterial or dsseEnvelope)")
    return dict(bundle)


def _leaf_identity(material: dict[str, Any]) -> str:
    """The signing certificate's identity: its subject alternative names, else its subject."""
    x509 = _module("cryptography.x509")
    try:
        raw = material["x509CertificateChain"]["certificates"][0]["rawBytes"]
        leaf = x509.load_der_x509_certificate(base64.b64decode(raw))
    except (KeyError, IndexError, TypeError, ValueError):
        raise ModelLoadError(
            f"{SIGNATURE_FILE} is not a valid signature bundle (no signing certificate)"
        ) from None
    names: list[str] = []
    with contextlib.suppress(x509.ExtensionNotFound):
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for kind in (x509.RFC822Name, x509.UniformResourceIdentifier, x509.DNSName):
            names += [str(v) for v in san.get_values_for_type(kind)]
    return _one_line(", ".join(names) or leaf.subject.rfc4514_string())


class TrustPolicy:
    """``[models.trust]`` applied to version folders; built once per manager.

    The keys are read at the first verification (not at construction), so constructing it
    imports nothing; a key that cannot be loaded fails the versions with its reason.
    """

    def __init__(self, config: TrustConfig) -> None:
        self._config = config
        self._keys: list[_Key] | None = None
        self._lock = threading.Lock()

    def _public_keys(self) -> list[_Key]:
        with self._lock:
            if self._keys is None:
                self._keys = [_load_key(path) for path in self._config.public_keys]
            return self._keys

    def verify(self, folder: Path) -> dict[str, str]:
        """The inventory's ``signed`` entry (``{"by": KEY_OR_IDENTITY}``) when ``folder``'s
        ``model.sig`` verifies and every file matches it; raises :class:`ModelLoadError`
        with a one-line reason otherwise."""
        signature = folder / SIGNATURE_FILE
        if not signature.is_file():
            raise ModelLoadError(f"no {SIGNATURE_FILE} (models.trust.require_signature is on)")
        material = _read_bundle(signature)["verificationMaterial"]
        verifying = _module("model_signing.verifying")
        if "publicKey" in material:
            key = self._matching_key(material["publicKey"])
            config = verifying.Config().use_elliptic_key_verifier(public_key=key.path)
            by = key.label
        elif "x509CertificateChain" in material:
            if not self._config.certificate_chain:
                raise ModelLoadError(
                    f"{SIGNATURE_FILE} is signed with a certificate, "
                    "but models.trust has no certificate_chain"
                )
            chain = self._config.certificate_chain
            config = verifying.Config().use_certificate_verifier(certificate_chain=chain)
            by = _leaf_identity(material)
        else:
            raise ModelLoadError(
                f"{SIGNATURE_FILE} is not a valid signature bundle (neither a key nor a "
                "certificate signature; Sigstore bundles are not accepted)"
            )
        _run(config.set_hashing_config(hashing_config()), folder, signature, by)
        return {"by": by}

    def _matching_key(self, public_key: Any) -> _Key:
        if not self._config.public_keys:
            raise ModelLoadError(
                f"{SIGNATURE_FILE} is signed with a key, but models.trust has no public_keys"
            )
        hint = public_key.get("hint") if isinstance(public_key, dict) else None
        if not hint:
            raise ModelLoadError(
                f"{SIGNATURE_FILE} names no key (made by model-signing before 1.0): sign again"
            )
        for key in self._public_keys():
            if key.hint == hint:
                return key
        raise ModelLoadError(f"{SIGNATURE_FILE} is signed by a key not in public_keys")


def _run(config: Any, folder: Path, signature: Path, by: str) -> None:
    """The library's verification: the envelope's signature, then a hash of every file
    against the signed manifest. Its exceptions become one-line reasons."""
    try:
        config.verify(folder, signature)
    except Exception as e:
        raise ModelLoadError(_reason(e, by)) from None


def _reason(exc: Exception, by: str) -> str:
    name = type(exc).__name__
    message = str(exc)
    if name == "InvalidSignature":
        return f"{SIGNATURE_FILE} does not verify with {by} (its signature or payload was altered)"
    if name == "X509StoreContextError":
        return f"{SIGNATURE_FILE}'s certificate does not chain to certificate_chain: " + (
            _one_line(message)
        )
    if isinstance(exc, OSError):
        return f"cannot read the version folder: {_one_line(exc.strerror or exc)}"
    if isinstance(exc, ValueError) and message.startswith("Signature mismatch:"):
        return _mismatch(message.removeprefix("Signature mismatch:").strip())
    if isinstance(exc, ValueError) and message.startswith("Key mismatch"):
        return f"{SIGNATURE_FILE} is signed by a key not in public_keys"
    if isinstance(exc, ValueError) and "cannot be used for signing" in message:
        return f"{SIGNATURE_FILE}'s certificate is not for signing (key usage)"
    if isinstance(exc, ValueError) and message.startswith("Cannot use"):
        return f"cannot hash the version folder: {_one_line(message)}"
    return f"{SIGNATURE_FILE} is not a valid signature bundle ({name}: {_one_line(message)})"


def _mismatch(diffs_text: str) -> str:
    """``file X changed since signing`` (and added, removed) from the library's list of
    differences, e.g. ``["Extra files found in model '2': a.bin", "Hash mismatch for
    'model.onnx': ..."]``. An unknown shape is reported as it is, shortened."""
    try:
        diffs = ast.literal_eval(diffs_text)
    except (ValueError, SyntaxError):
        diffs = None
    if not isinstance(diffs, list) or not all(isinstance(d, str) for d in diffs):
        return f"files differ from the signed ones: {_one_line(diffs_text)}"
    found: list[str] = []
    for diff in diffs:
        found += _describe_diff(diff)
    if not found:
        return f"files differ from the signed ones: {_one_line(diffs_text)}"
    more = len(found) - _MAX_NAMED
    return "; ".join(found[:_MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _describe_diff(diff: str) -> list[str]:
    for prefix, what in (
        ("Extra files found in model ", "added after signing"),
        ("Missing files in model ", "removed after signing"),
    ):
        if diff.startswith(prefix):
            _, _, names = diff.partition("': ")
            return [f"file {_one_line(n, 80)} {what}" for n in names.split(", ") if n]
    if diff.startswith("Hash mismatch for '"):
        name = diff.removeprefix("Hash mismatch for '").partition("': ")[0]
        return [f"file {_one_line(name, 80)} changed since signing"]
    return [_one_line(diff)]


def sign_version(
    folder: Path,
    private_key: Path,
    *,
    certificate: Path | None = None,
    certificate_chain: Sequence[Path] = (),
    password: str | None = None,
) -> Path:
    """Write ``folder/model.sig`` over the folder's files (the same exclusions the agent
    verifies with). Key mode with only ``private_key``; certificate mode with
    ``certificate`` (the signing certificate) and its ``certificate_chain``. The signature
    goes to a hidden temporary file first and is renamed into place, after the hashing."""
    serialization = _module("cryptography.hazmat.primitives.serialization")
    secret = password.encode() if password is not None else None
    problem = _curve_problem(serialization.load_pem_private_key(private_key.read_bytes(), secret))
    if problem is not None:
        raise ValueError(f"{private_key.name}: {problem}")
    signing = _module("model_signing.signing")
    config = signing.Config()
    if certificate is None:
        config.use_elliptic_key_signer(private_key=private_key, password=password)
    else:
        if password is not None:
            raise ValueError("an encrypted key is not supported with a certificate")
        if not certificate_chain:  # model-signing 1.1 cannot load an empty chain
            raise ValueError("a certificate needs its chain (the issuing CA at least)")
        config.use_certificate_signer(
            private_key=private_key,
            signing_certificate=certificate,
            certificate_chain=list(certificate_chain),
        )
    config.set_hashing_config(hashing_config())
    target = folder / SIGNATURE_FILE
    tmp = folder / f".{SIGNATURE_FILE}.{os.getpid()}.tmp"
    try:
        config.sign(folder, tmp)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target
