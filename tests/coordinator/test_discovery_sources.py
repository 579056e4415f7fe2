"""Discovery sources, each against the real thing it reads: a workers file, the resolver, and the
Kubernetes list/watch protocol (``tests.kube_api_stub``, spoken over HTTP to the real ``kubernetes`` client)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from coordinator.discovery.dns import DnsSource
from coordinator.discovery.endpointslices import EndpointSliceSource, routable_addresses
from coordinator.discovery.workers_file import WorkersFileSource
from tandem.errors import InvalidRequestError
from tandem.workers_file import parse_workers, write_workers
from tests.kube_api_stub import KubeApiStub, endpoint, endpoint_slice, matches, parse_selector

NS = "serving"


async def next_set(updates, timeout_s: float = 15.0) -> frozenset[str]:
    return await asyncio.wait_for(updates.__anext__(), timeout_s)


async def until(updates, expected: set[str], timeout_s: float = 15.0) -> None:
    """Read sets until one equals ``expected``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (got := await next_set(updates, max(0.1, deadline - loop.time()))) != expected:
        pass
    assert got == expected


# ----- workers file ----------------------------------------------------------------------------
def test_the_workers_file_is_re_read_when_it_changes_and_a_broken_one_keeps_the_fleet(tmp_path):
    path = tmp_path / "workers.json"
    write_workers(path, {"target": ["127.0.0.1:1"], "draft": ["127.0.0.1:2"]})

    async def scenario():
        targets = WorkersFileSource("target", path, interval_s=0.02).watch()
        drafts = WorkersFileSource("draft", path, interval_s=0.02).watch()
        assert await next_set(targets) == {"127.0.0.1:1"}
        assert await next_set(drafts) == {"127.0.0.1:2"}
        write_workers(path, {"target": ["127.0.0.1:1", "127.0.0.1:3"], "draft": []})
        assert await next_set(targets) == {"127.0.0.1:1", "127.0.0.1:3"}
        assert await next_set(drafts) == frozenset()
        path.write_text("{not json")  # a half-edited file must not empty the fleet: nothing is yielded
        await asyncio.sleep(0.3)
        write_workers(path, {"target": ["127.0.0.1:3"]})
        assert await next_set(targets) == {"127.0.0.1:3"}  # the next set is the repaired file's
        await targets.aclose()
        await drafts.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("text,complaint", [
    ("[]", "expected an object"),
    ('{"targets": []}', "unknown keys"),
    ('{"target": "127.0.0.1:1"}', "must be a list"),
    ('{"target": ["nohost"]}', "is not HOST:PORT"),
])
def test_a_malformed_workers_file_is_refused_naming_what_is_wrong(text, complaint):
    with pytest.raises(InvalidRequestError, match=complaint):
        parse_workers(text, "w.json")


# ----- DNS -----------------------------------------------------------------------------------------
def test_dns_yields_every_record_of_the_name_with_the_port_and_nothing_for_a_name_without_records():
    async def scenario():
        found = await DnsSource("target", "localhost", 50052).resolve()
        missing = await DnsSource("target", "no-such-service.invalid", 50052).resolve()
        return found, missing

    found, missing = asyncio.run(scenario())
    assert "127.0.0.1:50052" in found and all(a.endswith(":50052") for a in found)
    assert all(a.startswith("[") for a in found if a.count(":") > 1)  # IPv6 in brackets
    assert missing == frozenset()


# ----- the stand-in itself ---------------------------------------------------------------------
@pytest.mark.parametrize("selector,labels,expected", [
    ("app=a", {"app": "a"}, True),
    ("app==a", {"app": "b"}, False),
    ("app!=a", {}, True),
    ("app in (a, b),tier notin (x)", {"app": "b", "tier": "y"}, True),
    ("app in (a,b),tier notin (x)", {"app": "b", "tier": "x"}, False),
    ("app,!legacy", {"app": "z"}, True),
    ("app,!legacy", {"app": "z", "legacy": ""}, False),
])
def test_the_stub_evaluates_label_selectors_as_the_api_does(selector, labels, expected):
    assert matches(parse_selector(selector), labels) is expected


def test_the_stub_lists_only_selected_slices_and_refuses_a_missing_token(tmp_path):
    with KubeApiStub() as api:
        api.apply(NS, endpoint_slice("t-1", "targets", [endpoint("10.0.0.1")], 50052))
        api.apply(NS, endpoint_slice("d-1", "drafts", [endpoint("10.0.0.2")], 50053))
        url = f"{api.url}/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices?labelSelector=" \
              "kubernetes.io/service-name%3Dtargets"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api.token}"})
        listing = json.loads(urllib.request.urlopen(request).read())
        assert listing["kind"] == "EndpointSliceList" and listing["metadata"]["resourceVersion"] == str(api.version)
        assert [i["metadata"]["name"] for i in listing["items"]] == ["t-1"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url)
        assert refused.value.code == 401


# ----- EndpointSlices through the kubernetes client ----------------------------------------------
def test_routable_means_ready_and_not_terminating_and_unset_ready_counts_as_ready():
    slices = {"s": endpoint_slice("s", "svc", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False),
                                               endpoint("10.0.0.3", terminating=True),
                                               endpoint("10.0.0.4", ready=None)], 7000)}
    assert routable_addresses(slices, None) == {"10.0.0.1:7000", "10.0.0.4:7000"}
    assert routable_addresses(slices, 9000) == {"10.0.0.1:9000", "10.0.0.4:9000"}


@pytest.fixture
def api():
    with KubeApiStub() as stub:
        stub.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1")], 50052))
        stub.apply(NS, endpoint_slice("drafts-abc", "drafts", [endpoint("10.0.1.1")], 50053))
        yield stub


