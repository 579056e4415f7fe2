"""The supervisor's decisions, on a fake fleet and a fake clock: when a dead process is replaced, and when
restarting stops (tests/integration/test_up_restarts.py kills a real worker under `tandem up`)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tandem.supervisor import RestartPolicy, Supervisor


class Process:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self.returncode


def service(role: str, index: int) -> SimpleNamespace:
    return SimpleNamespace(role=role, name=f"{role}-{index}", address=f"127.0.0.1:{1000 + index}",
                           process=Process(index), log_path=f"{role}-{index}.log")


class Fleet:
    """``services`` and ``replace`` as LocalCluster has them; ``fail`` makes the next replacements not come up."""

    def __init__(self, *services: SimpleNamespace) -> None:
        self.services = list(services)
        self.replaced: list[str] = []
        self.fail = 0

    def replace(self, dead: SimpleNamespace) -> SimpleNamespace:
        self.replaced.append(dead.name)
        if self.fail:
            self.fail -= 1
            raise RuntimeError(f"{dead.role} exited with code 1:\nTraceback ...")
        new = service(dead.role, 10 + len(self.replaced))
        self.services[self.services.index(dead)] = new
        return new


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def supervisor(fleet: Fleet, clock: Clock, **policy) -> tuple[Supervisor, list[str]]:
    said: list[str] = []
    return Supervisor(fleet, RestartPolicy(**policy), threading.Lock(), threading.Event(),  # type: ignore[arg-type]
                      say=said.append, clock=clock), said


def test_a_dead_worker_is_reported_then_replaced_after_its_backoff_and_the_others_are_left_alone():
    fleet, clock = Fleet(service("target", 0), service("target", 1), service("coordinator", 2)), Clock()
    watch, said = supervisor(fleet, clock, backoff_s=2.0)
    watch.check()
    assert fleet.replaced == [] and said == []  # nothing exited
    fleet.services[0].process.returncode = -9
    watch.check()
    assert fleet.replaced == [] and "target-0 (127.0.0.1:1000, pid 0) exited (code -9); restarting it in 2s" in said[0]
    clock.now = 1.9
    watch.check()
    assert fleet.replaced == []  # still backing off
    clock.now = 2.0
    watch.check()
    assert fleet.replaced == ["target-0"] and "serving in place of target-0" in said[-1]
    assert [s.name for s in fleet.services] == ["target-11", "target-1", "coordinator-2"]
    assert watch.gave_up is None and not watch.stopping.is_set()


def test_the_backoff_doubles_with_each_recent_restart_and_a_failed_start_counts():
    fleet, clock = Fleet(service("draft", 0)), Clock()
    watch, said = supervisor(fleet, clock, backoff_s=1.0, max_backoff_s=3.0, max_restarts=5)
    fleet.services[0].process.returncode = 1
    fleet.fail = 2
    delays = []
    for _ in range(3):
        watch.check()  # seen: scheduled
        delays.append(said[-1].split("restarting it in ")[1].split("s ")[0])
        clock.now += 10
        watch.check()  # due: replaced (the first two fail to come up)
    assert delays == ["1", "2", "3"]  # doubling, capped at max_backoff_s
    assert said[1].startswith("restarting draft-0 failed (draft exited with code 1); restarting it in 2s")
    assert fleet.replaced == ["draft-0"] * 3 and fleet.services[0].name == "draft-13"


def test_a_process_that_ran_a_while_before_it_died_comes_back_after_the_first_backoff():
    """The backoff doubles with each restart since the role last ran ``stable_s``: a crash loop backs off, a replica
    killed after serving for minutes (out of memory) does not wait out its role's earlier restarts."""
    fleet, clock = Fleet(service("target", 0)), Clock()
    watch, said = supervisor(fleet, clock, backoff_s=1.0, max_backoff_s=60.0, stable_s=60.0, max_restarts=10)

    def die_after(seconds: float) -> str:
        watch.check()  # seen running
        clock.now += seconds
        fleet.services[0].process.returncode = -9
        watch.check()  # seen dead: scheduled
        delay = said[-1].split("restarting it in ")[1].split("s ")[0]
        clock.now += 100
        watch.check()  # replaced
        return delay

    assert [die_after(5) for _ in range(3)] == ["1", "2", "4"]  # dying soon after each start: a crash loop
    assert die_after(59) == "8"
    assert die_after(60) == "1"  # it served a minute: the backoff starts again
    assert die_after(1) == "2"
    assert len(fleet.replaced) == 6 and watch.gave_up is None


def keep_killing(times: int, every_s: float) -> Supervisor:
    """A one-target fleet whose target exits ``times`` times, ``every_s`` apart (no backoff, 2 restarts per 100 s)."""
    fleet, clock = Fleet(service("target", 0)), Clock()
    watch, _ = supervisor(fleet, clock, backoff_s=0.0, max_restarts=2, window_s=100.0)
    for _ in range(times):
        fleet.services[0].process.returncode = 1
        watch.check()  # seen
        watch.check()  # replaced, unless given up
        clock.now += every_s
    return watch


def test_a_role_that_keeps_dying_stops_everything_once_its_restarts_run_out_in_the_window():
    watch = keep_killing(3, every_s=10)
    assert watch.gave_up is not None and "after 2 restarts of target in 100s; giving up" in watch.gave_up
    assert watch.stopping.is_set() and len(watch.cluster.replaced) == 2
    # Restarts older than the window do not count: a worker dying now and then is restarted every time.
    watch = keep_killing(5, every_s=101)
    assert len(watch.cluster.replaced) == 5 and watch.gave_up is None


def test_a_dead_worker_that_scaling_removed_meanwhile_is_not_replaced():
    fleet, clock = Fleet(service("target", 0), service("target", 1)), Clock()
    watch, _ = supervisor(fleet, clock, backoff_s=5.0)
    fleet.services[1].process.returncode = -9
    watch.check()
    fleet.services.pop()  # `tandem scale --target-replicas 1` took it out
    clock.now = 10
    watch.check()
    assert fleet.replaced == []


@pytest.mark.parametrize("policy,complaint", [
    (dict(max_restarts=-1), "max_restarts must be >= 0"),
    (dict(window_s=0), "restart window must be > 0"),
    (dict(backoff_s=10, max_backoff_s=5), "backoff"),
])
def test_a_restart_policy_that_cannot_work_is_refused(policy, complaint):
    with pytest.raises(ValueError, match=complaint):
        RestartPolicy(**policy)
