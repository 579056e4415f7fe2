"""TLS and mutual TLS for every gRPC link: the options, validated, and the credentials built from them.

``ServerTLS`` is a server's side (``--tls-cert``, ``--tls-key``, and with
``--tls-client-ca`` mutual TLS: a client without a certificate signed by that
CA is refused during the handshake). ``ClientTLS`` is a client's side: the CA
that signed the server's certificate (None: the system's roots), its own
certificate for mutual TLS, and an optional override of the name checked in
the server's certificate. The same ``ClientTLS`` serves the coordinator's links
to its workers, ``tandem generate --addr``, ``TandemClient`` and the health
checks of local clusters, so every client of a TLS server is built one way.

Files are checked when the options are made (they exist, are readable and
hold what their flag says), so a typo fails at start with the flag's name,
not at the first handshake. Their bytes are read when credentials are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tandem.errors import InvalidRequestError

# What a PEM file of each kind contains (RSA, EC and PKCS#8 keys all say "PRIVATE KEY").
_PEM_MARKERS = {"certificate": b"-----BEGIN CERTIFICATE-----", "private key": b"PRIVATE KEY-----"}


def _check_pem(flag: str, path: Path | None, kind: str) -> Path | None:
    """``path`` as a Path, after checking it is a readable PEM file of ``kind``; refused naming ``flag``."""
    if path is None:
        return None
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if _PEM_MARKERS[kind] not in data:
        raise InvalidRequestError(f"{flag} {path}: not a PEM {kind}")
    return path


def _check_pair(cert_flag: str, cert: Path | None, key_flag: str, key: Path | None) -> None:
    if (cert is None) != (key is None):
        raise InvalidRequestError(f"{cert_flag} and {key_flag} go together: give both or neither")


@dataclass(slots=True, frozen=True)
class ServerTLS:
    """A server's certificate and key; with ``client_ca``, clients must present a certificate it signed."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cert", _check_pem("--tls-cert", self.cert, "certificate"))
        object.__setattr__(self, "key", _check_pem("--tls-key", self.key, "private key"))
        object.__setattr__(self, "client_ca", _check_pem("--tls-client-ca", self.client_ca, "certificate"))

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
        """The options the three server flags ask for; None (plaintext) when none is given."""
        if cert is None and key is None:
            if client_ca is not None:
                raise InvalidRequestError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
            return None
        _check_pair("--tls-cert", cert, "--tls-key", key)
        return cls(Path(cert), Path(key), Path(client_ca) if client_ca else None)  # type: ignore[arg-type]

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=client_ca, require_client_auth=client_ca is not None)

    def flags(self) -> list[str]:
        """The `tandem serve` flags that ask for these options (local clusters pass them on)."""
        out = ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        return out + (["--tls-client-ca", str(self.client_ca)] if self.client_ca else [])


@dataclass(slots=True, frozen=True)
class ClientTLS:
    """A client's TLS: the CA it trusts, its own certificate (mutual TLS), the server name it checks."""

    ca: Path | None = None  # None: the system's root certificates
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None  # checked in the server's certificate instead of the address's host
    flag_prefix: str = "--tls-"  # how the flags are spelled where these came from (for error messages)

    def __post_init__(self) -> None:
        p = self.flag_prefix
        _check_pair(f"{p}cert", self.cert, f"{p}key", self.key)
        object.__setattr__(self, "ca", _check_pem(f"{p}ca", self.ca, "certificate"))
        object.__setattr__(self, "cert", _check_pem(f"{p}cert", self.cert, "certificate"))
        object.__setattr__(self, "key", _check_pem(f"{p}key", self.key, "private key"))
        if self.server_name is not None and (not self.server_name or any(c.isspace() for c in self.server_name)):
            raise InvalidRequestError(f"{p}server-name must be a host name, got {self.server_name!r}")

    @classmethod
    def from_flags(cls, ca: str | None, cert: str | None, key: str | None, server_name: str | None = None,
                   *, flag_prefix: str = "--tls-", enabled: bool = False) -> ClientTLS | None:
        """The options the client flags ask for; None (plaintext) unless one is given or ``enabled``."""
        if not (enabled or ca or cert or key):
            if server_name is not None:
                raise InvalidRequestError(f"{flag_prefix}server-name needs TLS ({flag_prefix}ca)")
            return None
        return cls(Path(ca) if ca else None, Path(cert) if cert else None, Path(key) if key else None,
                   server_name, flag_prefix)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def flags(self, prefix: str) -> list[str]:
        """These options as flags spelled with ``prefix`` (e.g. ``--worker-tls-`` for the coordinator)."""
        out: list[str] = []
        for name, value in (("ca", self.ca), ("cert", self.cert), ("key", self.key),
                            ("server-name", self.server_name)):
            if value is not None:
                out += [f"{prefix}{name}", str(value)]
        return out


def open_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = (),
                 *, aio: bool = False) -> Any:
    """A channel to ``address``: TLS when ``tls`` is given, else plaintext; ``aio`` for a grpc.aio one."""
    module: Any = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(address, options=list(options))
    return module.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])