def source(api, tmp_path, **kw) -> EndpointSliceSource:
    return EndpointSliceSource("target", "targets", NS, None, str(api.kubeconfig(tmp_path / "kubeconfig")), **kw)


def watches(api) -> list[dict]:
    return [r for r in api.requests if r.get("watch") == "true"]


def test_slices_are_listed_then_watched_from_the_lists_version_with_bookmarks_and_the_selector(api, tmp_path):
    src = source(api, tmp_path)

    async def scenario():
        updates = src.watch()
        assert await next_set(updates) == {"10.0.0.1:50052"}
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1"), endpoint("10.0.0.2")], 50052))
        assert await next_set(updates) == {"10.0.0.1:50052", "10.0.0.2:50052"}
        api.apply(NS, endpoint_slice("targets-def", "targets", [endpoint("10.0.0.3")], 50052))
        assert await next_set(updates) == {"10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"}
        api.apply(NS, endpoint_slice("drafts-abc", "drafts", [endpoint("10.0.1.2")], 50053))  # not ours
        api.delete(NS, "targets-def")
        assert await next_set(updates) == {"10.0.0.1:50052", "10.0.0.2:50052"}
        await updates.aclose()

    asyncio.run(scenario())
    listing, watch = api.requests[0], watches(api)[0]
    assert listing["labelSelector"] == watch["labelSelector"] == "kubernetes.io/service-name=targets"
    assert watch["allowWatchBookmarks"] == "true" and watch["resourceVersion"] == "1002"  # the list's version
    assert src.relists == 1


def test_a_terminating_or_unready_endpoint_leaves_the_set_before_its_slice_changes_further(api, tmp_path):
    async def scenario():
        updates = source(api, tmp_path).watch()
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1"), endpoint("10.0.0.2")], 50052))
        await until(updates, {"10.0.0.1:50052", "10.0.0.2:50052"})
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1"),
                                                                endpoint("10.0.0.2", terminating=True)], 50052))
        assert await next_set(updates) == {"10.0.0.1:50052"}
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1", ready=False)], 50052))
        assert await next_set(updates) == frozenset()
        await updates.aclose()

    asyncio.run(scenario())


async def watching(src: EndpointSliceSource, api: KubeApiStub):
    """The source's updates, once it has listed (the fixture's one target) and its watch is open."""
    updates = src.watch()
    assert await next_set(updates) == {"10.0.0.1:50052"}
    api.wait_for(lambda s: s.open_watches() == 1)
    return updates


def test_after_the_server_cuts_the_stream_the_watch_resumes_from_the_last_version_seen(api, tmp_path):
    src = source(api, tmp_path)

    async def scenario():
        updates = await watching(src, api)
        seen = api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.5")], 50052))
        assert await next_set(updates) == {"10.0.0.5:50052"}
        with api.cond:
            api.cut_watches()
            api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.6")], 50052))  # while cut
        assert await next_set(updates) == {"10.0.0.6:50052"}
        await updates.aclose()
        return seen

    seen = asyncio.run(scenario())
    assert [w["resourceVersion"] for w in watches(api)][:2] == ["1002", str(seen)]
    assert src.relists == 1  # resumed, not listed again


def test_a_bookmark_moves_the_resume_version_past_changes_the_selector_hides(api, tmp_path):
    src = source(api, tmp_path)

    async def scenario():
        updates = await watching(src, api)
        for _ in range(3):
            api.touch_other(NS)  # the store's version moves; this watch sees none of it
        marked = api.version
        api.bookmark()
        api.compact()  # history before the bookmark is gone: only the bookmark's version can resume
        api.wait_for(lambda s: s.bookmarks_sent == 1)  # on the wire before the cut: the client reads it first
        api.cut_watches()
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.7")], 50052))
        assert await next_set(updates) == {"10.0.0.7:50052"}
        await updates.aclose()
        return marked

    marked = asyncio.run(scenario())
    assert watches(api)[1]["resourceVersion"] == str(marked)
    assert src.relists == 1  # the bookmark spared a relist


def test_410_gone_makes_the_source_list_again_and_catch_up_on_what_it_missed(api, tmp_path):
    src = source(api, tmp_path)

    async def scenario():
        updates = await watching(src, api)
        with api.cond:  # one moment: the client cannot watch again before the history is compacted
            api.cut_watches()
            # While the client is away: a change, then the history is compacted past its version.
            api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.1"), endpoint("10.0.0.8")],
                                         50052))
            api.compact()
        assert await next_set(updates) == {"10.0.0.1:50052", "10.0.0.8:50052"}
        await updates.aclose()

    asyncio.run(scenario())
    assert src.relists == 2


def test_a_watch_the_server_ends_cleanly_after_timeout_seconds_is_renewed(api, tmp_path):
    src = source(api, tmp_path, watch_timeout_s=1)

    async def scenario():
        updates = src.watch()
        assert await next_set(updates) == {"10.0.0.1:50052"}
        api.wait_for(lambda s: len(watches(s)) >= 2)  # the first watch ended, the next one started
        api.apply(NS, endpoint_slice("targets-abc", "targets", [endpoint("10.0.0.9")], 50052))
        assert await next_set(updates) == {"10.0.0.9:50052"}
        await updates.aclose()

    asyncio.run(scenario())
    assert all(w["timeoutSeconds"] == "1" for w in watches(api)) and src.relists == 1


def test_a_missing_kubeconfig_fails_the_watch_at_once_instead_of_waiting_forever(tmp_path):
    from kubernetes.config import ConfigException

    async def scenario():
        updates = EndpointSliceSource("target", "targets", NS, None, str(tmp_path / "missing")).watch()
        await next_set(updates)

    with pytest.raises(ConfigException):
        asyncio.run(scenario())  # follow() logs it and tries again later
