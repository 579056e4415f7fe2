"""The control endpoint of a running `tandem up`: grow and shrink its fleets (`tandem scale` calls it).

HTTP with JSON bodies, on 127.0.0.1 only:

- ``GET /fleet`` -> ``{"coordinator": "HOST:PORT", "target": [...], "draft": [...]}``
- ``POST /scale`` with ``{"target_replicas": N, "draft_replicas": M, "drain_timeout_s": S}`` (each
  optional) -> the fleet afterwards; 400 with ``{"error": "..."}`` for a request it cannot do, a
  count above ``max_replicas`` (`tandem up --max-replicas`) included.

Who may call it (checked in this order, before anything else is read):

- Host must be ``127.0.0.1:PORT`` or ``localhost:PORT`` (this endpoint's port), else 403: a web
  page that rebinds its own DNS name to 127.0.0.1 sends its name, not ours.
- A request with an ``Origin`` header other than this endpoint's is refused (403): browsers add it
  to cross-site requests; `tandem scale` sends none.
- ``Authorization: Bearer <secret>``, else 401: the secret is made at start and written only to
  the state file below, which only its owner can read (mode 0600), so other local users cannot
  drive it.

Growing starts the new workers, waits until they serve, then rewrites the
workers file the coordinator follows. Shrinking removes the newest workers
from the file first, waits until the coordinator has no request on them (at
most ``drain_timeout_s``), then stops them. One scaling at a time; the call
returns when it is done (growing loads a model: allow minutes).

Where to find it: ``tandem up`` writes ``<cache root>/run/up-<coordinator
port>.json`` (``{"admin": "127.0.0.1:PORT", "pid": ..., "coordinator": ...,
"secret": ...}``, mode 0600) and removes it on exit.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tandem.cluster import DRAIN_TIMEOUT_S, LocalCluster
from tandem.errors import InvalidRequestError

SCALE_KEYS = ("target_replicas", "draft_replicas", "drain_timeout_s")
MAX_REPLICAS = 16  # per fleet, by default: each replica is a process holding a model
MAX_BODY_BYTES = 64 * 1024


def state_file(cache_root: Path, coordinator_port: int) -> Path:
    """Where the `tandem up` serving on ``coordinator_port`` says where its control endpoint is."""
    return Path(cache_root) / "run" / f"up-{coordinator_port}.json"


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (it holds the secret) to ``path`` so that only this user can read it, at no moment
    otherwise: a new file made with mode 0600, then renamed over the old one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(state) + "\n")
    os.replace(temporary, path)


def parse_scale(body: dict[str, Any], max_replicas: int = MAX_REPLICAS) -> tuple[int | None, int | None, float]:
    """(target replicas, draft replicas, drain timeout) from a /scale body; a clear error for anything else,
    a count above ``max_replicas`` included."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = set(body) - set(SCALE_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown fields {sorted(unknown)}; expected {', '.join(SCALE_KEYS)}")
    target, draft = body.get("target_replicas"), body.get("draft_replicas")
    for name, value, least in (("target_replicas", target, 1), ("draft_replicas", draft, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")
        if value is not None and value > max_replicas:
            raise InvalidRequestError(f"{name} must be at most {max_replicas} (this `tandem up` was started with "
                                      f"--max-replicas {max_replicas}), got {value}")
    drain = body.get("drain_timeout_s", DRAIN_TIMEOUT_S)
    if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
        raise InvalidRequestError(f"drain_timeout_s must be a number of seconds >= 0, got {drain!r}")
    return target, draft, float(drain)


class AdminServer:
    """Serves the control endpoint for one ``LocalCluster`` on a thread; ``address`` once started.

    ``secret``: what callers must present (default: a new random one; ``start`` writes it to the state
    file); ``lock``: held while scaling, shared with whatever else changes the fleet (the supervisor).
    """

    def __init__(self, cluster: LocalCluster, port: int = 0, *, secret: str | None = None,
                 max_replicas: int = MAX_REPLICAS, lock: threading.Lock | None = None,
                 say: Callable[[str], None] = lambda message: None) -> None:
        if max_replicas < 1:
            raise ValueError(f"max_replicas must be at least 1, got {max_replicas}")
        self.cluster = cluster
        self.secret = secret or secrets.token_urlsafe(32)
        self.max_replicas = max_replicas
        self.lock = lock or threading.Lock()  # one change of the fleet at a time
        self.say = say  # `tandem up` prints each change of the fleet where it printed the fleet
        admin = self

        class Handler(_Handler):
            server_admin = admin

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="tandem-up-admin")
        self.state_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self, state_path: Path | None = None) -> None:
        """Serve on a thread; with ``state_path``, say there (owner-only) where it is and its secret."""
        if state_path is not None:
            write_state(state_path, {"admin": self.address, "pid": os.getpid(),
                                     "coordinator": self.cluster.coordinator.address, "secret": self.secret})
            self.state_path = state_path
        self.thread.start()

    def refusal(self, headers: Any) -> tuple[int, str] | None:
        """(HTTP status, why) when a request with these headers may not drive this endpoint, else None."""
        ours = (f"127.0.0.1:{self.port}", f"localhost:{self.port}")
        host = headers.get("Host")
        if host not in ours:
            return 403, f"Host {host!r} is not this endpoint ({' or '.join(ours)}): refused"
        origin = headers.get("Origin")
        if origin is not None and origin not in {f"http://{h}" for h in ours}:
            return 403, f"requests from web pages are refused (Origin {origin!r})"
        presented = headers.get("Authorization") or ""
        scheme, _, secret = presented.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(secret.encode(), self.secret.encode()):
            where = self.state_path or "the state file of this `tandem up`"
            return 401, (f"{'a wrong' if presented else 'no'} secret: send 'Authorization: Bearer <secret>' with the "
                         f"secret in {where} (`tandem scale` does)")
        return None

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.state_path is not None:
            self.state_path.unlink(missing_ok=True)

    def fleet(self) -> dict[str, Any]:
        return {"coordinator": self.cluster.coordinator.address,
                **{role: [s.address for s in self.cluster.workers(role)] for role in ("target", "draft")}}

    def scale(self, target: int | None, draft: int | None, drain_timeout_s: float) -> dict[str, Any]:
        with self.lock:
            for role, want in (("target", target), ("draft", draft)):
                have = len(self.cluster.workers(role))
                if want is None or want == have:
                    continue
                if want > have:
                    self.say(f"scaling {role} replicas {have} -> {want}: starting {want - have}...")
                    for service in self.cluster.add_workers(role, want - have):
                        self.say(f"{service.name} ({service.address}, pid {service.process.pid}) serving")
                else:
                    self.say(f"scaling {role} replicas {have} -> {want}: draining {have - want} "
                             f"(up to {drain_timeout_s:g}s for their requests)...")
                    for service in self.cluster.remove_workers(role, have - want, drain_timeout_s):
                        self.say(f"{service.name} ({service.address}) left the fleet and stopped")
            return self.fleet()


