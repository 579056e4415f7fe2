"""A local stand-in for the Kubernetes API server, for EndpointSlices only (no kube-apiserver runs here).

It speaks the real protocol of ``/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``
over HTTP/1.1 on 127.0.0.1, as far as a list+watch client relies on it:

- GET list: an ``EndpointSliceList`` whose ``metadata.resourceVersion`` is the store's version; items
  without kind/apiVersion, as the API serves typed lists;
- GET ``?watch=true``: a chunked stream of one JSON event per line, ``{"type": "ADDED|MODIFIED|DELETED|
  BOOKMARK|ERROR", "object": ...}``; from ``resourceVersion`` N it sends every change after N (unset or
  "0": synthetic ADDED events for the current objects first); a version older than the retained history
  gets an ERROR event carrying a 410 ``Status`` (reason Expired, "too old resource version"), which is
  how the API's watch cache answers; ``allowWatchBookmarks=true`` lets BOOKMARK events through (an object
  with only ``metadata.resourceVersion``); ``timeoutSeconds`` ends the stream cleanly;
- ``labelSelector`` with ``=``, ``==``, ``!=``, ``in``, ``notin``, ``key`` and ``!key``; an object whose
  labels stop (start) matching reaches a watcher as DELETED (ADDED), as the API does;
- one resourceVersion counter for the whole store, increasing with every write (the API's is etcd's
  revision: opaque to clients, increasing in fact); a DELETED event carries the deletion's version;
- a bearer token, checked on every request (401 ``Status`` otherwise).

Test-side: ``apply`` / ``delete`` slices, ``touch_other`` (a write the selector does not match: only the
version moves), ``bookmark`` (send one to every watcher that asked), ``compact`` (expire the history:
watches from an older version get 410), ``cut_watches`` (drop every watch connection without ending it),
``kubeconfig`` (a file that points the ``kubernetes`` client here) and ``requests`` (what was asked).
Holding ``cond`` (a re-entrant lock) makes several writes one moment: no watch can start in between.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tandem.up_admin import send_json

PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([a-z0-9-]+)/endpointslices$")
GROUP_VERSION = "discovery.k8s.io/v1"
SERVICE_LABEL = "kubernetes.io/service-name"


# ----- label selectors ------------------------------------------------------------------------
def _split_requirements(selector: str) -> list[str]:
    """Split on commas that are not inside ``( )``."""
    parts, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


_SET = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")
_EQ = re.compile(r"^([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)$")
_EXISTS = re.compile(r"^(!?)([\w./-]+)$")


class SelectorError(ValueError):
    pass


def parse_selector(selector: str) -> list[tuple[str, str, frozenset[str]]]:
    """``(key, op, values)`` per requirement; op one of = != in notin exists !exists."""
    reqs = []
    for part in _split_requirements(selector):
        if m := _SET.match(part):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append((m.group(1), m.group(2), values))
        elif m := _EQ.match(part):
            op = "!=" if m.group(2) == "!=" else "="
            reqs.append((m.group(1), op, frozenset([m.group(3)])))
        elif m := _EXISTS.match(part):
            reqs.append((m.group(2), "!exists" if m.group(1) else "exists", frozenset()))
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return reqs


def matches(reqs: list[tuple[str, str, frozenset[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in reqs:
        value = labels.get(key)
        ok = {"=": value in values, "in": value in values,
              "!=": value not in values, "notin": value not in values,
              "exists": key in labels, "!exists": key not in labels}[op]
        if not ok:
            return False
    return True


# ----- objects ----------------------------------------------------------------------------------
def endpoint(address: str, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    conditions: dict[str, Any] = {"serving": bool(ready), "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {"addresses": [address], "conditions": conditions,
            "targetRef": {"kind": "Pod", "name": f"pod-{address.replace('.', '-')}"}}


def endpoint_slice(name: str, service: str, endpoints: list[dict[str, Any]], port: int,
                   port_name: str = "grpc", extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it (without server-set metadata)."""
    labels = {SERVICE_LABEL: service, "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
              **(extra_labels or {})}
    return {"metadata": {"name": name, "labels": labels,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service}]},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


