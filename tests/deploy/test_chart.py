"""What matters on the objects the Helm chart renders, for the default values and each variant.

Rendered by the real helm binary (tests/deploy/chart.py); .ci/deploy_check.sh also lints every
variant and validates it against the Kubernetes schemas.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    NAMESPACE,
    container,
    flag,
    name,
    of_kind,
    one,
    pod_labels,
    render,
    render_error,
    selects,
    variant_names,
)

ALL_VARIANTS = [None, *variant_names()]
FLEETS = ("target", "draft")
COMPONENTS = ("coordinator", *FLEETS)


def gpus(objects, component):
    resources = container(objects, component)["resources"]
    return resources["limits"].get("nvidia.com/gpu"), resources["requests"].get("nvidia.com/gpu")


def test_the_variants_the_issue_names_exist():
    assert {"tp4-target", "external-redis", "servicemonitor", "keda", "hub-download", "tls-auth", "heads"} <= set(
        variant_names())


def test_target_pods_request_one_gpu_per_tensor_parallel_rank():
    assert gpus(render(), "target") == (1, 1)
    objects = render("tp4-target")
    assert gpus(objects, "target") == (4, 4)
    assert flag(container(objects, "target")["args"], "--tensor-parallel-size") == "4"
    # The ranks of one replica share a pod, so NCCL gets a memory-backed /dev/shm.
    pod = one(objects, "Deployment", name("target"))["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(objects, "target")["volumeMounts"]


def test_generated_blocks_are_cached_unless_each_fleets_values_say_not():
    assert all("--no-cache-generated" not in container(render(), f)["args"] for f in FLEETS)
    objects = render(None, "target.cacheGenerated=false")
    assert "--no-cache-generated" in container(objects, "target")["args"]
    assert "--no-cache-generated" not in container(objects, "draft")["args"]
    assert "--no-cache-generated" in container(render(None, "draft.cacheGenerated=false"), "draft")["args"]


def test_a_chat_template_is_a_configmap_mounted_into_the_coordinator_and_passed_to_it():
    from pathlib import Path

    assert not of_kind(render(), "ConfigMap") and "--chat-template" not in container(render(), "coordinator")["args"]
    objects = render("chat-template")
    template = (Path(__file__).parents[2] / "examples/chat_templates/chatml_tools.jinja").read_text()
    config_map = one(objects, "ConfigMap", f"{name('coordinator')}-chat-template")
    assert config_map["data"] == {"template.jinja": template}
    coordinator = container(objects, "coordinator")
    path = flag(coordinator["args"], "--chat-template")
    (mount,) = [m for m in coordinator["volumeMounts"] if m["name"] == "chat-template"]
    assert path == f"{mount['mountPath']}/template.jinja" and mount["readOnly"]
    pod = one(objects, "Deployment", name("coordinator"))["spec"]["template"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "chat-template"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    # A changed template rolls the pods (the coordinator reads it at start-up).
    changed = one(render("chat-template", "coordinator.chatTemplate=other"), "Deployment", name("coordinator"))
    assert pod["metadata"]["annotations"]["checksum/chat-template"] != (
        changed["spec"]["template"]["metadata"]["annotations"]["checksum/chat-template"])
    assert "--chat-template" not in container(objects, "target")["args"]


def test_worker_rollouts_need_no_spare_gpu():
    objects = render()
    for fleet in FLEETS:
        strategy = one(objects, "Deployment", name(fleet))["spec"]["strategy"]
        assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_draft_gpus_follow_their_own_value_and_the_coordinator_gets_none():
    objects = render()
    assert gpus(objects, "draft") == (1, 1)
    assert gpus(render(None, "draft.gpus=0", "draft.device=cpu"), "draft") == (None, None)
    assert gpus(objects, "coordinator") == (None, None)
    assert "draft.gpus is 0" in render_error("draft.gpus=0")  # device still cuda


def test_a_cpu_target_requests_no_gpus():
    assert gpus(render("tp4-target", "target.device=cpu"), "target") == (None, None)


@pytest.mark.parametrize("variant", [None, "tp4-target", "keda"])
def test_native_grpc_probes_with_a_startup_budget_for_model_loading(variant):
    objects = render(variant)
    for component in COMPONENTS:
        c = container(objects, component)
        (grpc_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["grpc"] == {"port": grpc_port}, (component, kind)
    for fleet in FLEETS:
        startup = container(objects, fleet)["startupProbe"]
        # Loading a model takes minutes: at least ten before the kubelet gives up.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, fleet
    # A coordinator is NOT_SERVING until a target answers: its budget waits out the target's start too.
    budget = {c: container(objects, c)["startupProbe"] for c in ("coordinator", "target")}
    seconds = {c: p["periodSeconds"] * p["failureThreshold"] for c, p in budget.items()}
    assert seconds["coordinator"] > seconds["target"], seconds


def test_every_workload_has_exactly_one_autoscaler_by_default_an_hpa():
    objects = render()
    assert not of_kind(objects, "ScaledObject")
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == sorted(name(c) for c in COMPONENTS)
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["apiVersion"]) == ("Deployment", "apps/v1")
        one(objects, "Deployment", ref["name"])
        assert {m["resource"]["name"] for m in hpa["spec"]["metrics"]} == {"cpu"}
        # The autoscaler owns the count: the Deployment must not reset it on every upgrade.
        assert "replicas" not in one(objects, "Deployment", ref["name"])["spec"]


def test_with_keda_each_fleet_scales_alone_on_its_own_prometheus_signal():
    objects = render("keda")
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(objects, "ScaledObject")}
    assert sorted(scaled) == sorted(name(f) for f in FLEETS)
    hpa_targets = [h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objects, "HorizontalPodAutoscaler")]
    assert hpa_targets == [name("coordinator")], "a fleet under KEDA must not also have a chart HPA"

    target = scaled[name("target")]["spec"]
    (trigger,) = target["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    assert "tandem_target_kv_blocks_used" in query and "tandem_target_kv_blocks_total" in query
    assert f'service="{name("target")}-metrics"' in query and f'namespace="{NAMESPACE}"' in query
    assert trigger["metadata"]["threshold"] == "0.8" and target["maxReplicaCount"] == 6

    draft = scaled[name("draft")]["spec"]
    (trigger,) = draft["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert "tandem_draft_queue_depth" in trigger["metadata"]["query"]
    assert "tandem_target" not in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "4" and draft["maxReplicaCount"] == 12


def test_the_draft_busy_share_signal_reads_the_drafts_batch_time():
    objects = render("keda", "autoscaling.keda.draft.signal=busyShare", "autoscaling.keda.draft.threshold=0.7")
    (trigger,) = one(objects, "ScaledObject", name("draft"))["spec"]["triggers"]
    assert "rate(tandem_draft_batch_seconds_sum" in trigger["metadata"]["query"]
    assert trigger["metricType"] == "Value"


def test_the_target_fleet_can_scale_on_the_requests_its_coordinators_hold_waiting_for_room():
    objects = render("keda", "autoscaling.keda.target.signal=waitingRequests", "autoscaling.keda.target.threshold=1.5")
    (trigger,) = one(objects, "ScaledObject", name("target"))["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(vllm:num_requests_waiting{") and trigger["metricType"] == "AverageValue"
    assert f'service="{name("coordinator")}-metrics"' in query and f'namespace="{NAMESPACE}"' in query
    assert trigger["metadata"]["threshold"] == "1.5"
    assert "/autoscaling/keda/draft/signal" in render_error("autoscaling.keda.draft.signal=waitingRequests")  # targets'


def test_the_metric_names_in_the_autoscaling_queries_exist():
    from prometheus_client import CollectorRegistry

    from tandem.rpc.metrics import CoordinatorMetrics, WorkerMetrics

    exported = set()
    for role in FLEETS:
        registry = CollectorRegistry()
        WorkerMetrics(registry, role)
        exported |= {s.name for m in registry.collect() for s in m.samples}
    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    exported |= {s.name for m in registry.collect() for s in m.samples}
    objects = render("keda", "autoscaling.keda.draft.signal=busyShare")
    objects += render("keda", "autoscaling.keda.target.signal=queueDepth")
    objects += render("keda", "autoscaling.keda.target.signal=waitingRequests")
    queries = [s["spec"]["triggers"][0]["metadata"]["query"] for s in of_kind(objects, "ScaledObject")]
    assert any("vllm:" in query for query in queries)
    for query in queries:
        for metric in re.findall(r"(?:tandem_|vllm:)[a-z_]+", query):
            assert metric in exported, metric


def test_only_coordinator_pods_reach_the_workers_grpc_ports():
    objects = render()
    policies = of_kind(objects, "NetworkPolicy")
    coordinator = pod_labels(objects, "coordinator")
    for fleet in FLEETS:
        workers = pod_labels(objects, fleet)
        covering = [p for p in policies if selects(p["spec"]["podSelector"], workers)]
        assert len(covering) == 1, fleet
        spec = covering[0]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        grpc_rules = [r for r in spec["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
        assert len(grpc_rules) == 1
        (peer,) = grpc_rules[0]["from"]
        assert set(peer) == {"podSelector"}, "no namespace or IP block may reach a worker's gRPC port"
        assert selects(peer["podSelector"], coordinator)
        for other in ("target", "draft"):
            assert not selects(peer["podSelector"], pod_labels(objects, other))
        # The metrics port is open to the configured scrapers only, and to nothing else.
        (metrics_rule,) = [r for r in spec["ingress"] if r is not grpc_rules[0]]
        assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert metrics_rule["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_only_coordinator_pods_reach_the_bundled_redis():
    objects = render()
    policy = one(objects, "NetworkPolicy", name("redis"))
    assert selects(policy["spec"]["podSelector"], pod_labels(objects, "redis"))
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert selects(peer["podSelector"], pod_labels(objects, "coordinator"))
    assert not selects(peer["podSelector"], pod_labels(objects, "target"))


def test_rbac_is_a_role_that_only_reads_endpointslices():
    objects = render()
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    (role,) = of_kind(objects, "Role")
    (rule,) = role["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}
    (binding,) = of_kind(objects, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    pod = one(objects, "Deployment", name("coordinator"))["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert pod["automountServiceAccountToken"] is True
    for fleet in FLEETS:  # workers read nothing from the API
        worker_pod = one(objects, "Deployment", name(fleet))["spec"]["template"]["spec"]
        assert worker_pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in worker_pod


def test_dns_discovery_needs_no_api_access():
    objects = render("tls-auth")
    assert not of_kind(objects, "Role") and not of_kind(objects, "RoleBinding")
    pod = one(objects, "Deployment", name("coordinator"))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    args = container(objects, "coordinator")["args"]
    assert flag(args, "--discovery") == "dns" and "--namespace" not in args
    assert flag(args, "--target-service") == name("target") and flag(args, "--target-port") == "50052"
    assert flag(args, "--draft-service") == name("draft") and flag(args, "--draft-port") == "50053"


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_images_are_pinned_never_latest(variant):
    objects = render(variant)
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            repository, _, tag = c["image"].rpartition(":")
            assert repository and tag and tag != "latest" and "/" not in tag, c["image"]
            if "tandem/" in repository:
                assert tag == chart_version, c["image"]


def test_the_schema_refuses_latest_unknown_keys_and_tls_without_a_secret():
    assert "/images/worker/tag" in render_error("images.worker.tag=latest")
    assert "tensorParalelSize" in render_error("target.tensorParalelSize=2")
    assert "/tls/secretName" in render_error("tls.enabled=true")
    assert "/models/source" in render_error("models.source=s3")
    assert "not both" in render_error("redis.url=redis://elsewhere:6379/0")
    assert "/target/rankTimeoutSeconds" in render_error("target.rankTimeoutSeconds=0")


def test_the_target_gets_its_rank_timeout_as_given():
    assert flag(container(render(), "target")["args"], "--rank-timeout") == "30"
    assert flag(container(render(None, "target.rankTimeoutSeconds=7"), "target")["args"], "--rank-timeout") == "7"


def test_the_coordinator_gets_its_room_hold_as_given_within_what_a_target_holds():
    assert flag(container(render(), "coordinator")["args"], "--room-hold") == "1"
    assert flag(container(render(None, "coordinator.roomHoldSeconds=0"), "coordinator")["args"], "--room-hold") == "0"
    assert "roomHoldSeconds" in render_error("coordinator.roomHoldSeconds=6")


def test_clients_reconnect_after_five_minutes_unless_the_values_say_never():
    """The Service balances connections: the coordinator asks each client to reconnect now and then (so that
    replicas the autoscaler adds get calls); the workers, dialed per replica by the coordinator, never do."""
    objects = render()
    assert flag(container(objects, "coordinator")["args"], "--max-connection-age") == "300"
    assert "--max-connection-age" not in container(objects, "target")["args"] + container(objects, "draft")["args"]
    never = container(render(None, "coordinator.maxConnectionAgeSeconds=0"), "coordinator")["args"]
    assert "--max-connection-age" not in never


def test_coordinator_finds_the_fleets_through_their_headless_services():
    objects = render()
    args = container(objects, "coordinator")["args"]
    assert flag(args, "--discovery") == "kubernetes"
    assert flag(args, "--tokenizer") == "/models/qwen2.5-coder-1.5b-instruct"
    for fleet in FLEETS:
        service = one(objects, "Service", flag(args, f"--{fleet}-service"))
        assert service["spec"]["clusterIP"] == "None"
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(objects, fleet))
        # One port, so discovery has nothing to choose between.
        (port,) = service["spec"]["ports"]
        assert port["name"] == "grpc" and port["targetPort"] == "grpc"
    assert flag(args, "--namespace") == NAMESPACE  # where the Role lets it read EndpointSlices
    assert "--target-port" not in args


def test_without_a_draft_fleet_the_coordinator_is_told_of_none():
    objects = render(None, "draft.enabled=false")
    assert "--draft-service" not in container(objects, "coordinator")["args"]
    assert all(o["metadata"]["name"] != name("draft") for o in objects)


def test_bundled_redis_is_bounded_and_the_coordinator_uses_it():
    objects = render()
    service = one(objects, "Service", name("redis"))
    args = container(objects, "coordinator")["args"]
    assert flag(args, "--redis-url") == f"redis://{service['metadata']['name']}:6379/0"
    redis = container(objects, "redis")
    assert flag(redis["args"], "--maxmemory") == "256mb"
    assert flag(redis["args"], "--maxmemory-policy") == "allkeys-lru"
    assert "--requirepass" not in redis["args"]


def test_bundled_redis_password_comes_from_a_secret():
    objects = render(None, "redis.auth.existingSecret=redis-pass")
    redis = container(objects, "redis")
    assert flag(redis["args"], "--requirepass") == "$(REDIS_PASSWORD)"
    ref = {"secretKeyRef": {"name": "redis-pass", "key": "password"}}
    assert {"name": "REDIS_PASSWORD", "valueFrom": ref} in redis["env"]
    assert {"name": "TANDEM_REDIS_PASSWORD", "valueFrom": ref} in container(objects, "coordinator")["env"]


def test_external_redis_replaces_the_bundled_one():
    objects = render("external-redis")
    assert not [o for o in objects if o["metadata"]["name"] == name("redis")]
    coordinator = container(objects, "coordinator")
    assert flag(coordinator["args"], "--redis-url") == "rediss://cache.example.internal:6380/0"
    assert {"name": "TANDEM_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "tandem-redis", "key": "password"}}} in coordinator["env"]


def test_no_redis_at_all_leaves_the_coordinator_its_in_process_cache():
    objects = render(None, "redis.bundled.enabled=false")
    assert "--redis-url" not in container(objects, "coordinator")["args"]


def test_service_monitor_scrapes_every_components_metrics_port():
    assert not of_kind(render(), "ServiceMonitor")
    objects = render("servicemonitor")
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["interval"] == "15s"
    scraped = [s for s in of_kind(objects, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in scraped) == sorted(f"{name(c)}-metrics" for c in COMPONENTS)
    for service in scraped:
        (port,) = service["spec"]["ports"]
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        assert port["name"] == "metrics"
        assert flag(container(objects, component)["args"], "--metrics-port") == str(port["port"])


def test_hub_download_fills_each_pods_volume_with_a_token_from_a_secret():
    objects = render("hub-download")
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    for component in COMPONENTS:
        pod = one(objects, "Deployment", name(component))["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert token in init["env"]
        assert env["HF_XET_CHUNK_CACHE_SIZE_BYTES"] == "0"  # no 10 GB chunk cache beside the model in its volume
        assert init["args"][0].startswith('hf download "$MODEL_REPO" --revision "$MODEL_REVISION"')
        (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert "emptyDir" in volume
        expected_repo = "Qwen/Qwen2.5-Coder-0.5B-Instruct" if component == "draft" else "Qwen/Qwen2.5-Coder-7B-Instruct"
        assert env["MODEL_REPO"] == expected_repo
        main_args = container(objects, component)["args"]
        model_flag = "--tokenizer" if component == "coordinator" else "--model"
        assert flag(main_args, model_flag) == env["MODEL_DIR"]
    # The coordinator fetches the tokenizer and config only, never the target's weights.
    coordinator_init = one(objects, "Deployment", name("coordinator"))["spec"]["template"]["spec"]["initContainers"][0]
    assert "--include '*.json'" in coordinator_init["args"][0]
    assert "--include '*.jinja'" in coordinator_init["args"][0]  # a chat template of its own file
    assert "'*.safetensors'" not in coordinator_init["args"][0]
    # A worker fetches what it loads: weights as safetensors, config, tokenizer; not the .bin/.pth/GGUF copies.
    for fleet in FLEETS:
        (init,) = one(objects, "Deployment", name(fleet))["spec"]["template"]["spec"]["initContainers"]
        assert "--include '*.safetensors'" in init["args"][0] and "--include '*.jinja'" in init["args"][0]
    assert coordinator_init["image"].startswith("tandem/coordinator:")


def test_heads_reach_the_target_workers_only_and_are_downloaded_beside_the_model():
    objects = render("heads")
    target_pod = one(objects, "Deployment", name("target"))["spec"]["template"]["spec"]
    model_init, heads_init = target_pod["initContainers"]
    env = {e["name"]: e.get("value") for e in heads_init["env"]}
    assert heads_init["name"] == "download-heads-model"
    assert "--include" not in heads_init["args"][0]  # heads come whole: their formats include .pt and .bin
    assert env["MODEL_REPO"] == "example-org/qwen2.5-coder-1.5b-instruct-eagle3"
    assert flag(container(objects, "target")["args"], "--heads") == env["MODEL_DIR"] == \
        "/models/qwen2.5-coder-1.5b-eagle3"
    for component in ("draft", "coordinator"):
        assert "--heads" not in container(objects, component)["args"]
        pod = one(objects, "Deployment", name(component))["spec"]["template"]["spec"]
        assert len(pod["initContainers"]) == 1
    assert "--heads" not in container(render(), "target")["args"]  # the default: no heads


def test_heads_from_the_hub_need_their_repository():
    error = render_error("models.source=download", "models.heads.dir=eagle")
    assert "models.heads.repo" in error


@pytest.mark.parametrize("source, key", [("pvc", "persistentVolumeClaim"), ("hostPath", "hostPath")])
def test_model_volume_sources(source, key):
    objects = render(None, f"models.source={source}")
    for component in COMPONENTS:
        pod = one(objects, "Deployment", name(component))["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert key in volume and "initContainers" not in pod
        env = {e["name"]: e.get("value") for e in container(objects, component)["env"]}
        assert env["TANDEM_HOME"] == "/models/.tandem"


def test_tls_auth_and_limits_reach_every_server_and_client_flag():
    objects = render("tls-auth")
    for fleet in FLEETS:
        args = container(objects, fleet)["args"]
        assert flag(args, "--tls-cert") == "/etc/tandem/tls/tls.crt"
        assert flag(args, "--tls-key") == "/etc/tandem/tls/tls.key"
        assert flag(args, "--tls-client-ca") == "/etc/tandem/tls/ca.crt"
    coordinator = container(objects, "coordinator")
    args = coordinator["args"]
    assert flag(args, "--tls-cert") == "/etc/tandem/tls/tls.crt" and "--tls-client-ca" not in args
    assert flag(args, "--worker-tls-ca") == "/etc/tandem/tls/ca.crt"
    assert flag(args, "--worker-tls-cert") == "/etc/tandem/tls/tls.crt"
    assert flag(args, "--worker-tls-key") == "/etc/tandem/tls/tls.key"
    assert flag(args, "--worker-tls-server-name") == "localhost"  # it dials pod IPs
    assert {"name": "TANDEM_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "tandem-auth", "key": "token"}}} in coordinator["env"]
    assert flag(args, "--max-prompt-tokens") == "8192"
    assert flag(args, "--max-new-tokens-limit") == "1024"
    assert flag(args, "--max-concurrent-per-client") == "8"
    assert flag(args, "--max-request-bytes") == "1048576"
    for component in COMPONENTS:
        c = container(objects, component)
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in c["volumeMounts"]
        # Native gRPC probes cannot do TLS: exec probes call grpc.health.v1 over TLS instead.
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[kind] and c[kind]["exec"]["command"][:2] == ["python", "-c"]
    # The public API is open only to the configured clients.
    policy = one(objects, "NetworkPolicy", name("coordinator"))
    grpc_rule = [r for r in policy["spec"]["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]][0]
    assert grpc_rule["from"] == [{"namespaceSelector": {"matchLabels": {"tandem-client": "true"}}}]


def test_limits_are_left_to_the_coordinator_unless_set():
    args = container(render(), "coordinator")["args"]
    assert not [a for a in args if a.startswith(("--max-prompt", "--max-new-tokens-limit", "--max-concurrent",
                                                 "--max-request", "--tls", "--worker-tls"))]


def test_pod_disruption_budgets_cover_each_component():
    objects = render()
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert len(budgets) == len(COMPONENTS)
    for component in COMPONENTS:
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(objects, component))]
        assert budget["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_pods_run_as_non_root_with_a_read_only_root(variant):
    for deployment in of_kind(render(variant), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_notes_tell_how_to_call_the_service():
    from tests.deploy.chart import helm

    out = helm("install", "tandem", str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert 'tandem generate "def quicksort(xs):" --addr localhost:50051' in notes
    assert "grpcurl -plaintext" in notes and "tandem.v1.Generation/Generate" in notes
    assert f"port-forward svc/{name('coordinator')} 50051:50051" in notes
    assert "a stats line every 10 s" in notes and "app.kubernetes.io/component=coordinator" in notes
    assert "Traces" not in notes
    quiet = helm("install", "tandem", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "--set", "coordinator.logStatsIntervalSeconds=0", "--set", "tracing.otlpEndpoint=http://otel:4317")
    assert quiet.returncode == 0, quiet.stderr
    assert "stats line" not in quiet.stdout and "Traces of every request go to http://otel:4317" in quiet.stdout


def _documented_paths(values, schema, path=()):
    """Every value's dotted path, down to the objects the schema leaves free-form (nodeSelector...)."""
    props = schema.get("properties")
    if isinstance(values, dict) and values and props:
        for key, sub in values.items():
            assert key in props, f"{'.'.join((*path, key))} is not in values.schema.json"
            yield from _documented_paths(sub, props[key], (*path, key))
    else:
        assert schema.get("description"), f"{'.'.join(path)} has no description in values.schema.json"
        yield ".".join(path)


