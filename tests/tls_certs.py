"""Certificates made in the test: a CA, a server certificate for 127.0.0.1/localhost, client certificates.

``make_pki(dir)`` writes PEM files and returns their paths, plus a second,
unrelated CA with a client certificate of its own (what mutual TLS must
refuse). EC P-256 keys: generating them takes milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA...
    other_client_cert: Path  # ...and a client certificate it signed
    other_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert: x509.Certificate | None, key: ec.EllipticCurvePrivateKey | None = None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        assert key is not None
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False, server: bool = False
                 ) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key, None, key, ca=True)
    return cert, key, _write(directory / f"{name}.pem", cert)


def _leaf(directory: Path, name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          server: bool = False) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key, ca.subject, ca_key, server=server)
    return _write(directory / f"{name}.crt", cert), _write(directory / f"{name}.key", None, key)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key, ca_path = _ca(directory, "tandem-test-ca")
    server_cert, server_key = _leaf(directory, "server", ca, ca_key, server=True)
    client_cert, client_key = _leaf(directory, "client", ca, ca_key)
    other, other_key, other_path = _ca(directory, "other-ca")
    other_cert, other_client_key = _leaf(directory, "stranger", other, other_key)
    return Pki(ca_path, server_cert, server_key, client_cert, client_key, other_path, other_cert, other_client_key)