@dataclass
class _Event:
    version: int
    namespace: str
    kind: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    before: dict[str, Any] | None  # the object before this write (None when ADDED)


@dataclass
class _Watcher:
    namespace: str
    selector: list
    bookmarks: bool
    sent_version: int
    bookmark_pending: bool = False
    cut: bool = False
    queue: list[dict[str, Any]] = field(default_factory=list)


class KubeApiStub:
    """Start with ``start()`` (or ``with``); the API is at ``url``."""

    def __init__(self, token: str = "stub-token", first_version: int = 1000) -> None:
        self.token = token
        self.version = first_version
        self.oldest_version = first_version  # watches from before this get 410 Gone
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[_Event] = []
        self.watchers: list[_Watcher] = []
        self.requests: list[dict[str, Any]] = []  # every request's path and query, in order
        self.bookmarks_sent = 0
        self.cond = threading.Condition()
        stub = self

        class Handler(_Handler):
            api = stub

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> KubeApiStub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.cut_watches()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> KubeApiStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig (YAML is a superset of JSON) that points a client at this stub with its token."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": self.token}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": namespace}}],
        }
        Path(path).write_text(json.dumps(config))
        return Path(path)

    # ----- writes (test side) -----------------------------------------------------------------
    def apply(self, namespace: str, obj: dict[str, Any]) -> int:
        """Create or replace a slice; returns its new resourceVersion."""
        with self.cond:
            name = obj["metadata"]["name"]
            before = self.objects.get((namespace, name))
            self.version += 1
            stored = copy.deepcopy(obj)
            stored["metadata"].update(namespace=namespace, resourceVersion=str(self.version),
                                      uid=(before or {}).get("metadata", {}).get("uid", f"uid-{name}"))
            self.objects[(namespace, name)] = stored
            self.events.append(_Event(self.version, namespace, "MODIFIED" if before else "ADDED", stored, before))
            self.cond.notify_all()
            return self.version

    def delete(self, namespace: str, name: str) -> int:
        with self.cond:
            before = self.objects.pop((namespace, name))
            self.version += 1
            gone = copy.deepcopy(before)
            gone["metadata"]["resourceVersion"] = str(self.version)
            self.events.append(_Event(self.version, namespace, "DELETED", gone, before))
            self.cond.notify_all()
            return self.version

    def touch_other(self, namespace: str = "default") -> int:
        """A write to a slice of another Service: the version moves, selected watchers see nothing."""
        return self.apply(namespace, endpoint_slice("unrelated-x", "unrelated", [endpoint("10.9.9.9")], 80))

    def bookmark(self) -> None:
        """Ask every watcher that allowed bookmarks to get one at the current version."""
        with self.cond:
            for watcher in self.watchers:
                watcher.bookmark_pending = watcher.bookmarks
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: only watches from the current version on can start."""
        with self.cond:
            self.oldest_version = self.version

    def cut_watches(self) -> None:
        """Drop every open watch connection mid-stream (no final chunk), as a restarting API server would."""
        with self.cond:
            for watcher in self.watchers:
                watcher.cut = True
            self.cond.notify_all()

    def open_watches(self) -> int:
        with self.cond:
            return len(self.watchers)

    def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        """Block until ``predicate(stub)`` holds (tests wait for a client to reconnect)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError("the stub did not see what the test waited for")
            time.sleep(0.02)

    # ----- reads (the HTTP side) ------------------------------------------------------------
    def list(self, namespace: str, selector: list) -> dict[str, Any]:
        with self.cond:
            items = []
            for (ns, _), obj in sorted(self.objects.items()):
                if ns == namespace and matches(selector, obj["metadata"].get("labels", {})):
                    items.append(copy.deepcopy(obj))
            return {"kind": "EndpointSliceList", "apiVersion": GROUP_VERSION,
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}

    def open_watch(self, namespace: str, selector: list, version: str, bookmarks: bool) -> _Watcher | dict:
        """A new watcher, or a 410 Status when ``version`` is older than the retained history."""
        with self.cond:
            if version in ("", "0"):
                watcher = _Watcher(namespace, selector, bookmarks, self.version)
                for (ns, _), obj in sorted(self.objects.items()):
                    if ns == namespace and matches(selector, obj["metadata"].get("labels", {})):
                        watcher.queue.append({"type": "ADDED", "object": _typed(obj)})
            else:
                start = int(version)
                if start < self.oldest_version:
                    return status(410, "Expired", f"too old resource version: {start} ({self.oldest_version})")
                watcher = _Watcher(namespace, selector, bookmarks, start)
            self.watchers.append(watcher)
            return watcher

    def close_watch(self, watcher: _Watcher) -> None:
        with self.cond:
            self.watchers.remove(watcher)

    def next_events(self, watcher: _Watcher, wait_s: float) -> list[dict[str, Any]] | None:
        """Events for this watcher (possibly none after ``wait_s``); None once it has been cut."""
        with self.cond:
            self.cond.wait_for(lambda: watcher.cut or watcher.queue or watcher.bookmark_pending
                               or self.version > watcher.sent_version, timeout=wait_s)
            if watcher.cut:
                return None
            out, watcher.queue = watcher.queue, []
            for event in self.events:
                if event.version <= watcher.sent_version or event.namespace != watcher.namespace:
                    continue
                now = matches(watcher.selector, event.obj["metadata"].get("labels", {})) and event.kind != "DELETED"
                was = event.before is not None and matches(watcher.selector, event.before["metadata"].get("labels", {}))
                if event.kind == "DELETED" and was:
                    out.append({"type": "DELETED", "object": _typed(event.obj)})
                elif now and was:
                    out.append({"type": "MODIFIED", "object": _typed(event.obj)})
                elif now:
                    out.append({"type": "ADDED", "object": _typed(event.obj)})
                elif was:  # its labels stopped matching: gone, as far as this watcher knows
                    out.append({"type": "DELETED", "object": _typed(event.obj)})
            watcher.sent_version = self.version
            if watcher.bookmark_pending:
                watcher.bookmark_pending = False
                self.bookmarks_sent += 1
                out.append({"type": "BOOKMARK", "object": {
                    "kind": "EndpointSlice", "apiVersion": GROUP_VERSION,
                    "metadata": {"resourceVersion": str(self.version), "creationTimestamp": None}}})
            return out


