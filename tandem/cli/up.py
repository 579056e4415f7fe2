"""`tandem up`: start the whole system (target and draft workers, coordinator) as local processes.

Workers load in parallel; the coordinator starts once they are all serving
and is health-checked before this prints "ready". Ctrl-C (or SIGTERM) stops
every process, coordinator first. Logs go to --log-dir. Besides gRPC the
coordinator serves the OpenAI-compatible HTTP API (--http-port, default 8000;
--no-http for gRPC only), printed with the other ports.

A process that exits on its own is restarted (a worker on a new port, the
coordinator on its own), after a backoff that doubles from 1 s to at most
60 s with each restart of its role since one of its processes last ran a
minute (a replica killed after serving a while comes back in 1 s); meanwhile
the others keep serving and the
coordinator moves requests off a dead worker. After --max-restarts restarts
of one role within --restart-window seconds, the next exit stops everything
(exit code 1): restarting is not helping then.

While it runs, `tandem scale --target-replicas N --draft-replicas M` grows or
shrinks each fleet: the coordinator follows a workers file that `tandem up`
rewrites (new workers once they serve; leaving ones after their requests
finish), so it never restarts. `tandem up` listens for that on a local HTTP
control endpoint (127.0.0.1, --admin-port) and writes where it is to
<cache root>/run/up-<port>.json, which `tandem scale --port` reads. The
endpoint answers only requests for 127.0.0.1/localhost at its port, with no
foreign Origin, carrying the secret in that file (readable by its owner
only); replica counts above --max-replicas are refused.

TLS and tokens: the `tandem serve` flags. --tls-cert/--tls-key (and
--tls-client-ca) are given to every process (the certificate must name
127.0.0.1, where the workers are reached); the coordinator reaches its workers
with --worker-tls-*, and --auth-token-file (or $TANDEM_AUTH_TOKEN) and the
request limits go to the coordinator.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tandem import model_store
from tandem.cli.draft_flags import add_draft_flags, draft_worker_args
from tandem.cli.generate import DEFAULT_TARGET, resolve_or_prepare
from tandem.cli.security_flags import add_coordinator_flags, add_server_tls_flags, coordinator_options, server_tls
from tandem.cli.serve import chunk_tokens
from tandem.cluster import ClusterSpec, LocalCluster, Service
from tandem.config import (
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_KV_CACHE_TOKENS,
    DTYPES,
    PLACEMENT_MODES,
    SCHEDULING_POLICIES,
    available_device,
    check_device_name,
    check_drain_grace_flag,
    check_log_stats_interval,
    check_room_hold_flag,
    check_served_model_names,
    check_tracing,
    read_chat_template,
)
from tandem.errors import InvalidRequestError
from tandem.log_follow import LogFollower, coordinator_summary
from tandem.rpc.auth import token_from
from tandem.rpc.room_waits import ROOM_HOLD_S
from tandem.supervisor import RestartPolicy, Supervisor
from tandem.tokenizer import check_same_tokenizer, load_tokenizer, same_tokenizer_files
from tandem.up_admin import MAX_REPLICAS, AdminServer, state_file

DEFAULT_DRAFT = "qwen-coder-0.5b"
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API's port, where such servers usually listen
# How long a process gets after SIGTERM before it is killed: at least STOP_GRACE_S, and the coordinator's drain grace
# plus STOP_MARGIN_S to close after it.
STOP_GRACE_S = 15.0
STOP_MARGIN_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start coordinator, draft and target workers locally", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL", help="target model (default: %(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, metavar="MODEL",
                   help="draft model (default: %(default)s); 'none' for no draft workers (n-gram only)")
    p.add_argument("--heads", default=None, metavar="PATH|NAME",
                   help="speculation heads for every target worker (`tandem serve target --heads`): requests "
                        "may use method medusa or eagle, and auto chooses them (with hybrid rounds, by the draft "
                        "workers, while they measure slower)")
    p.add_argument("--port", type=int, default=50051, help="coordinator gRPC port (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="where the coordinator's gRPC and HTTP APIs and its metrics listen (default: %(default)s, "
                        "this machine only; 0.0.0.0 for every interface: then protect it with --auth-token-file "
                        "and TLS). Workers always listen on 127.0.0.1")
    p.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help=f"the coordinator's OpenAI-compatible HTTP API (default: {DEFAULT_HTTP_PORT}; any free port "
                        "when --port is 0); --no-http turns it off")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
    p.add_argument("--log-requests", action="store_true",
                   help="the coordinator logs a line per request as it ends (`tandem serve coordinator "
                        "--log-requests`), shown here too")
    p.add_argument("--log-stats-interval", type=float, default=None, metavar="S",
                   help="seconds between the coordinator's stats lines while requests run, shown here too "
                        "(default: the coordinator's, 10; 0: none)")
    p.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="the names clients call the model by (`tandem serve coordinator --served-model-name`); "
                        "default: the target's --target")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the coordinator's chat template instead of the tokenizer's (`tandem serve coordinator "
                        "--chat-template`): e.g. one that shows the model its tools")
    p.add_argument("--target-replicas", type=int, default=1, help="target worker processes (default: 1)")
    p.add_argument("--draft-replicas", type=int, default=1, help="draft worker processes (default: 1)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="dtype of the target workers; drafts have --draft-dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="torch device of every worker, e.g. cuda (default: %(default)s; with "
                        "--tensor-parallel-size N on CUDA, rank r uses cuda:r)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="workers replay decode and verify steps as CUDA graphs (default: on with --device cuda and "
                        "one rank, off elsewhere; see `tandem serve target --help`)")
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: all cores)")
    p.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS,
                   help="KV pool per worker, in tokens (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="workers compute every prompt from its first token (default: they reuse the KV of "
                        "prompts that start the same way)")
    p.add_argument("--no-cache-generated", action="store_true",
                   help="workers keep only prompt blocks in their prefix cache (default: the target's generated "
                        "text's blocks too, so that a conversation's next turn finds the answer it sends back cached)")
    p.add_argument("--prefill-chunk-tokens", type=chunk_tokens, default=None, metavar="N|auto",
                   help="workers compute a long prompt N tokens per step while other streams run (a lone "
                        "prompt in larger chunks); auto: sized from the measured step cost; 0: whole (default: auto)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="each target worker splits its model over N ranks (see `tandem serve target --help`)")
    p.add_argument("--rank-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --tensor-parallel-size > 1: how long a rank may be late inside a forward pass before "
                        "its target worker exits and is restarted (see `tandem serve target --help`; default: 30)")
    p.add_argument("--pipelining", action="store_true",
                   help="draft round r+1 while round r is verified (pays when draft and target have their own "
                        "hardware; off by default here, where they share this machine's cores)")
    p.add_argument("--no-draft-stops", action="store_true",
                   help="the draft drafts every token of a round's k (`tandem serve coordinator --no-draft-stops`)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="the coordinator shares its continuation cache through this Redis (see `tandem serve "
                        "coordinator --help`); default: in-process")
    p.add_argument("--placement", choices=PLACEMENT_MODES, default="prefix",
                   help="how the coordinator picks each request's replicas: prefix (the one likely to hold the "
                        "prompt's prefix, within a bound on load) or load (see `tandem serve coordinator --help`) "
                        "(default: %(default)s)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs, or priority: requests' priority (lower first) decides who goes first where a "
                        "target's KV pool runs short (see `tandem serve coordinator --help`) (default: %(default)s)")
    p.add_argument("--drain-grace", type=float, default=DEFAULT_DRAIN_GRACE_S, metavar="SECONDS",
                   help="seconds the requests in flight get to finish when tandem up stops (Ctrl-C, SIGTERM); those "
                        "still running then end with an error that says so (default: %(default)s)")
    p.add_argument("--room-hold", type=float, default=ROOM_HOLD_S, metavar="SECONDS",
                   help="how long a request refused for room asks the target to hold it until room frees (0: "
                        "refused at once, asked again; see `tandem serve coordinator --help`) (default: %(default)s)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="every process sends OpenTelemetry spans over OTLP/gRPC to this collector, e.g. "
                        "http://127.0.0.1:4317: the coordinator a span per request, under the caller's traceparent, "
                        "the workers one per call of it (see `tandem serve coordinator --help`) (default: off)")
    add_draft_flags(p)
    p.add_argument("--admin-port", type=int, default=0,
                   help="port of the local control endpoint `tandem scale` calls, on 127.0.0.1 only "
                        "(default: a free one, recorded in <cache root>/run/up-<port>.json)")
    p.add_argument("--max-replicas", type=int, default=MAX_REPLICAS, metavar="N",
                   help="most replicas of each fleet, at start and through `tandem scale` (default: %(default)s)")
    policy = RestartPolicy()
    p.add_argument("--max-restarts", type=int, default=policy.max_restarts, metavar="N",
                   help="restarts of one role (target, draft, coordinator) within --restart-window; the next "
                        "exit stops everything (default: %(default)s)")
    p.add_argument("--restart-window", type=float, default=policy.window_s, metavar="S",
                   help="seconds over which --max-restarts counts (default: %(default)s)")
    add_server_tls_flags(p)
    add_coordinator_flags(p)
    for action in p._actions:  # tandem scale and the console name workers by address: always on here,
        if action.dest == "expose_worker_addresses":  # so not offered (still taken, for scripts that pass it)
            action.help = argparse.SUPPRESS
    p.add_argument("--log-dir", type=Path, default=None, help="where each process writes its log")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.set_defaults(func=run)


# The coordinator's limits, passed on as given (CoordinatorConfig checks them).
LIMIT_FLAGS = ("max_request_bytes", "max_prompt_tokens", "max_new_tokens_limit", "max_concurrent_per_client")


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster `tandem up` starts for these flags; refused, naming the flag, before anything starts."""
    draft = None if args.draft == "none" else args.draft
    for name, count in (("--target-replicas", args.target_replicas), ("--draft-replicas", args.draft_replicas)):
        if count > args.max_replicas:
            raise InvalidRequestError(f"{name} {count} is more than --max-replicas {args.max_replicas}")
    tls = server_tls(args)
    worker_tls = coordinator_options(args)["worker_tls"]  # every TLS file and token checked here
    if tls and not worker_tls:
        raise InvalidRequestError("--tls-cert needs --worker-tls-ca: the coordinator must verify the workers' "
                                  "certificate (the same one)")
    if tls and tls.mutual and not (worker_tls and worker_tls.cert):
        raise InvalidRequestError("--tls-client-ca needs --worker-tls-cert and --worker-tls-key: the workers "
                                  "require the coordinator's client certificate")
    # refused here, not by every worker as it starts (torch, a second of start-up, only to ask about CUDA)
    check_device_name(args.device, "--device")
    if args.device.startswith("cuda"):
        available_device(args.device, "--device")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise InvalidRequestError(f"--cuda-graphs needs --device cuda, and the workers would run on {args.device}")
    if args.rank_timeout is not None and not args.rank_timeout > 0:  # NaN too
        raise InvalidRequestError(f"--rank-timeout must be a positive number of seconds, got {args.rank_timeout}")
    check_room_hold_flag(args.room_hold)
    check_drain_grace_flag(args.drain_grace)
    check_tracing(args.otlp_traces_endpoint)
    tracing_args = ("--otlp-traces-endpoint", args.otlp_traces_endpoint) if args.otlp_traces_endpoint else ()
    target_args = ("--heads", str(args.heads)) if args.heads else ()
    if args.rank_timeout is not None:
        target_args += ("--rank-timeout", repr(args.rank_timeout))
    coordinator_args = ["--host", args.host]
    coordinator_args += ["--redis-url", args.redis_url] if args.redis_url else []
    if (http := http_port(args)) is not None:
        coordinator_args += ["--http-port", str(http)]
    coordinator_args += ["--placement", args.placement, "--scheduling-policy", args.scheduling_policy,
                         "--room-hold", repr(args.room_hold), "--drain-grace", repr(args.drain_grace),
                         *tracing_args]
    if args.log_requests:
        coordinator_args.append("--log-requests")
    if args.log_stats_interval is not None:
        check_log_stats_interval(args.log_stats_interval)  # (refused before any process starts)
        coordinator_args += ["--log-stats-interval", repr(args.log_stats_interval)]
    if args.served_model_name:
        check_served_model_names(tuple(args.served_model_name))  # (refused before any process starts)
        coordinator_args += ["--served-model-name", *args.served_model_name]
    if args.chat_template:
        read_chat_template(args.chat_template)  # refused here, named, before any process starts
        coordinator_args += ["--chat-template", str(Path(args.chat_template).resolve())]
    if args.auth_token_file:
        coordinator_args += ["--auth-token-file", str(args.auth_token_file)]
    if args.no_draft_stops:
        coordinator_args.append("--no-draft-stops")
    for name in LIMIT_FLAGS:
        if getattr(args, name) is not None:
            coordinator_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return ClusterSpec(
        target=args.target, draft=draft, port=args.port, target_replicas=args.target_replicas,
        draft_replicas=args.draft_replicas if draft else 0, dtype=args.dtype, worker_threads=args.worker_threads,
        kv_cache_tokens=args.kv_cache_tokens, tensor_parallel_size=args.tensor_parallel_size,
        pipelining=args.pipelining, draft_args=tuple(draft_worker_args(args)),
        target_args=target_args,
        # Workers are reached at 127.0.0.1 only, and have no tokens: nothing else needs to reach them.
        worker_args=("--host", "127.0.0.1", "--device", args.device, *_graphs_flag(args.cuda_graphs),
                     *(("--no-prefix-caching",) if args.no_prefix_caching else ()),
                     *(("--no-cache-generated",) if args.no_cache_generated else ()),
                     *(() if args.prefill_chunk_tokens is None else
                       ("--prefill-chunk-tokens", str(args.prefill_chunk_tokens))), *tracing_args),
        log_dir=args.log_dir, cache_dir=args.cache_dir,
        coordinator_args=tuple(coordinator_args), discovery="file", server_tls=tls, client_tls=worker_tls,
        coordinator_token=token_from(args.auth_token_file, "--auth-token-file"),
    )


