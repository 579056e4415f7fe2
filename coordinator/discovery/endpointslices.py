"""Kubernetes discovery: a list+watch of a Service's EndpointSlices (``discovery.k8s.io/v1``).

The ``kubernetes`` client is synchronous, so the list and the watch run on a
thread that hands every new set of addresses to the event loop. The protocol,
as an informer follows it:

- list the slices labelled ``kubernetes.io/service-name=<service>``, then
  watch from the list's ``resourceVersion``, asking for bookmarks;
- every event (bookmarks included) moves the version we would resume from;
- when a watch ends (the server's ``timeoutSeconds``, a cut connection), watch
  again from that version, after a backoff that grows while streams bring
  nothing and resets when one does;
- 410 Gone (the version left the server's history window): list again.

An endpoint is routable when its ``ready`` condition is not false (unset means
ready) and it is not ``terminating``; one that turns terminating, or goes away,
is dropped from the set, and the pool lets its requests drain.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.discovery.dns import host_port

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; we then watch again from where we were
CONNECT_TIMEOUT_S = 10.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 30.0
HTTP_GONE = 410


def pod_namespace(default: str = "default") -> str:
    """The namespace this pod runs in (from its service account), else ``default``."""
    try:
        return NAMESPACE_FILE.read_text().strip() or default
    except OSError:
        return default


def routable_addresses(slices: dict[str, dict[str, Any]], port: int | None) -> frozenset[str]:
    """``HOST:PORT`` of every ready, non-terminating endpoint in these slices.

    The port is ``port`` when given, else the slice's port named ``grpc``, else its first port.
    """
    out: set[str] = set()
    for obj in slices.values():
        slice_port = port or _slice_port(obj)
        if slice_port is None:
            continue
        for endpoint in obj.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:  # consumers use the first address of an endpoint (the API's own rule)
                out.add(host_port(addresses[0], slice_port))
    return frozenset(out)


def _slice_port(obj: dict[str, Any]) -> int | None:
    ports = [p for p in obj.get("ports") or [] if p.get("port")]
    named = [p for p in ports if p.get("name") == "grpc"]
    return int((named or ports)[0]["port"]) if ports else None


class _Backoff:
    def __init__(self) -> None:
        self.next_s = BACKOFF_FIRST_S

    def take(self) -> float:
        delay, self.next_s = self.next_s, min(BACKOFF_MAX_S, self.next_s * 2)
        return delay

    def reset(self) -> None:
        self.next_s = BACKOFF_FIRST_S


def _raw_watch() -> Any:
    """The client's Watch, yielding events as plain JSON dicts (``raw_object``): no model deserialization,
    which is wasted work here and could refuse a field newer than the client knows."""
    from kubernetes import watch

    class RawWatch(watch.Watch):
        def get_return_type(self, func: Any) -> None:
            return None

    return RawWatch()


class EndpointSliceSource:
    def __init__(self, role: str, service: str, namespace: str | None, port: int | None,
                 kubeconfig: str | None = None, watch_timeout_s: int = WATCH_TIMEOUT_S) -> None:
        self.role = role
        self.service = service
        self.namespace = namespace or pod_namespace()
        self.port = port
        self.kubeconfig = kubeconfig
        self.watch_timeout_s = watch_timeout_s
        self.selector = f"{SERVICE_LABEL}={service}"
        self.relists = 0  # how many times the state was listed afresh (at start, and after 410 Gone)

    def _api(self) -> Any:
        """Config from --kubeconfig when given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        configuration = client.Configuration()
        if self.kubeconfig:
            config.load_kube_config(config_file=self.kubeconfig, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)
        return client.DiscoveryV1Api(client.ApiClient(configuration))

    async def watch(self) -> AsyncIterator[frozenset[str]]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[frozenset[str]] = asyncio.Queue()
        stop = threading.Event()
        current: list[Any] = [None]  # the Watch in progress, so that closing can cut its stream

        def publish(addresses: frozenset[str]) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, addresses)

        api = self._api()  # here, not on the thread: a missing or broken config fails where it is reported
        thread = threading.Thread(target=self._run, args=(api, publish, stop, current), daemon=True,
                                  name=f"endpointslices-{self.role}")
        thread.start()
        last: frozenset[str] | None = None
        try:
            while True:
                addresses = await updates.get()
                if addresses != last:
                    last = addresses
                    yield addresses
        finally:
            stop.set()
            if current[0] is not None:
                current[0].stop()

    # ----- on the watch thread ------------------------------------------------------
    def _run(self, api: Any, publish: Callable[[frozenset[str]], None], stop: threading.Event,
             current: list[Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = _Backoff()
        cursor = _Cursor()
        while not stop.is_set():
            try:
                if cursor.version is None:
                    cursor.slices, cursor.version = self._list(api)
                    self.relists += 1
                    publish(routable_addresses(cursor.slices, self.port))
                if self._watch_once(api, cursor, publish, stop, current):
                    backoff.reset()
                delay = backoff.take()
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("%s EndpointSlices: resourceVersion %s expired; listing again", self.role, cursor.version)
                    cursor.version = None
                    continue
                delay = backoff.take()
                log.warning("%s EndpointSlices: API error %s (%s); retrying in %.1fs",
                            self.role, exc.status, exc.reason, delay)
            except Exception as exc:  # noqa: BLE001 - connection refused, reset, timeouts: the API may be restarting
                delay = backoff.take()
                if stop.is_set():
                    return
                log.warning("%s EndpointSlices: %s; retrying in %.1fs", self.role, exc, delay)
            stop.wait(delay)

    def _list(self, api: Any) -> tuple[dict[str, dict[str, Any]], str]:
        resp = api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector,
                                                  _preload_content=False, _request_timeout=CONNECT_TIMEOUT_S * 3)
        listing = json.loads(resp.data)
        slices = {item["metadata"]["name"]: item for item in listing.get("items") or []}
        return slices, listing["metadata"]["resourceVersion"]

    def _watch_once(self, api: Any, cursor: _Cursor, publish: Callable[[frozenset[str]], None],
                    stop: threading.Event, current: list[Any]) -> bool:
        """One watch stream from the cursor's version to the stream's end, moving the cursor with every event
        (so that a stream cut mid-way resumes after the last event it delivered); True if any event came."""
        watcher = _raw_watch()
        current[0] = watcher
        changed = False
        try:
            for event in watcher.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                        label_selector=self.selector, resource_version=cursor.version,
                                        allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                                        _request_timeout=(CONNECT_TIMEOUT_S, self.watch_timeout_s + 30)):
                if stop.is_set():
                    break
                changed = True
                obj = event["raw_object"]
                metadata = obj.get("metadata") or {}
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED"):
                    cursor.slices[metadata["name"]] = obj
                elif kind == "DELETED":
                    cursor.slices.pop(metadata["name"], None)
                cursor.version = metadata.get("resourceVersion") or cursor.version  # before anyone hears of it
                if kind != "BOOKMARK":  # a bookmark only moves the version: nothing changed
                    publish(routable_addresses(cursor.slices, self.port))
        finally:
            current[0] = None
        return changed


@dataclass(slots=True)
class _Cursor:
    """What the watch thread knows: the selected slices by name, and the version to resume from
    (None: list afresh)."""

    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: str | None = None
