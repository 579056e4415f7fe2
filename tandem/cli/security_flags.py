"""TLS, bearer-token and limit flags, shared by `tandem serve` (every role) and the clients (`tandem generate --addr`).

The flags are read into the validated option objects here (``ServerTLS``,
``ClientTLS``, ``BearerAuth``); the numeric limits go to ``CoordinatorConfig``,
which checks them. The Helm chart passes these names: keep them stable.
"""

from __future__ import annotations

import argparse
from typing import Any

from tandem.rpc.auth import TOKEN_ENV, BearerAuth, token_from
from tandem.rpc.tls import ClientTLS, ServerTLS

MIB = 1024 * 1024


def add_server_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", metavar="PATH", default=None,
                   help="serve gRPC over TLS with this PEM certificate (chain); needs --tls-key. Default: plaintext")
    p.add_argument("--tls-key", metavar="PATH", default=None, help="the PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="PATH", default=None,
                   help="mutual TLS: require every client to present a certificate signed by this PEM CA "
                        "(health checks included)")


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    return ServerTLS.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)


def add_coordinator_flags(p: argparse.ArgumentParser) -> None:
    """The coordinator's links to its workers, its bearer tokens and its limits on requests."""
    p.add_argument("--worker-tls-ca", metavar="PATH", default=None,
                   help="talk TLS to the workers, verifying their certificates against this PEM CA. Default: plaintext")
    p.add_argument("--worker-tls-cert", metavar="PATH", default=None,
                   help="the coordinator's client certificate, for workers that require mutual TLS "
                        "(with --worker-tls-key)")
    p.add_argument("--worker-tls-key", metavar="PATH", default=None, help="the PEM private key of --worker-tls-cert")
    p.add_argument("--worker-tls-server-name", metavar="NAME", default=None,
                   help="the name to expect in every worker's certificate, instead of the host in its address")
    p.add_argument("--auth-token-file", metavar="PATH", default=None,
                   help=f"require 'authorization: Bearer <token>' on tandem.v1.Generation; the file holds one token a "
                        f"line (16+ printable characters; each is one client). Default: ${TOKEN_ENV} if set, else no "
                        "auth. grpc.health.v1 stays open for probes")
    p.add_argument("--max-request-bytes", type=int, default=4 * MIB, metavar="N",
                   help="largest request message accepted; gRPC refuses more with RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="longest prompt in tokens, else INVALID_ARGUMENT (default: the model's context)")
    p.add_argument("--max-new-tokens-limit", type=int, default=None, metavar="N",
                   help="most new tokens one request may ask for, else INVALID_ARGUMENT (default: what fits the "
                        "model's context)")
    p.add_argument("--max-concurrent-per-client", type=int, default=0, metavar="N",
                   help="requests one client may run at once, else RESOURCE_EXHAUSTED; the client is the bearer "
                        "token when auth is on, else the peer's IP address (default: 0, unlimited)")
    p.add_argument("--expose-worker-addresses", action="store_true",
                   help="name workers by their addresses in replies' stats and in Info (default: opaque names "
                        "such as target-0, so clients learn nothing of the internal network)")


def coordinator_options(args: argparse.Namespace) -> dict[str, Any]:
    """CoordinatorConfig keyword arguments from the flags above (TLS files and tokens already checked)."""
    return dict(
        worker_tls=ClientTLS.from_flags(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key,
                                        args.worker_tls_server_name, flag_prefix="--worker-tls-"),
        auth=BearerAuth.from_sources(args.auth_token_file),
        max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit, max_concurrent_per_client=args.max_concurrent_per_client,
        expose_worker_addresses=args.expose_worker_addresses,
    )


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How a client reaches a coordinator that has TLS or bearer auth on."""
    p.add_argument("--tls", action="store_true",
                   help="with --addr: TLS, trusting the system's root certificates (implied by --tls-ca/--tls-cert)")
    p.add_argument("--tls-ca", metavar="PATH", default=None,
                   help="with --addr: TLS, verifying the coordinator's certificate against this PEM CA")
    p.add_argument("--tls-cert", metavar="PATH", default=None,
                   help="with --addr: this client's PEM certificate, for a coordinator that requires mutual TLS")
    p.add_argument("--tls-key", metavar="PATH", default=None, help="the PEM private key of --tls-cert")
    p.add_argument("--token-file", metavar="PATH", default=None,
                   help=f"with --addr: send the bearer token in this file (its first token). Default: ${TOKEN_ENV}")


def client_options(args: argparse.Namespace) -> tuple[ClientTLS | None, str | None]:
    """The client's TLS options and bearer token from the flags above (and the environment)."""
    tls = ClientTLS.from_flags(args.tls_ca, args.tls_cert, args.tls_key, enabled=args.tls)
    return tls, token_from(args.token_file, "--token-file")
