"""`tandem scale`'s requests to a running `tandem up`: what is refused, who may send them, and how `tandem scale`
finds it; and the TLS and token flags `tandem up` passes to what it starts."""

from __future__ import annotations

import http.client
import json
import stat
from types import SimpleNamespace

import pytest
import torch

from tandem.cli import main
from tandem.errors import InvalidRequestError
from tandem.up_admin import AdminServer, parse_scale, state_file


def test_a_scale_request_keeps_what_it_leaves_out_and_defaults_the_drain_timeout():
    assert parse_scale({"target_replicas": 2}) == (2, None, 60.0)
    assert parse_scale({"draft_replicas": 0, "drain_timeout_s": 5}) == (None, 0, 5.0)


@pytest.mark.parametrize("body,complaint", [
    ([], "must be a JSON object"),
    ({"targets": 2}, "unknown fields"),
    ({"target_replicas": 0}, "target_replicas must be an integer >= 1"),
    ({"draft_replicas": -1}, "draft_replicas must be an integer >= 0"),
    ({"target_replicas": True}, "target_replicas must be an integer"),
    ({"drain_timeout_s": "soon"}, "drain_timeout_s must be a number"),
])
def test_a_bad_scale_request_is_refused_naming_the_field(body, complaint):
    with pytest.raises(InvalidRequestError, match=complaint):
        parse_scale(body)


def test_tandem_scale_without_a_running_tandem_up_says_how_to_point_it_at_one(tmp_path, capsys):
    assert main(["scale", "--port", "50999", "--cache-dir", str(tmp_path), "--target-replicas", "2"]) == 2
    assert "no running `tandem up` with its coordinator on port 50999" in capsys.readouterr().err
    assert main(["scale", "--admin", "127.0.0.1:1"]) == 2
    assert "cannot reach `tandem up` at 127.0.0.1:1" in capsys.readouterr().err


# ----- who may drive the control endpoint ----------------------------------------------------------------


class FakeCluster:
    """What the control endpoint uses of a LocalCluster, with no processes: it records the changes asked."""

    def __init__(self) -> None:
        self.coordinator = SimpleNamespace(address="127.0.0.1:50051")
        self.fleets = {"target": ["127.0.0.1:1"], "draft": []}
        self.changes: list[tuple[str, str, int]] = []

    def workers(self, role: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(address=a) for a in self.fleets[role]]

    def add_workers(self, role: str, count: int) -> list[SimpleNamespace]:
        self.changes.append(("add", role, count))
        have = len(self.fleets[role])
        added = [f"127.0.0.1:{100 + have + i}" for i in range(count)]
        self.fleets[role] += added
        return [self._service(role, address) for address in added]

    def remove_workers(self, role: str, count: int, drain_timeout_s: float) -> list[SimpleNamespace]:
        self.changes.append(("remove", role, count))
        leaving = self.fleets[role][-count:]
        del self.fleets[role][-count:]
        return [self._service(role, address) for address in leaving]

    def _service(self, role: str, address: str) -> SimpleNamespace:
        port = int(address.rsplit(":", 1)[1])
        return SimpleNamespace(name=f"{role}-{port}", address=address, process=SimpleNamespace(pid=port + 1000))


@pytest.fixture
def said() -> list[str]:
    return []


@pytest.fixture
def admin(tmp_path, said):
    server = AdminServer(FakeCluster(), max_replicas=4, say=said.append)  # type: ignore[arg-type]
    server.start(state_file(tmp_path, 50051))
    yield server
    server.stop()


