"""`tandem scale`: grow or shrink the fleets of a running `tandem up`, without restarting its coordinator.

New workers are started and join once they serve; removed workers (the
newest first) get no new requests, finish the ones they have (up to
--drain-timeout), then stop. Without --target-replicas or --draft-replicas it
prints the fleet as it is. The running `tandem up` is found by its coordinator
port (--port, through <cache root>/run/up-<port>.json) or by --admin; the
secret its control endpoint requires is read from that file, which only the
user who started `tandem up` can read.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from tandem import model_store
from tandem.cluster import DRAIN_TIMEOUT_S
from tandem.errors import InvalidRequestError
from tandem.up_admin import state_file

SCALE_TIMEOUT_S = 1800.0  # growing loads a model in every new worker


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="grow or shrink the fleets of a running `tandem up`", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-replicas", type=int, default=None, metavar="N",
                   help="target workers wanted (at least 1; default: unchanged)")
    p.add_argument("--draft-replicas", type=int, default=None, metavar="M",
                   help="draft workers wanted (0 or more; default: unchanged)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="seconds a removed worker gets to finish its requests before it is stopped "
                        "(default: %(default)s)")
    p.add_argument("--port", type=int, default=50051,
                   help="the coordinator port of the `tandem up` to scale (default: %(default)s)")
    p.add_argument("--admin", default=None, metavar="HOST:PORT",
                   help="its control endpoint, as `tandem up` printed it (default: found from --port)")
    p.add_argument("--cache-dir", default=None,
                   help="the cache root that `tandem up` used (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.set_defaults(func=run)


def _read_state(path: Path) -> dict:
    state = json.loads(path.read_text())
    if not isinstance(state, dict) or not isinstance(state.get("admin"), str):
        raise ValueError(f"{path} does not say where the control endpoint is")
    return state


def admin_endpoint(args: argparse.Namespace) -> tuple[str, str | None]:
    """(address, secret) of the control endpoint to call: from the state file of the `tandem up` on --port,
    or --admin with the secret of the state file that names it (None if none does: the endpoint says so)."""
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    if args.admin:
        for path in sorted((root / "run").glob("up-*.json")):
            try:
                state = _read_state(path)
            except (OSError, ValueError):
                continue  # another user's, or half-written: not the one asked for
            if state["admin"] == args.admin:
                return args.admin, state.get("secret")
        return args.admin, None
    path = state_file(root, args.port)
    try:
        state = _read_state(path)
    except (OSError, ValueError):
        raise InvalidRequestError(f"no running `tandem up` with its coordinator on port {args.port} ({path} is "
                                  "missing or unreadable); pass --port or --admin HOST:PORT") from None
    return state["admin"], state.get("secret")


def call(address: str, path: str, body: dict | None = None, timeout_s: float = 30.0,
         secret: str | None = None) -> dict:
    """One request to the control endpoint; its error message, as an error, when it refuses."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    request = urllib.request.Request(f"http://{address}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        message = json.loads(exc.read() or b"{}").get("error", exc.reason)
        raise InvalidRequestError(f"`tandem up` refused: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise InvalidRequestError(f"cannot reach `tandem up` at {address}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    address, secret = admin_endpoint(args)
    if args.target_replicas is None and args.draft_replicas is None:
        fleet = call(address, "/fleet", secret=secret)
    else:
        body = {"drain_timeout_s": args.drain_timeout}
        if args.target_replicas is not None:
            body["target_replicas"] = args.target_replicas
        if args.draft_replicas is not None:
            body["draft_replicas"] = args.draft_replicas
        fleet = call(address, "/scale", body, timeout_s=SCALE_TIMEOUT_S + args.drain_timeout, secret=secret)
    print(f"coordinator {fleet['coordinator']}")
    for role in ("target", "draft"):
        print(f"{role:<7} {len(fleet[role])}: {' '.join(fleet[role]) or '-'}")
    return 0
