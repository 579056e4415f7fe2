"""Bearer tokens on the public API: where they come from, and who a presented token belongs to.

The coordinator takes its tokens from ``--auth-token-file`` (one token a line;
blank lines and ``#`` comments are skipped) or from ``$TANDEM_AUTH_TOKEN`` (one
token). A client sends ``authorization: Bearer <token>`` metadata; the client
side reads its token the same way (``--token-file`` or ``$TANDEM_AUTH_TOKEN``).

Each token is one client identity, named ``token-1``, ``token-2``... in file
order: limits per client count per token when auth is on, and logs name the
identity, never the token. A presented token is compared with every known one
in constant time (HMAC-style digest comparison over all of them, no early
exit), so the time a refusal takes says nothing about how close a guess was.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem.errors import InvalidRequestError

TOKEN_ENV = "TANDEM_AUTH_TOKEN"
METADATA_KEY = "authorization"
SCHEME = "Bearer "
# Metadata values are printable ASCII; a token must survive the trip unchanged.
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
MIN_TOKEN_CHARS = 16  # shorter ones are guessable


def _check_token(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidRequestError(f"{where}: a token must have at least {MIN_TOKEN_CHARS} characters")
    if not set(token) <= _TOKEN_CHARS:
        raise InvalidRequestError(f"{where}: a token must be printable ASCII without spaces")
    return token


def read_token_file(path: Path | str, flag: str) -> list[str]:
    """The tokens in ``path``, one a line; refused naming ``flag`` if unreadable, empty or malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not readable ASCII text"
        raise InvalidRequestError(f"{flag} {path}: {reason}") from None
    lines = [line.strip() for line in text.splitlines()]
    tokens = [_check_token(t, f"{flag} {path} line {i}") for i, t in enumerate(lines, 1)
              if t and not t.startswith("#")]
    if not tokens:
        raise InvalidRequestError(f"{flag} {path}: holds no token")
    return tokens


def token_from(path: str | None, flag: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A client's token: the first in ``path``, else ``$TANDEM_AUTH_TOKEN``, else None."""
    if path:
        return read_token_file(path, flag)[0]
    token = env_token(environ)
    return _check_token(token, f"${TOKEN_ENV}") if token else None


def env_token(environ: Mapping[str, str] | None = None) -> str:
    """``$TANDEM_AUTH_TOKEN`` without the whitespace around it ("" when unset): a Kubernetes Secret made from a
    file (``kubectl create secret --from-file``) keeps the file's last line break, as a token file's line would.
    Set to whitespace alone, it is refused: auth was asked for, and no token given."""
    raw = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    token = raw.strip()
    if raw and not token:
        raise InvalidRequestError(f"${TOKEN_ENV} holds only whitespace: no token")
    return token


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token`` (none without one)."""
    return ((METADATA_KEY, SCHEME + token),) if token else ()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii", "replace")).digest()


@dataclass(slots=True, frozen=True)
class BearerAuth:
    """The tokens the public API accepts; ``identify`` says whose a presented one is."""

    tokens: tuple[str, ...] = field(repr=False)  # never in logs or reprs
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise InvalidRequestError("bearer auth needs at least one token")
        for i, token in enumerate(self.tokens, 1):
            _check_token(token, f"token {i}")
        object.__setattr__(self, "_digests", tuple(_digest(t) for t in self.tokens))

    @classmethod
    def from_sources(cls, token_file: str | None, flag: str = "--auth-token-file",
                     environ: Mapping[str, str] | None = None) -> BearerAuth | None:
        """Tokens from ``token_file``, else ``$TANDEM_AUTH_TOKEN``; None (no auth) when neither is set."""
        if token_file:
            return cls(tuple(read_token_file(token_file, flag)))
        token = env_token(environ)
        return cls((_check_token(token, f"${TOKEN_ENV}"),)) if token else None

    def identify(self, metadata: Mapping[str, str] | None) -> str | None:
        """``token-N`` for the N-th known token presented as ``authorization: Bearer ...``; else None."""
        value = (metadata or {}).get(METADATA_KEY, "")
        if not value.startswith(SCHEME):
            return None
        presented = _digest(value[len(SCHEME):])
        found = None
        for i, known in enumerate(self._digests, 1):  # every one, always: no early exit
            if hmac.compare_digest(presented, known) and found is None:
                found = f"token-{i}"
        return found