def test_every_value_is_in_the_schema_and_the_readme_table():
    import json

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART.parent / "README.md").read_text()
    missing = [p for p in _documented_paths(values, schema) if f"| `{p}` |" not in readme]
    assert not missing, f"helm/README.md's values table lacks {missing}"


def test_cuda_graphs_are_each_fleets_choice_and_need_a_cuda_device():
    # Unset by default: each worker decides (on for one rank on CUDA), so the chart passes no flag.
    assert all(not {"--cuda-graphs", "--no-cuda-graphs"} & set(container(render(), f)["args"]) for f in FLEETS)
    assert "--no-cuda-graphs" in container(render(None, "target.cudaGraphs=false"), "target")["args"]
    assert "--no-cuda-graphs" in container(render(None, "draft.cudaGraphs=false", "draft.device=cpu",
                                                  "draft.gpus=0"), "draft")["args"]
    # A tensor-parallel target left to its default is no error: its worker runs eagerly.
    assert "--cuda-graphs" not in container(render(None, "target.tensorParallelSize=2"), "target")["args"]
    objects = render(None, "target.cudaGraphs=true")
    assert "--cuda-graphs" in container(objects, "target")["args"]
    assert "--cuda-graphs" not in container(objects, "draft")["args"]
    assert "--cuda-graphs" in container(render(None, "draft.cudaGraphs=true"), "draft")["args"]
    assert "draft.cudaGraphs needs draft.device: cuda" in render_error("draft.cudaGraphs=true", "draft.device=cpu",
                                                                         "draft.gpus=0")
    # The worker refuses graphs across tensor-parallel ranks: the chart says so at install, not in a crash loop.
    assert "target.cudaGraphs is for one-rank targets" in render_error("target.cudaGraphs=true",
                                                                       "target.tensorParallelSize=2")