def post(admin: AdminServer, body: dict, **headers: str) -> tuple[int, dict]:
    """POST /scale with exactly these headers (Host too, unless given: the endpoint's own)."""
    headers = {"Host": admin.address, "Content-Type": "application/json", **headers}
    connection = http.client.HTTPConnection(admin.address, timeout=10)
    try:
        connection.request("POST", "/scale", json.dumps(body), headers)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_scaling_needs_the_secret_in_the_owner_only_state_file(admin, tmp_path):
    path = state_file(tmp_path, 50051)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = json.loads(path.read_text())["secret"]
    assert len(secret) >= 32
    for headers in ({}, bearer("a-guess-that-is-long-enough-0123456789"), {"Authorization": secret}):
        code, reply = post(admin, {"target_replicas": 2}, **headers)
        assert code == 401 and "secret" in reply["error"] and str(path) in reply["error"]
    assert admin.cluster.changes == []
    code, reply = post(admin, {"target_replicas": 2}, **bearer(secret))
    assert code == 200 and len(reply["target"]) == 2
    assert admin.cluster.changes == [("add", "target", 1)]


@pytest.mark.parametrize("headers,complaint", [
    ({"Host": "evil.example"}, "Host 'evil.example' is not this endpoint"),  # DNS rebinding: the page's own name
    ({"Host": "evil.example:{port}"}, "is not this endpoint"),
    ({"Host": "127.0.0.1:1"}, "is not this endpoint"),
    ({"Origin": "http://evil.example"}, "requests from web pages are refused"),
    ({"Origin": "null"}, "requests from web pages are refused"),
])
def test_a_request_for_another_host_or_from_a_web_page_is_refused_even_with_the_secret(admin, headers, complaint):
    headers = {k: v.format(port=admin.port) for k, v in headers.items()}
    code, reply = post(admin, {"target_replicas": 2}, **bearer(admin.secret), **headers)
    assert code == 403 and complaint in reply["error"]
    assert admin.cluster.changes == []


def test_localhost_and_its_own_origin_are_let_through(admin):
    code, _ = post(admin, {"target_replicas": 2}, **bearer(admin.secret), Host=f"localhost:{admin.port}",
                   Origin=f"http://127.0.0.1:{admin.port}")
    assert code == 200 and admin.cluster.changes == [("add", "target", 1)]


def test_replica_counts_above_the_cap_are_refused(admin):
    with pytest.raises(InvalidRequestError, match="target_replicas must be at most 16"):
        parse_scale({"target_replicas": 17})
    code, reply = post(admin, {"draft_replicas": 5}, **bearer(admin.secret))
    assert code == 400 and "draft_replicas must be at most 4" in reply["error"] and "--max-replicas" in reply["error"]
    code, reply = post(admin, {"target_replicas": 4}, **bearer(admin.secret))
    assert code == 200 and admin.cluster.changes == [("add", "target", 3)]


def test_tandem_scale_sends_the_secret_from_the_state_file(admin, tmp_path, capsys):
    assert main(["scale", "--port", "50051", "--cache-dir", str(tmp_path), "--target-replicas", "3"]) == 0
    assert admin.cluster.changes == [("add", "target", 2)]
    assert main(["scale", "--admin", admin.address, "--cache-dir", str(tmp_path)]) == 0  # found by its address
    assert "target  3:" in capsys.readouterr().out
    assert main(["scale", "--admin", admin.address, "--cache-dir", str(tmp_path / "elsewhere")]) == 2
    assert "`tandem up` refused: no secret" in capsys.readouterr().err


# ----- `tandem up`'s TLS, token and limit flags --------------------------------------------------------------


def up_spec(*flags: str):
    from tandem.cli import build_parser
    from tandem.cli.up import cluster_spec

    return cluster_spec(build_parser().parse_args(["up", "--target", "t", "--draft", "d", *flags]))


def test_tandem_up_passes_tls_tokens_and_limits_to_the_processes_it_starts(tmp_path, monkeypatch):
    from tandem.rpc.auth import TOKEN_ENV
    from tests.tls_certs import make_pki

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text("client-one-0123456789abcdef\n")
    spec = up_spec("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca",
                   str(pki.ca), "--worker-tls-ca", str(pki.ca), "--worker-tls-cert", str(pki.client_cert),
                   "--worker-tls-key", str(pki.client_key), "--auth-token-file", str(tokens),
                   "--max-concurrent-per-client", "2", "--max-prompt-tokens", "100")
    assert spec.server_tls is not None and spec.server_tls.mutual  # every process serves mutual TLS
    assert spec.client_tls is not None and spec.client_tls.cert == pki.client_cert  # the coordinator's links
    args = list(spec.coordinator_args)
    assert args[args.index("--auth-token-file") + 1] == str(tokens)
    assert args[args.index("--max-concurrent-per-client") + 1] == "2"
    assert args[args.index("--max-prompt-tokens") + 1] == "100"
    assert spec.coordinator_token == "client-one-0123456789abcdef"  # what `tandem up` itself presents
    assert up_spec().server_tls is None and up_spec().client_tls is None  # off unless asked for


