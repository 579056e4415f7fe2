"""`--dist loadgroup` that works: the tests of one ``xdist_group`` run on one pytest-xdist worker.

Why: the integration tests share one running system of SmolLM2 workers (``shared_cluster``, a session
fixture). Spread over two workers, each starts a system of its own: twice the start-up (a minute of
both cores) and the memory. Grouped, one worker starts it and runs every test on it, the other takes
everything else, and no two tests ever use it at once.

Why not xdist's own loadgroup: xdist 3.8 names a grouped test ``nodeid@group`` by assigning
``item._nodeid``, which pytest 9.2 no longer reads (a node's id is ``item._id`` now), so every group
is silently ignored and the run degrades to plain ``--dist load``. This plugin uses only public hooks:
each worker writes the group of every test it collected (from its ``xdist_group`` marks) to a file
in a directory the controller hands it (``pytest_configure_node``), and the controller's scheduler,
xdist's ``LoadScopeScheduling`` with scope = group, reads it once every worker has collected. A test
with no group is a scope of its own, as under ``--dist load``; the largest scope is handed out first.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

WORKER_INPUT_KEY = "tandem_xdist_groups_dir"


def group_of(item: pytest.Item) -> str | None:
    """The item's group: the names of its ``xdist_group`` marks, joined as xdist joins them."""
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None


class GroupScheduling(LoadScopeScheduling):
    """Scope = the test's group (read from the workers' files), or the test itself."""

    def __init__(self, config: pytest.Config, log, groups_dir: Path) -> None:
        super().__init__(config, log)
        self._groups_dir = groups_dir
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            files = sorted(self._groups_dir.glob("*.json"))
            if not files:
                raise RuntimeError(f"no xdist worker wrote its test groups into {self._groups_dir}")
            self._groups = json.loads(files[0].read_text())  # every worker collected the same tests
        return self._groups.get(nodeid, nodeid)


class ControllerPlugin:
    """On the controller (``-n N --dist loadgroup``): a directory for the workers' groups, and the scheduler."""

    def __init__(self) -> None:
        self.groups_dir = Path(tempfile.mkdtemp(prefix="tandem-xdist-groups-"))

    def pytest_configure_node(self, node) -> None:
        node.workerinput[WORKER_INPUT_KEY] = str(self.groups_dir)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        return GroupScheduling(config, log, self.groups_dir)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.groups_dir, ignore_errors=True)


class WorkerPlugin:
    """On each worker: after collection, every grouped test's node id and group, as the controller sees them."""

    def __init__(self, groups_dir: Path, worker_id: str) -> None:
        self.path = groups_dir / f"{worker_id}.json"

    @pytest.hookimpl(trylast=True)  # after every other hook that marks or renames items
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
        self.path.write_text(json.dumps(groups))


def register(config: pytest.Config) -> None:
    """Install the controller's or the worker's half, under ``-n N --dist loadgroup`` only."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        if WORKER_INPUT_KEY in workerinput:
            config.pluginmanager.register(WorkerPlugin(Path(workerinput[WORKER_INPUT_KEY]), workerinput["workerid"]))
    elif config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None):
        config.pluginmanager.register(ControllerPlugin())