def test_a_fleets_kv_pool_is_sized_by_tokens_or_by_a_fraction_of_its_gpus_memory():
    for fleet in FLEETS:  # tokens by default
        args = container(render(), fleet)["args"]
        assert "--kv-cache-tokens" in args and "--gpu-memory-utilization" not in args
    args = container(render(None, "target.gpuMemoryUtilization=0.9"), "target")["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9" and "--kv-cache-tokens" not in args
    assert "--kv-cache-tokens" in container(render(None, "target.gpuMemoryUtilization=0.9"), "draft")["args"]
    args = container(render(None, "draft.gpuMemoryUtilization=0.5"), "draft")["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    for bad in ("0", "1.5", "most"):
        assert "gpuMemoryUtilization" in render_error(f"target.gpuMemoryUtilization={bad}")
    assert "draft.gpuMemoryUtilization sizes the KV pool from a GPU's memory" in render_error(
        "draft.gpuMemoryUtilization=0.9", "draft.device=cpu", "draft.gpus=0")
    assert "target.gpuMemoryUtilization is not yet measured per tensor-parallel rank" in render_error(
        "target.gpuMemoryUtilization=0.9", "target.tensorParallelSize=2")


def test_a_draft_asks_for_at_most_the_one_gpu_it_runs_on():
    assert "/draft/gpus" in render_error("draft.gpus=2")