@pytest.mark.parametrize("flags,complaint", [
    (("--tls-cert", "{cert}", "--tls-key", "{key}"), "--tls-cert needs --worker-tls-ca"),
    (("--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{ca}", "--worker-tls-ca", "{ca}"),
     "--tls-client-ca needs --worker-tls-cert"),
    (("--worker-tls-ca", "{tmp}/missing.pem"), "--worker-tls-ca .*missing.pem: cannot read it"),
    (("--auth-token-file", "{tmp}/missing"), "--auth-token-file .*missing"),
    (("--target-replicas", "17"), "--target-replicas 17 is more than --max-replicas 16"),
    (("--draft-replicas", "3", "--max-replicas", "2"), "--draft-replicas 3 is more than --max-replicas 2"),
])
def test_tandem_up_refuses_security_flags_that_cannot_work_before_starting_anything(tmp_path, flags, complaint):
    from tests.tls_certs import make_pki

    pki = make_pki(tmp_path / "pki")
    names = dict(cert=pki.server_cert, key=pki.server_key, ca=pki.ca, tmp=tmp_path)
    with pytest.raises(InvalidRequestError, match=complaint):
        up_spec(*(f.format(**names) for f in flags))


def test_tandem_up_passes_the_rank_timeout_to_every_target_worker_it_starts():
    from tandem.cli import build_parser

    spec = up_spec("--tensor-parallel-size", "2", "--rank-timeout", "6")
    args = list(spec.target_args)
    assert args[args.index("--rank-timeout") + 1] == "6.0"
    # ...in a form `tandem serve target` takes, so a restarted or scaled-up replica starts with it too
    served = build_parser().parse_args(["serve", "target", "--model", "m", *args])
    assert served.rank_timeout == 6.0
    assert "--rank-timeout" not in up_spec().target_args  # the worker's own default unless asked for


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_tandem_up_refuses_a_rank_timeout_that_is_not_a_positive_number_before_starting_anything(value):
    with pytest.raises(InvalidRequestError, match=f"--rank-timeout must be a positive number of seconds, got {value}"):
        up_spec("--tensor-parallel-size", "2", "--rank-timeout", value)


def test_tandem_up_passes_the_room_hold_to_its_coordinator_and_refuses_a_bad_one_before_starting_anything():
    from tandem.cli import build_parser

    args = list(up_spec("--room-hold", "0").coordinator_args)
    assert args[args.index("--room-hold") + 1] == "0.0"
    # ...in a form `tandem serve coordinator` takes, so a restarted coordinator starts with it too
    served = build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t", *args])
    assert served.room_hold == 0.0
    assert build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t"]).room_hold == 1.0
    with pytest.raises(InvalidRequestError, match="--room-hold must be in 0..5 seconds"):
        up_spec("--room-hold", "9")


def test_tandem_up_passes_the_served_model_names_and_request_logging_to_its_coordinator():
    from tandem.cli import build_parser

    args = list(up_spec("--served-model-name", "qwen-coder", "gpt-4o-mini", "--room-hold", "0").coordinator_args)
    served = build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t", *args])
    assert served.served_model_name == ["qwen-coder", "gpt-4o-mini"] and served.room_hold == 0.0
    logging = list(up_spec("--log-requests").coordinator_args)
    assert build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t", *logging]).log_requests
    assert "--log-requests" not in up_spec().coordinator_args
    stats = list(up_spec("--log-stats-interval", "2").coordinator_args)
    assert build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t", *stats]).log_stats_interval == 2
    assert "--log-stats-interval" not in up_spec().coordinator_args  # the coordinator's own default
    with pytest.raises(InvalidRequestError, match="--log-stats-interval must be 0"):
        up_spec("--log-stats-interval", "0.5")
    assert "--served-model-name" not in up_spec().coordinator_args
    assert build_parser().parse_args(["serve", "coordinator", "--tokenizer", "t"]).served_model_name == ()
    with pytest.raises(InvalidRequestError, match="--served-model-name gives 'a' more than once"):
        up_spec("--served-model-name", "a", "a")


