"""`tandem serve coordinator`'s discovery flags: each mode takes its own flags and says what it misses."""

from __future__ import annotations

import pytest

from tandem.config import CoordinatorConfig, ServerOptions
from tandem.errors import InvalidRequestError


def config(**kw) -> CoordinatorConfig:
    return CoordinatorConfig(server=ServerOptions(), tokenizer_dir="/models/t", **kw)


@pytest.mark.parametrize("kw", [
    dict(target_addrs=["h:1"], draft_addrs=["[::1]:2"]),
    dict(discovery="file", workers_file="/run/workers.json"),
    dict(discovery="dns", target_service="targets.ns.svc.cluster.local", target_port=50052),
    dict(discovery="kubernetes", target_service="targets", draft_service="drafts", namespace="ns",
         kubeconfig="/k", draft_port=7),
])
def test_each_discovery_mode_accepts_its_own_flags(kw):
    assert config(**kw).discovery == kw.get("discovery", "static")


@pytest.mark.parametrize("kw,complaint", [
    (dict(), "needs at least one target worker address"),
    (dict(target_addrs=["nohost"]), "is not HOST:PORT"),
    (dict(discovery="consul"), "--discovery must be one of static, file, dns, kubernetes"),
    (dict(discovery="file"), "--discovery file needs --workers-file"),
    (dict(discovery="dns"), "--discovery dns needs --target-service"),
    (dict(discovery="kubernetes", draft_service="drafts"), "--discovery kubernetes needs --target-service"),
    (dict(discovery="dns", target_service="t", target_port=70000), "--target-port must be in 1..65535"),
    (dict(discovery="dns", target_service="t", namespace="ns"), "--namespace does not apply to --discovery dns"),
    (dict(discovery="file", workers_file="/w", target_addrs=["h:1"]), "--target-addr/--draft-addr does not apply"),
    (dict(target_addrs=["h:1"], target_service="t"), "--target-service/--draft-service does not apply"),
])
def test_a_wrong_combination_is_refused_naming_the_flag(kw, complaint):
    with pytest.raises(InvalidRequestError, match=complaint):
        config(**kw)
