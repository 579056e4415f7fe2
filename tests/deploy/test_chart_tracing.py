"""tracing.otlpEndpoint: every server's --otlp-traces-endpoint, and resource attributes naming the pod."""

from __future__ import annotations

import pytest

from tests.deploy.chart import NAMESPACE, container, flag, name, render, render_error

ENDPOINT = "http://otel-collector.observability:4317"
COMPONENTS = ("coordinator", "target", "draft")


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_server_exports_to_the_collector_and_names_its_pod(component):
    main = container(render("tracing"), component)
    assert flag(main["args"], "--otlp-traces-endpoint") == ENDPOINT
    env = main["env"]
    names = [e["name"] for e in env]
    # Kubernetes expands $(VAR) only from variables defined before the one that uses it.
    assert names.index("TANDEM_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    pod_name = next(e for e in env if e["name"] == "TANDEM_POD_NAME")
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    attributes = dict(pair.split("=", 1) for pair in
                      next(e for e in env if e["name"] == "OTEL_RESOURCE_ATTRIBUTES")["value"].split(","))
    assert attributes == {"k8s.namespace.name": NAMESPACE, "k8s.pod.name": "$(TANDEM_POD_NAME)",
                          "service.namespace": name("").rstrip("-")}
    # Tandem names the service by role; the chart must not override it.
    assert "OTEL_SERVICE_NAME" not in names


@pytest.mark.parametrize("component", COMPONENTS)
def test_tracing_is_off_by_default(component):
    main = container(render(), component)
    assert "--otlp-traces-endpoint" not in main["args"]
    assert not {"TANDEM_POD_NAME", "OTEL_RESOURCE_ATTRIBUTES"} & {e["name"] for e in main["env"]}


@pytest.mark.parametrize("endpoint", ["otel-collector:4317", "http://otel-collector", "http://otel:4317/v1/traces",
                                      "ftp://otel:4317"])
def test_the_schema_refuses_an_endpoint_the_servers_would(endpoint):
    assert "/tracing/otlpEndpoint" in render_error(f"tracing.otlpEndpoint={endpoint}")