def test_a_second_ctrl_c_while_tandem_up_stops_stops_everything_at_once():
    """The first Ctrl-C gives the coordinator's requests its drain grace; a second one, meanwhile, stops every
    process at once (SIGTERM, then SIGKILL) rather than leave the user waiting or processes behind."""
    import os
    import signal
    import time

    from tandem.cli.up import stop_cluster, stop_grace_s

    class Cluster:
        def __init__(self):
            self.graces = []

        def stop(self, grace_s):
            self.graces.append(grace_s)
            if len(self.graces) == 1:  # draining: the user presses Ctrl-C again
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # (interrupted)
                raise AssertionError("the second Ctrl-C did not interrupt the drain")

    cluster, said = Cluster(), []
    before = signal.getsignal(signal.SIGINT)
    stop_cluster(cluster, 30.0, said.append)
    assert cluster.graces == [stop_grace_s(30.0), 0.0]
    assert said == ["stopping: requests in flight get up to 30 s to finish (Ctrl-C again to stop now)",
                    "stopping now"]
    assert signal.getsignal(signal.SIGINT) is before  # left as it was


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_tandem_up_refuses_a_port_something_listens_on_before_loading_anything(flag, capsys):
    """A second `tandem up` on a port in use started its workers, then shared the port with the first (gRPC binds
    with SO_REUSEPORT) or died with a traceback at the end."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = ["--port", str(port), "--http-port", "0"] if flag == "--port" else ["--port", "0", "--http-port",
                                                                                     str(port)]
        # (no such model: a check that came after preparing the models would fail on the model instead)
        assert main(["up", "--target", "no-such-model", "--draft", "none", *ports]) == 2
    assert f"tandem: error: {flag} {port}: Address already in use" in capsys.readouterr().err


def test_a_grpc_server_refuses_a_port_another_server_listens_on():
    """Without SO_REUSEPORT off, the second server started and the kernel split connections between the two."""
    import asyncio

    from tandem.config import ServerOptions
    from tandem.errors import ListenError
    from tandem.rpc.server import ManagedServer

    async def both():
        first = ManagedServer("coordinator", ServerOptions(host="127.0.0.1", port=0))
        port = await first.start()
        second = ManagedServer("coordinator", ServerOptions(host="127.0.0.1", port=port))
        try:
            with pytest.raises(ListenError, match=f"coordinator: cannot listen on 127.0.0.1:{port} \\(--port\\)"):
                await second.start()
        finally:
            await second.server.stop(None)
            await first.server.stop(None)
    asyncio.run(both())


def test_a_metrics_port_in_use_or_out_of_range_is_a_clean_error():
    """Either was a traceback (OverflowError, OSError) once the model had loaded."""
    import asyncio
    import socket

    from tandem.config import ServerOptions
    from tandem.errors import InvalidRequestError, ListenError
    from tandem.rpc.server import ManagedServer

    with pytest.raises(InvalidRequestError, match="--metrics-port must be in 0..65535"):
        ServerOptions(host="127.0.0.1", port=0, metrics_port=70000)

    async def taken(port: int) -> None:
        server = ManagedServer("target", ServerOptions(host="127.0.0.1", port=0, metrics_port=port))
        try:
            with pytest.raises(ListenError, match=f"target: cannot serve metrics on 127.0.0.1:{port} "
                                                  r"\(--metrics-port\)"):
                await server.start()
        finally:
            await server.server.stop(None)

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        asyncio.run(taken(holder.getsockname()[1]))


def test_tandem_up_keeps_its_coordinator_on_this_machine_unless_told_otherwise():
    """It printed 127.0.0.1 addresses while its coordinator, HTTP API and metrics listened on every interface,
    with no token: reachable from the network by anyone."""
    def host(*flags):
        args = list(up_spec(*flags).coordinator_args)
        return args[args.index("--host") + 1]

    assert host() == "127.0.0.1"
    assert host("--host", "0.0.0.0") == "0.0.0.0"


def test_a_servers_metrics_listen_on_its_own_host():
    import asyncio

    from tandem.config import ServerOptions
    from tandem.rpc.server import ManagedServer

    async def start():
        server = ManagedServer("target", ServerOptions(host="127.0.0.1", port=0, metrics_port=0))
        await server.start()
        await server.server.stop(None)
        return server.metrics_host

    assert asyncio.run(start()) == "127.0.0.1"


def test_tandem_up_runs_its_workers_on_the_device_asked_for(monkeypatch):
    """A GPU user's `tandem up` ran every worker on the CPU: there was no way to ask for CUDA."""
    import tandem.cli.up as up

    checked = []
    monkeypatch.setattr(up, "available_device", lambda device, flag: checked.append((device, flag)))  # as on a GPU
    args = list(up_spec("--device", "cuda", "--cuda-graphs").worker_args)
    assert checked == [("cuda", "--device")]
    assert args[args.index("--device") + 1] == "cuda" and "--cuda-graphs" in args
    assert "--no-cuda-graphs" in up_spec("--device", "cuda", "--no-cuda-graphs").worker_args
    args = list(up_spec().worker_args)  # unset: each worker decides by its device
    assert args[args.index("--device") + 1] == "cpu" and not {"--cuda-graphs", "--no-cuda-graphs"} & set(args)
    with pytest.raises(InvalidRequestError, match="--cuda-graphs needs --device cuda"):
        up_spec("--cuda-graphs")


