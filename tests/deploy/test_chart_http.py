"""The chart and the coordinator's OpenAI-compatible HTTP API: flag, ports, NetworkPolicy, readiness probe."""

from __future__ import annotations

import pytest

from tests.deploy.chart import container, flag, name, one, render, render_error


def test_the_http_api_is_served_on_the_pod_and_the_public_service_by_default():
    objects = render()
    coordinator = container(objects, "coordinator")
    assert flag(coordinator["args"], "--http-port") == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in coordinator["ports"]
    ports = one(objects, "Service", name("coordinator"))["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} in ports
    assert "grpc" in coordinator["readinessProbe"]  # gRPC health unless asked


def test_the_networkpolicy_lets_the_clients_reach_both_api_ports_and_workers_only_grpc():
    objects = render("tls-auth")
    rules = one(objects, "NetworkPolicy", name("coordinator"))["spec"]["ingress"]
    api = [r for r in rules if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
    assert len(api) == 1 and {"port": "http", "protocol": "TCP"} in api[0]["ports"]
    assert api[0]["from"] == [{"namespaceSelector": {"matchLabels": {"tandem-client": "true"}}}]
    for worker in ("target", "draft"):
        ports = [p for r in one(objects, "NetworkPolicy", name(worker))["spec"]["ingress"] for p in r["ports"]]
        assert {"port": "http", "protocol": "TCP"} not in ports


def test_turned_off_nothing_of_it_is_rendered():
    objects = render(None, "coordinator.http.enabled=false")
    coordinator = container(objects, "coordinator")
    assert "--http-port" not in coordinator["args"]
    assert all(p["name"] != "http" for p in coordinator["ports"])
    assert all(p["name"] != "http" for p in one(objects, "Service", name("coordinator"))["spec"]["ports"])
    rules = one(objects, "NetworkPolicy", name("coordinator"))["spec"]["ingress"]
    assert all({"port": "http", "protocol": "TCP"} not in r["ports"] for r in rules)


@pytest.mark.parametrize("tls,scheme", [(False, "HTTP"), (True, "HTTPS")])
def test_readiness_from_the_http_health_route_when_asked(tls, scheme):
    sets = ["coordinator.http.readinessProbe=true", "coordinator.http.port=8080"]
    if tls:
        sets += ["tls.enabled=true", "tls.secretName=t", "tls.mutual=false"]
    coordinator = container(render(None, *sets), "coordinator")
    assert coordinator["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
    assert flag(coordinator["args"], "--http-port") == "8080"
    assert "httpGet" not in coordinator["startupProbe"] and "httpGet" not in coordinator["livenessProbe"]
    target = container(render(None, *sets), "target")
    assert "httpGet" not in target["readinessProbe"]  # the workers have no HTTP API


def test_the_http_probe_is_refused_under_mutual_tls():
    error = render_error("coordinator.http.readinessProbe=true", "tls.enabled=true", "tls.secretName=t",
                         "tls.mutual=true")
    assert "tls.mutual" in error and "client certificate" in error


def test_the_served_model_names_reach_the_coordinator_as_it_parses_them():
    from tandem.cli import build_parser

    args = container(render(None, "coordinator.servedModelNames={qwen-coder,gpt-4o-mini}"), "coordinator")["args"]
    parsed = build_parser().parse_args(["serve", "coordinator", *args])
    assert parsed.served_model_name == ["qwen-coder", "gpt-4o-mini"]
    assert "--served-model-name" not in container(render(), "coordinator")["args"]  # the workers' name by default
    assert "/coordinator/servedModelNames" in render_error("coordinator.servedModelNames={qwen,qwen}")
    assert "/coordinator/servedModelNames" in render_error("coordinator.servedModelNames={ qwen}")


def test_the_coordinators_log_settings_reach_it_only_when_they_differ_from_its_own_defaults():
    from tandem.cli import build_parser

    args = container(render(None, "coordinator.logStatsIntervalSeconds=0", "coordinator.logRequests=true"),
                     "coordinator")["args"]
    parsed = build_parser().parse_args(["serve", "coordinator", *args])
    assert parsed.log_stats_interval == 0 and parsed.log_requests
    default = container(render(), "coordinator")["args"]
    assert "--log-stats-interval" not in default and "--log-requests" not in default
    assert "/coordinator/logStatsIntervalSeconds" in render_error("coordinator.logStatsIntervalSeconds=-1")
