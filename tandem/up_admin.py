"""The control endpoint of a running `tandem up`: grow and shrink its fleets (`tandem scale` calls it).

HTTP with JSON bodies, on 127.0.0.1 only (anyone on this machine may scale it,
as anyone here could start or stop its processes):

- ``GET /fleet`` -> ``{"coordinator": "HOST:PORT", "target": [...], "draft": [...]}``
- ``POST /scale`` with ``{"target_replicas": N, "draft_replicas": M, "drain_timeout_s": S}`` (each
  optional) -> the fleet afterwards; 400 with ``{"error": "..."}`` for a request it cannot do.

Growing starts the new workers, waits until they serve, then rewrites the
workers file the coordinator follows. Shrinking removes the newest workers
from the file first, waits until the coordinator has no request on them (at
most ``drain_timeout_s``), then stops them. One scaling at a time; the call
returns when it is done (growing loads a model: allow minutes).

Where to find it: ``tandem up`` writes ``<cache root>/run/up-<coordinator
port>.json`` (``{"admin": "127.0.0.1:PORT", "pid": ..., "coordinator": ...}``)
and removes it on exit.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tandem.cluster import DRAIN_TIMEOUT_S, LocalCluster
from tandem.errors import InvalidRequestError

SCALE_KEYS = ("target_replicas", "draft_replicas", "drain_timeout_s")


def state_file(cache_root: Path, coordinator_port: int) -> Path:
    """Where the `tandem up` serving on ``coordinator_port`` says where its control endpoint is."""
    return Path(cache_root) / "run" / f"up-{coordinator_port}.json"


def parse_scale(body: dict[str, Any]) -> tuple[int | None, int | None, float]:
    """(target replicas, draft replicas, drain timeout) from a /scale body; a clear error for anything else."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = set(body) - set(SCALE_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown fields {sorted(unknown)}; expected {', '.join(SCALE_KEYS)}")
    target, draft = body.get("target_replicas"), body.get("draft_replicas")
    for name, value, least in (("target_replicas", target, 1), ("draft_replicas", draft, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")
    drain = body.get("drain_timeout_s", DRAIN_TIMEOUT_S)
    if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
        raise InvalidRequestError(f"drain_timeout_s must be a number of seconds >= 0, got {drain!r}")
    return target, draft, float(drain)


class AdminServer:
    """Serves the control endpoint for one ``LocalCluster`` on a thread; ``address`` once started."""

    def __init__(self, cluster: LocalCluster, port: int = 0) -> None:
        self.cluster = cluster
        self.lock = threading.Lock()  # one scaling at a time
        admin = self

        class Handler(_Handler):
            server_admin = admin

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="tandem-up-admin")
        self.state_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def start(self, state_path: Path | None = None) -> None:
        self.thread.start()
        if state_path is not None:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            state_path.write_text(json.dumps({"admin": self.address, "pid": os.getpid(),
                                              "coordinator": self.cluster.coordinator.address}) + "\n")
            self.state_path = state_path

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
                    self.cluster.add_workers(role, want - have)
                else:
                    self.cluster.remove_workers(role, have - want, drain_timeout_s)
            return self.fleet()


class _Handler(BaseHTTPRequestHandler):
    server_admin: AdminServer

    def log_message(self, *args: Any) -> None:  # `tandem up` prints what matters itself
        pass

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        if self.path != "/fleet":
            return self._reply(404, {"error": f"no such endpoint {self.path}; GET /fleet or POST /scale"})
        self._reply(200, self.server_admin.fleet())

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/scale":
            return self._reply(404, {"error": f"no such endpoint {self.path}; GET /fleet or POST /scale"})
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            fleet = self.server_admin.scale(*parse_scale(body))
        except (json.JSONDecodeError, InvalidRequestError, ValueError) as exc:
            return self._reply(400, {"error": str(exc)})
        except (RuntimeError, TimeoutError) as exc:  # a new worker exited or did not come up
            return self._reply(500, {"error": str(exc)})
        self._reply(200, fleet)

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        send_json(self, code, body)


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
    """One JSON reply with its length (the connection stays usable for the next request)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