@pytest.mark.parametrize("device,complaint", [
    ("gpu", "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    pytest.param("cuda", "--device cuda was asked for but CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_tandem_up_refuses_a_device_before_any_worker_starts(device, complaint):
    """Each worker refused it as it started, and `tandem up` printed a traceback of the first one's exit."""
    with pytest.raises(InvalidRequestError, match=complaint):
        up_spec("--device", device)


def test_each_change_of_the_fleet_is_said_where_tandem_up_printed_the_fleet(admin, tmp_path, said):
    secret = json.loads(state_file(tmp_path, 50051).read_text())["secret"]
    assert post(admin, {"target_replicas": 3}, **bearer(secret))[0] == 200
    assert post(admin, {"target_replicas": 2, "drain_timeout_s": 5}, **bearer(secret))[0] == 200
    assert said == [
        "scaling target replicas 1 -> 3: starting 2...",
        "target-101 (127.0.0.1:101, pid 1101) serving",
        "target-102 (127.0.0.1:102, pid 1102) serving",
        "scaling target replicas 3 -> 2: draining 1 (up to 5s for their requests)...",
        "target-102 (127.0.0.1:102) left the fleet and stopped",
    ]


def test_tandem_up_refuses_a_draft_of_another_vocabulary_before_any_process_starts(tmp_path, monkeypatch, capsys):
    """It started the fleet and said ready; the coordinator logged an error and never used the draft."""
    import tandem.cli.up as up
    from tests.tiny_models import save_tiny_tokenizer

    target, draft = save_tiny_tokenizer(tmp_path / "t", 40), save_tiny_tokenizer(tmp_path / "d", 50)
    monkeypatch.setattr(up, "resolve_or_prepare", lambda spec, root: tmp_path / spec)

    def no_cluster(spec):
        raise AssertionError("a process was started before the models were checked")

    monkeypatch.setattr(up, "LocalCluster", no_cluster)
    assert main(["up", "--target", "t", "--draft", "d", "--port", "0", "--http-port", "0",
                 "--cache-dir", str(tmp_path)]) == 2
    assert f"the draft model's tokenizer ({draft}) differs from the target's ({target})" in capsys.readouterr().err
