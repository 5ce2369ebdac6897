"""A private certificate authority for tests: a CA certificate and the
node certificates it signs, written to files as an operator's would be."""

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from node_link.protocol import PrivateCa


class Authority:
    """A CA that writes its certificate and the nodes' it signs to files."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            self._builder(self.name, self.key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / "ca.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject, public_key, now):
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def node(self, name: str, *, as_common_name: bool = False) -> PrivateCa:
        """A certificate for node `name` (a DNS subject-alternative name, or
        only the common name), its key, and this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, name if as_common_name else "x")]
        )
        now = datetime.datetime.now(datetime.UTC)
        builder = self._builder(subject, key.public_key(), now)
        if not as_common_name:
            alt = [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path, key_path = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return PrivateCa(ca=self.path, cert=cert_path, key=key_path)