def run(args: argparse.Namespace) -> int:
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    try:
        spec = cluster_spec(args)
        policy = RestartPolicy(args.max_restarts, args.restart_window)
    except ValueError as exc:  # the spec's own checks too
        raise InvalidRequestError(str(exc)) from None
    require_free_port("--port", spec.port)
    if (http := http_port(args)) is not None:
        require_free_port("--http-port", http)
    # prepared once here, not in every replica at once
    model_dirs = {model: resolve_or_prepare(model, root) for model in filter(None, (spec.target, spec.draft))}
    if spec.draft and spec.draft_replicas:  # a coordinator would start, then never use a draft of another vocabulary
        target_dir, draft_dir = Path(model_dirs[spec.target]), Path(model_dirs[spec.draft])
        if not same_tokenizer_files(target_dir, draft_dir):  # (loading both to compare costs ~4 s on 2 cores)
            check_same_tokenizer(load_tokenizer(target_dir), target_dir, draft_dir)
    cluster = LocalCluster(spec)
    print(f"starting Tandem (logs in {cluster.log_dir})...", file=sys.stderr)
    try:
        address = cluster.start()
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr)  # (start has stopped what it started)
        raise
    lock, stop = threading.Lock(), threading.Event()  # one change of the fleet at a time: scaling or a restart
    admin = AdminServer(cluster, args.admin_port, max_replicas=args.max_replicas, lock=lock,
                        say=lambda message: print(message, file=sys.stderr, flush=True))
    admin.start(state_file(root, cluster.coordinator.port))
    supervisor = Supervisor(cluster, policy, lock, stop)
    for service in cluster.services:
        print(f"  {service.role:<12} {service.address}  metrics :{service.metrics_port}  pid {service.process.pid}")
    print(f"  {'admin':<12} {admin.address}  (tandem scale --port {cluster.coordinator.port} --target-replicas N)")
    if cluster.coordinator.http_port:
        print(f"  {'http':<12} {_http_base(cluster.coordinator, spec)}  (OpenAI-compatible: /chat/completions, "
              "/completions, /responses, /models)")
    print(f"ready: tandem generate \"...\" --addr {address}{_client_flags(args)}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start()
    # The coordinator's stats lines (and request lines, with --log-requests) on this terminal, as they are logged.
    coordinator_lines = LogFollower(lambda: cluster.coordinator.log_path, coordinator_summary)
    coordinator_lines.poll()
    try:
        while not stop.wait(1.0):
            for line in coordinator_lines.poll():
                print(line, flush=True)
    finally:
        supervisor.stop()
        admin.stop()
        stop_cluster(cluster, args.drain_grace, lambda message: print(message, file=sys.stderr, flush=True))
        supervisor.join(timeout_s=30)
    return 1 if supervisor.gave_up else 0


def _graphs_flag(cuda_graphs: bool | None) -> tuple[str, ...]:
    """The workers' flag for ``--cuda-graphs`` as given (None: none, and each worker decides by its device)."""
    return () if cuda_graphs is None else ("--cuda-graphs",) if cuda_graphs else ("--no-cuda-graphs",)


def stop_cluster(cluster: LocalCluster, drain_grace_s: float, say: Callable[[str], None]) -> None:
    """Stop every process, the coordinator first, its requests given ``drain_grace_s`` (its own drain grace) to
    finish; a second Ctrl-C meanwhile stops them all at once (SIGTERM, then SIGKILL what is still up)."""
    say(f"stopping: requests in flight get up to {drain_grace_s:g} s to finish (Ctrl-C again to stop now)")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (the main thread's; a second Ctrl-C raises)
    try:
        cluster.stop(grace_s=stop_grace_s(drain_grace_s))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a third is not to leave processes behind)
        say("stopping now")
        cluster.stop(grace_s=0.0)
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_grace_s(drain_grace_s: float) -> float:
    """How long each process gets after SIGTERM before it is killed: the coordinator its drain grace and time to
    close (its requests end, saying why, a second before the grace is up), and never less than before."""
    return max(STOP_GRACE_S, drain_grace_s + STOP_MARGIN_S)


def http_port(args: argparse.Namespace) -> int | None:
    """The coordinator's HTTP port (0: any free one, as its gRPC port asks for; None: --no-http)."""
    if args.no_http:
        return None
    return args.http_port if args.http_port is not None else (DEFAULT_HTTP_PORT if args.port else 0)


def require_free_port(flag: str, port: int) -> None:
    """Refuse a port something already listens on, before any model loads (0: any free port, always fine).
    Another `tandem up` on the same port would otherwise start its workers first and fail at the end."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a port in TIME_WAIT is free
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            raise InvalidRequestError(f"{flag} {port}: {exc.strerror or exc} (another `tandem up` or server "
                                      f"listens there?); choose another port, or 0 for any free one") from None


def _http_base(coordinator: Service, spec: ClusterSpec) -> str:
    """The base URL OpenAI clients take for the coordinator's HTTP API (https with TLS)."""
    url = coordinator.http_url
    return url.replace("http://", "https://", 1) if spec.server_tls else url


def _client_flags(args: argparse.Namespace) -> str:
    """What `tandem generate --addr` needs beside the address to reach this coordinator."""
    flags = ""
    if args.tls_cert:
        flags += f" --tls-ca {args.worker_tls_ca}"
        if args.tls_client_ca:
            flags += f" --tls-cert {args.worker_tls_cert} --tls-key {args.worker_tls_key}"
    if args.auth_token_file:
        flags += f" --token-file {args.auth_token_file}"
    return flags