def _typed(obj: dict[str, Any]) -> dict[str, Any]:
    """Objects in watch events carry their kind and apiVersion."""
    return {"kind": "EndpointSlice", "apiVersion": GROUP_VERSION, **copy.deepcopy(obj)}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked watch streams, keep-alive between list calls
    api: KubeApiStub

    def log_message(self, *args: Any) -> None:  # quiet: the tests read ``requests`` instead
        pass

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self.api.requests.append({"path": url.path, **query})
        if self.headers.get("Authorization") != f"Bearer {self.api.token}":
            return self._json(401, status(401, "Unauthorized", "Unauthorized"))
        match = PATH.match(url.path)
        if not match:
            return self._json(404, status(404, "NotFound", "the server could not find the requested resource"))
        try:
            selector = parse_selector(query.get("labelSelector", ""))
        except SelectorError as exc:
            return self._json(400, status(400, "BadRequest", f"unable to parse requirement: {exc}"))
        namespace = match.group(1)
        if query.get("watch") in ("true", "1"):
            return self._watch(namespace, selector, query)
        return self._json(200, self.api.list(namespace, selector))

    def _json(self, code: int, body: dict[str, Any]) -> None:
        send_json(self, code, body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, namespace: str, selector: list, query: dict[str, str]) -> None:
        opened = self.api.open_watch(namespace, selector, query.get("resourceVersion", ""),
                                     query.get("allowWatchBookmarks") == "true")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if isinstance(opened, dict):  # 410 Gone: the watch cache says so as an ERROR event, then ends
            self._chunk(json.dumps({"type": "ERROR", "object": opened}).encode() + b"\n")
            self._chunk(b"")
            return
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                events = self.api.next_events(opened, min(left, 0.2))
                if events is None:  # cut: drop the connection with no final chunk
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                for event in events:
                    self._chunk(json.dumps(event).encode() + b"\n")
            self._chunk(b"")  # timeoutSeconds reached: a clean end of the stream
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.api.close_watch(opened)
