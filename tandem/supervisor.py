"""Keep a local cluster's processes running: restart what exits, with a backoff and a bound on restarts.

What Kubernetes does for `tandem serve` pods, `tandem up` does with this: a
worker (or the coordinator) that exits while nobody asked it to is reported,
left out of routing by the coordinator (its requests move to the replicas
that are left), and replaced by a new process after a backoff that doubles
with each restart of its role since one of its processes last ran for
``stable_s`` (``RestartPolicy``): a crash loop backs off, and a replica that
served for minutes before it was killed (out of memory, a device fault) comes
back after the first backoff, as Kubernetes resets a pod's back-off once its
container has run a while. When a role has
been restarted ``max_restarts`` times within ``window_s`` and exits again,
restarting is not helping (a model that cannot load, a machine out of
memory): the supervisor gives up and says why, and `tandem up` stops.

Scaling (``tandem scale``) and restarts change the fleet one at a time: both
hold the same lock. A worker that scaling removes leaves ``services`` before it
is stopped, so only an unexpected exit is ever restarted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.cluster import LocalCluster, Service


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    """How soon and how often the processes of one role are restarted."""

    max_restarts: int = 5  # per role within window_s; the next exit after that gives up
    window_s: float = 600.0
    backoff_s: float = 1.0  # before the first restart; doubles with each restart since the role last ran stable_s
    max_backoff_s: float = 60.0
    # A process that ran this long before it exited was not crash-looping: its role's backoff starts again at
    # backoff_s. Before, every restart in the window doubled it: a chaos run (a worker killed every 8-16 s) had
    # its targets' next restart 60 s away after 7 restarts, and a replica that served for minutes between two
    # out-of-memory kills would wait as long. (A role whose processes keep dying within a minute still backs off.)
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"the restart window must be > 0 seconds, got {self.window_s}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= backoff ({self.backoff_s}s) <= max backoff ({self.max_backoff_s}s)")

    def delay(self, restarts: int) -> float:
        """Seconds to wait before the next restart of a role restarted ``restarts`` times since it last ran stably."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** restarts)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Supervisor:
    """Watches ``cluster.services`` on a thread (``start``/``stop``); ``gave_up`` says why it stopped trying.

    ``stopping`` is set when it gives up, so that the launcher waiting on it stops the system.
    """

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy, lock: threading.Lock,
                 stopping: threading.Event, say: Callable[[str], None] = _say, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.policy, self.lock, self.stopping = cluster, policy, lock, stopping
        self.say, self.poll_s, self.clock = say, poll_s, clock
        self.gave_up: str | None = None
        self._due: dict[int, float] = {}  # id(dead service) -> when its replacement starts
        self._restarts: dict[str, list[float]] = {}  # role -> when its restarts began, within the window
        self._streak: dict[str, int] = {}  # role -> restarts since one of its processes last ran stable_s
        self._seen: dict[int, float] = {}  # id(live service) -> when it was first seen running
        self._thread = threading.Thread(target=self._run, daemon=True, name="tandem-supervisor")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (``stopping`` set); a replacement that is starting ends when the cluster stops."""
        self.stopping.set()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self.stopping.wait(self.poll_s):
                self.check()
        except Exception as exc:  # unwatched processes would go unnoticed: stop rather than run on blind
            self.gave_up = f"the supervisor failed ({exc!r}); stopping"
            self.say(self.gave_up)
            self.stopping.set()

    def check(self) -> None:
        """One look: report each newly exited process and schedule it; replace those whose backoff is over."""
        with self.lock:
            for service in list(self.cluster.services):
                if self.stopping.is_set():
                    return
                if service.process.poll() is None:
                    self._seen.setdefault(id(service), self.clock())
                    continue
                if id(service) not in self._due:
                    self._schedule(service)
                elif self.clock() >= self._due[id(service)]:
                    self._replace(service)
            live = {id(s) for s in self.cluster.services}
            self._due = {key: due for key, due in self._due.items() if key in live}  # scaled away meanwhile
            self._seen = {key: seen for key, seen in self._seen.items() if key in live}

    def _recent(self, role: str) -> list[float]:
        horizon = self.clock() - self.policy.window_s
        recent = self._restarts[role] = [t for t in self._restarts.get(role, []) if t > horizon]
        return recent

    def _schedule(self, service: Service, what: str | None = None) -> None:
        """Report ``service`` dead (``what`` happened; default: it exited) and set when it is replaced, or
        give up when its role has used up its restarts."""
        what = what or (f"{service.name} ({service.address}, pid {service.process.pid}) exited "
                        f"(code {service.process.returncode})")
        recent = self._recent(service.role)
        if len(recent) >= self.policy.max_restarts:
            self.gave_up = (f"{what} after {len(recent)} restarts of {service.role} in "
                            f"{self.policy.window_s:.0f}s; giving up (log: {service.log_path})")
            self.say(self.gave_up)
            self.stopping.set()
            return
        seen = self._seen.pop(id(service), None)
        if seen is not None and self.clock() - seen >= self.policy.stable_s:
            self._streak[service.role] = 0  # it ran long enough: not a crash loop
        delay = self.policy.delay(self._streak.get(service.role, 0))
        self._due[id(service)] = self.clock() + delay
        self.say(f"{what}; restarting it in {delay:.0f}s (restart {len(recent) + 1} of at most "
                 f"{self.policy.max_restarts} per {self.policy.window_s:.0f}s); the others keep serving")

    def _replace(self, dead: Service) -> None:
        self._recent(dead.role).append(self.clock())
        self._streak[dead.role] = self._streak.get(dead.role, 0) + 1
        try:
            new = self.cluster.replace(dead)
        except (RuntimeError, TimeoutError) as exc:
            if not self.stopping.is_set():
                first_line = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
                self._schedule(dead, f"restarting {dead.name} failed ({first_line})")
            return
        self._due.pop(id(dead))
        self.say(f"{new.name} ({new.address}, pid {new.process.pid}) serving in place of {dead.name}")
