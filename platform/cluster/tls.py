"""The relay's TLS certificate: made by the node itself at its first start
(an EC P-256 key, mode 0600, and a self-signed certificate in the run dir),
published by its SHA-256 in the database, and pinned by every node that
links to it (node_link.client.client_tls_context). No CA to run, nothing to
copy between hosts; the database is the trust anchor, as it is for the
node secrets. Or, where the operator runs a private CA, every node's
certificate comes from it and links are mutual TLS under it (`private_ca`)."""

import datetime
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from node_link.protocol import PrivateCa, certificate_fingerprint


def tls_paths(run_dir: Path | str) -> tuple[Path, Path]:
    folder = Path(run_dir) / "cluster"
    return folder / "relay.key", folder / "relay.crt"


def relay_certificate(run_dir: Path | str, node: str) -> tuple[Path, Path, str]:
    """The relay's key and certificate (made once), and the certificate's
    SHA-256 (hex) for the database."""
    key_path, cert_path = tls_paths(run_dir)
    if not (key_path.exists() and cert_path.exists()):
        _make(key_path, cert_path, node)
    return key_path, cert_path, certificate_file_fingerprint(cert_path)


def _make(key_path: Path, cert_path: Path, node: str) -> None:
    key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"roundhouse {node}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def server_tls_context(
    key_path: Path, cert_path: Path, *, client_ca: Path | None = None
) -> ssl.SSLContext:
    """The relay's TLS; with `client_ca`, mutual: a caller must present a
    certificate that CA signed (the relay then checks it names the node)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert_path, key_path)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=client_ca)
    return context


def private_ca() -> PrivateCa | None:
    """The private CA the settings name (ROUNDHOUSE_CLUSTER_CA, _CERT, _KEY),
    or None (pinned self-signed certificates); ImproperlyConfigured when only
    some are set or a file is missing."""
    paths = {
        "ROUNDHOUSE_CLUSTER_CA": settings.ROUNDHOUSE_CLUSTER_CA,
        "ROUNDHOUSE_CLUSTER_CERT": settings.ROUNDHOUSE_CLUSTER_CERT,
        "ROUNDHOUSE_CLUSTER_KEY": settings.ROUNDHOUSE_CLUSTER_KEY,
    }
    given = {name for name, path in paths.items() if path}
    if not given:
        return None
    if len(given) < len(paths):
        missing = ", ".join(sorted(set(paths) - given))
        raise ImproperlyConfigured(
            f"a private CA for the cluster's links needs all three of "
            f"ROUNDHOUSE_CLUSTER_CA, _CERT and _KEY: {missing} not set"
        )
    for name, path in paths.items():
        if not Path(path).is_file():
            raise ImproperlyConfigured(f"{name}: no file at {path}")
    return PrivateCa(
        ca=Path(paths["ROUNDHOUSE_CLUSTER_CA"]),
        cert=Path(paths["ROUNDHOUSE_CLUSTER_CERT"]),
        key=Path(paths["ROUNDHOUSE_CLUSTER_KEY"]),
    )


def certificate_file_fingerprint(cert_path: Path) -> str:
    """The SHA-256 (hex) of a PEM certificate, as published for a node."""
    der = x509.load_pem_x509_certificate(cert_path.read_bytes()).public_bytes(
        serialization.Encoding.DER
    )
    return certificate_fingerprint(der)