class _Handler(BaseHTTPRequestHandler):
    server_admin: AdminServer

    def log_message(self, *args: Any) -> None:  # `tandem up` prints what matters itself
        pass

    def _refused(self) -> bool:
        refusal = self.server_admin.refusal(self.headers)
        if refusal is not None:
            code, message = refusal
            self._reply(code, {"error": message})
        return refusal is not None

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        if self._refused():
            return None
        if self.path != "/fleet":
            return self._reply(404, {"error": f"no such endpoint {self.path}; GET /fleet or POST /scale"})
        self._reply(200, self.server_admin.fleet())

    def do_POST(self) -> None:  # noqa: N802
        if self._refused():
            return None
        if self.path != "/scale":
            return self._reply(404, {"error": f"no such endpoint {self.path}; GET /fleet or POST /scale"})
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY_BYTES:
                return self._reply(413, {"error": f"a body of {length} bytes; at most {MAX_BODY_BYTES}"})
            body = json.loads(self.rfile.read(length) or b"{}")
            fleet = self.server_admin.scale(*parse_scale(body, self.server_admin.max_replicas))
        except (json.JSONDecodeError, InvalidRequestError, ValueError) as exc:
            return self._reply(400, {"error": str(exc)})
        except (RuntimeError, TimeoutError) as exc:  # a new worker exited or did not come up
            self.server_admin.say(f"scaling failed: {exc}")
            return self._reply(500, {"error": str(exc)})
        self._reply(200, fleet)

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        send_json(self, code, body, {"WWW-Authenticate": "Bearer"} if code == 401 else None)


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any],
              headers: dict[str, str] | None = None) -> None:
    """One JSON reply with its length (the connection stays usable for the next request)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
