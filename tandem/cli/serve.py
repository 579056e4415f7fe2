"""`tandem serve {coordinator,draft,target}`: run one Tandem service in this process.

Each prints a line ``TANDEM_READY role=... port=... metrics_port=...`` once
its health turns SERVING (weights loaded and warmed up); SIGTERM drains it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from tandem import model_store
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options
from tandem.cli.generate import resolve_or_prepare
from tandem.cli.security_flags import add_coordinator_flags, add_server_tls_flags, coordinator_options, server_tls
from tandem.config import (
    ATTENTION_BACKENDS,
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_KV_CACHE_TOKENS,
    DISCOVERY_MODES,
    DTYPES,
    PACKED_WEIGHTS,
    PACKED_WEIGHTS_HELP,
    PLACEMENT_MODES,
    SCHEDULING_POLICIES,
    CoordinatorConfig,
    EngineConfig,
    ServerOptions,
    WorkerConfig,
)
from tandem.errors import InvalidRequestError
from tandem.parent_watch import stop_with_launcher
from tandem.rpc.leases import DEFAULT_IDLE_TTL_S, DEFAULT_LEASE_S
from tandem.rpc.room_waits import HOLD_S, ROOM_HOLD_S
from tandem.rpc.server import configure_logging


def _addresses(values: list[str] | None) -> list[str]:
    """--x-addr may repeat and may hold comma-separated lists."""
    return [a.strip() for v in values or [] for a in v.split(",") if a.strip()]


def _server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=default_port,
                   help="gRPC port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one; default: off)")
    p.add_argument("--drain-grace", type=float, default=DEFAULT_DRAIN_GRACE_S,
                   help="seconds in-flight calls get to finish after SIGTERM (default: %(default)s)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans over OTLP/gRPC to this collector, e.g. http://otel-collector:4317 "
                        "(https:// for TLS): a coordinator's span per request, under the caller's traceparent, and "
                        "a worker's span per call of a traced request. Needs pip install 'tandem[tracing]'; "
                        "$OTEL_SERVICE_NAME and $OTEL_RESOURCE_ATTRIBUTES name the process (default: off)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    add_server_tls_flags(p)


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="catalog name, Hugging Face directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="weights/activations dtype")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="attention backend")
    p.add_argument("--packed-weights", default="auto", choices=PACKED_WEIGHTS,
                   help=PACKED_WEIGHTS_HELP)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode and verify steps of up to 64 sequences (each bringing the same 1-8 new "
                        "tokens, as chains) as captured CUDA graphs, one per batch size, tokens per sequence and "
                        "context window, the common ones captured at warm-up; other batches run eagerly. Default: "
                        "on for a one-rank worker on CUDA (eager steps there are bound by kernel launches: 4.3-5.5x "
                        "the tokens/s on an H200), off elsewhere; --no-cuda-graphs runs every step eagerly")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help=f"size of the paged KV pool in tokens (default: {DEFAULT_KV_CACHE_TOKENS})")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="CUDA: size the KV pool to what this fraction of the GPU's memory leaves once the weights "
                        "are loaded and a forward's activations are measured (as vLLM's flag; 0.9 for a GPU of its "
                        "own, less where workers share one), instead of --kv-cache-tokens")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default: %(default)s)")
    p.add_argument("--token-budget", type=int, default=2048,
                   help="most tokens in one batched forward pass (default: %(default)s)")
    p.add_argument("--prefill-chunk-tokens", type=chunk_tokens, default=None, metavar="N|auto",
                   help="while other streams run, compute a long prompt N tokens per batch step beside them; "
                        "auto: sized so that a chunk makes a step at most 0.8x dearer, from the measured cost of "
                        "a step and of prompt tokens. A prompt arriving alone goes in larger chunks (each at least "
                        "N, a second's worth and 20x what reading the weights costs), so that a request arriving "
                        "during it waits one chunk; 0: always the whole prompt at once (default: auto)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt from its first token; by default the KV of committed full blocks "
                        "is kept after a request ends and reused by prompts that start the same way")
    p.add_argument("--no-cache-generated", action="store_true",
                   help="keep only prompt blocks in the prefix cache; by default the full blocks of the target's "
                        "generated text are kept too (where a generated token's KV is what a prompt computes), so "
                        "that a conversation's next turn, which sends the answer back in its prompt, finds it cached")
    p.add_argument("--no-shared-prompt-wait", action="store_true",
                   help="target: compute every prompt as it arrives; by default a new prompt sharing a long prefix "
                        "with one being computed (the n choices of one prompt, one context's answers sent "
                        "together) waits for it, when the measured costs say so, and takes the prefix from the "
                        "prefix cache")
    p.add_argument("--gather-fraction", type=float, default=None,
                   help="while a sequence that called recently has not called again, wait for it up to this many "
                        "forward passes, so batches fill; 0: never wait (default: 1 for target, 8 for draft)")
    p.add_argument("--sequence-lease", type=float, default=DEFAULT_LEASE_S, metavar="SECONDS",
                   help="free the sequences of a coordinator not heard from (no call, no Info heartbeat, which "
                        "it sends every third of this) for this long: one that crashed or was cut off leaves "
                        "no KV behind; freed within 1.25x this (default: %(default)s)")
    p.add_argument("--sequence-idle-ttl", type=float, default=DEFAULT_IDLE_TTL_S, metavar="SECONDS",
                   help="free any sequence idle this long, whatever its coordinator (a lost Release); "
                        "0: never (default: %(default)s)")
    p.add_argument("--startup-lock", type=Path, default=None, metavar="FILE",
                   help="workers that share one machine's cores and name the same FILE load and warm up one at a "
                        "time: each times its kernels and fits its forward cost at start, and timings taken while "
                        "another worker computes are several times too dear (`tandem up` sets it; default: none)")


def chunk_tokens(value: str) -> int | None:
    """``--prefill-chunk-tokens``: a count, or auto (None)."""
    if value == "auto":
        return None
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or auto, got {value!r}") from None
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 tokens (0: no chunking), got {tokens}")
    return tokens


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one service (coordinator, draft or target worker)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    roles = p.add_subparsers(dest="role", metavar="ROLE", required=True)

    target = roles.add_parser("target", help="target worker: the large model, batched Prefill/Verify")
    _worker_flags(target)
    target.add_argument("--heads", default=None, metavar="PATH|NAME",
                        help="speculation heads trained for this target (Medusa or EAGLE-3: a directory in "
                             "Tandem's, the Medusa project's or the speculators library's layout, or the name of "
                             "heads prepared with `tandem heads prepare`): requests may then use method medusa or "
                             "eagle, and auto chooses them")
    target.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N ranks (processes), one device each: gloo on --device cpu, "
                             "NCCL with rank r on cuda:r for --device cuda; heads and KV heads must divide by N. "
                             "--threads is then per rank (default: cores / N) (default: %(default)s)")
    target.add_argument("--rank-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="with --tensor-parallel-size > 1: a rank this late inside a forward pass is taken for "
                             "dead, and the worker exits with code 75 so that it is restarted (default: %(default)s)")
    _server_flags(target, 50052)
    target.set_defaults(func=run_worker)

    draft = roles.add_parser("draft", help="draft worker: the small model, batched Propose")
    _worker_flags(draft)
    add_draft_flags(draft, prefix="--")
    _server_flags(draft, 50053)
    draft.set_defaults(func=run_worker)

    coord = roles.add_parser("coordinator", help="coordinator: the public Generation API")
    coord.add_argument("--discovery", choices=DISCOVERY_MODES, default="static",
                       help="how workers are found (default: %(default)s): static (--target-addr/--draft-addr), "
                            "file (--workers-file, re-read when it changes), dns (the A/AAAA records of "
                            "--target-service/--draft-service, re-resolved every few seconds), kubernetes (a watch "
                            "of those Services' EndpointSlices). Replicas that join are used once their Info "
                            "answers; replicas that leave get no new requests and finish the ones they have.")
    coord.add_argument("--target-addr", action="append", default=None, metavar="HOST:PORT",
                       help="static: a target worker (repeat, or comma-separate, for several replicas)")
    coord.add_argument("--draft-addr", action="append", default=None, metavar="HOST:PORT",
                       help="static: a draft worker (repeat, or comma-separate); none: n-gram or plain decoding only")
    coord.add_argument("--workers-file", type=Path, default=None, metavar="PATH",
                       help='file: JSON {"target": ["HOST:PORT", ...], "draft": [...]} (what `tandem up` writes)')
    coord.add_argument("--target-service", default=None, metavar="NAME",
                       help="dns: the target workers' headless Service DNS name; kubernetes: its Service name")
    coord.add_argument("--draft-service", default=None, metavar="NAME",
                       help="dns/kubernetes: the draft workers' Service (default: no draft fleet)")
    coord.add_argument("--target-port", type=int, default=None,
                       help="dns/kubernetes: the target workers' gRPC port (default: 50052 for dns; for kubernetes "
                            "the EndpointSlice's port named grpc, else its first)")
    coord.add_argument("--draft-port", type=int, default=None,
                       help="dns/kubernetes: the draft workers' gRPC port (default: 50053 for dns; as --target-port "
                            "for kubernetes)")
    coord.add_argument("--namespace", default=None,
                       help="kubernetes: the Services' namespace (default: the pod's own, else 'default')")
    coord.add_argument("--kubeconfig", default=None, metavar="PATH",
                       help="kubernetes: a kubeconfig file (default: the in-cluster service account, else "
                            "$KUBECONFIG or ~/.kube/config). Discovery needs list and watch on endpointslices.")
    coord.add_argument("--tokenizer", required=True, metavar="MODEL",
                       help="the target model (catalog name or directory): only its tokenizer is loaded")
    coord.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template to use instead of the tokenizer's (as transformers renders it): "
                            "e.g. one that shows the model its tools, for a model whose own template does not")
    coord.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                       help="seconds between the log's stats lines while requests run: running and waiting requests, "
                            "tokens/s, finished requests, target KV use, speculation's acceptance (default: "
                            "%(default)s; 0: none)")
    coord.add_argument("--log-requests", action="store_true",
                       help="log a line per request as it ends: its id, outcome, tokens, speed, speculation and "
                            "replicas (never its text)")
    coord.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                       help="the names clients call the model by, in both APIs (the `model` field, /v1/models, "
                            "metrics' model_name); replies name the first. Default: the target workers' --model")
    coord.add_argument("--max-new-tokens", type=int, default=256,
                       help="default when a gRPC or legacy completions request leaves it unset; chat completions "
                            "and responses that leave it unset get what the context leaves, as OpenAI's "
                            "(default: %(default)s)")
    coord.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=4,
                       help="default most draft tokens per round from a draft model (default: %(default)s); a "
                            "request's lookup rounds (its text's repeats, the continuation cache, its prediction) "
                            "verify up to 15 as their kind of match earns, unless the request sets k")
    coord.add_argument("--no-pipelining", action="store_true",
                       help="draft round r+1 only after round r is verified")
    coord.add_argument("--no-draft-stops", action="store_true",
                       help="the draft model drafts every token of a round's k, instead of stopping where its own "
                            "probabilities say the target will likely turn the rest down (for a draft whose "
                            "confidence does not track the target's agreement)")
    coord.add_argument("--call-timeout", type=float, default=60.0,
                       help="deadline of each internal call, seconds (a call that reads a prompt gets 4x its "
                            "tokens' measured price on that worker on top): a worker that takes longer is taken "
                            "for hung, "
                            "marked unhealthy until its Info answers again, and its requests move "
                            "(default: %(default)s)")
    coord.add_argument("--max-moves", type=int, default=3,
                       help="times one request may move to another target (or draft) replica after the one it runs "
                            "on fails (killed, hung past --call-timeout, restarted); its KV is rebuilt there from "
                            "the coordinator's token history (default: %(default)s)")
    coord.add_argument("--move-wait", type=float, default=30.0,
                       help="seconds a moving request waits for a healthy target replica (default: %(default)s)")
    coord.add_argument("--placement", choices=PLACEMENT_MODES, default="prefix",
                       help="how a new request's target and draft replicas are chosen (default: %(default)s): prefix "
                            "(the replica that most likely holds the prompt's first blocks in its prefix cache, by "
                            "rendezvous hashing, unless it carries 1.25x the mean load: then the next; prompts under "
                            "16 tokens go by load) or load (most free KV, then the shortest queue)")
    coord.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                       help="who goes first where a target's KV pool runs short (default: %(default)s): fcfs (the "
                            "oldest sequences; a request's priority must be 0, as vLLM's default) or priority "
                            "(vLLM's: a request's priority, lower first, then fcfs; a prompt of a higher priority "
                            "starts ahead of the growth of lower ones, which are preempted and resume later)")
    coord.add_argument("--room-hold", type=float, default=ROOM_HOLD_S, metavar="SECONDS",
                       help="a request refused for room asks its target to hold its next Prefill this long, at most "
                            f"{HOLD_S:g} s: admitted in the step that frees its room, whichever coordinator's request "
                            "frees it, so that requests from every coordinator start in the order they came; 0: "
                            "refused at once and asked again after a pause (a later prompt may then take room that "
                            "frees meanwhile) (default: %(default)s)")
    coord.add_argument("--ngram-min", type=int, default=1)
    coord.add_argument("--ngram-max", type=int, default=4)
    coord.add_argument("--no-continuation-cache", action="store_true",
                       help="n-gram proposals from each request's own text only (no cache of what requests generated)")
    coord.add_argument("--redis-url", default=None, metavar="URL",
                       help="share the continuation cache with every coordinator through Redis: redis://HOST:PORT/DB "
                            "or rediss:// (TLS); a password in the URL or in $TANDEM_REDIS_PASSWORD. Default: an "
                            "in-process cache. Redis trouble never fails a request: the local tier answers alone.")
    coord.add_argument("--http-port", type=int, default=None, metavar="PORT",
                       help="also serve the OpenAI-compatible HTTP API (POST /v1/chat/completions, /v1/completions, "
                            "GET /v1/models, /health) on this port, 0 for any free one; same host, TLS, tokens and "
                            "limits as gRPC (default: off)")
    coord.add_argument("--max-connection-age", type=float, default=0.0, metavar="SECONDS",
                       help="ask a client to reconnect once its connection is this old (gRPC GOAWAY; HTTP "
                            "'Connection: close'), its calls in flight finishing first: behind a Kubernetes Service, "
                            "which balances connections and not calls, clients then spread over every replica, new "
                            "ones included (the Helm chart sets 300; default: 0, never)")
    add_coordinator_flags(coord)
    _server_flags(coord, 50051)
    coord.set_defaults(func=run_coordinator)


def _server_options(args: argparse.Namespace) -> ServerOptions:
    age = getattr(args, "max_connection_age", 0.0)  # (the coordinator's flag: workers are dialed per replica)
    return ServerOptions(args.host, args.port, args.metrics_port, args.drain_grace, tls=server_tls(args),
                         max_connection_age_s=age or None, otlp_traces_endpoint=args.otlp_traces_endpoint)


def run_worker(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    stop_with_launcher()
    if args.threads:
        import torch  # workers only: the coordinator runs without torch

        torch.set_num_threads(args.threads)
    cfg = worker_config(args)
    if args.role == "target":
        from target_worker.main import serve
    else:
        from draft_worker.main import serve
    asyncio.run(serve(cfg))
    return 0


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """A worker's configuration from its flags (the model found or prepared in the cache), validated."""
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    role_options = draft_engine_options(args) if args.role == "draft" else {
        "tensor_parallel_size": args.tensor_parallel_size, "rank_timeout_s": args.rank_timeout}
    if args.gpu_memory_utilization is not None and args.kv_cache_tokens is not None:
        raise InvalidRequestError("--kv-cache-tokens and --gpu-memory-utilization both size the KV pool: give one")
    kv_tokens = DEFAULT_KV_CACHE_TOKENS if args.kv_cache_tokens is None else args.kv_cache_tokens
    engine = EngineConfig(resolve_or_prepare(args.model, root), args.dtype, args.device, args.block_size,
                          kv_tokens, args.attention, num_threads=args.threads,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          packed_weights=args.packed_weights, prefix_caching=not args.no_prefix_caching,
                          cuda_graphs=args.cuda_graphs, **role_options)
    return WorkerConfig(engine, _server_options(args), model_name=args.model, token_budget=args.token_budget,
                        gather_fraction=args.gather_fraction, lease_s=args.sequence_lease,
                        idle_ttl_s=args.sequence_idle_ttl, heads=_heads_path(args, root),
                        prefill_chunk_tokens=args.prefill_chunk_tokens, startup_lock=args.startup_lock,
                        cache_generated=not args.no_cache_generated,
                        shared_prompt_wait=not args.no_shared_prompt_wait)


def _heads_path(args: argparse.Namespace, root: Path) -> Path | None:
    if args.role != "target" or not args.heads:
        return None
    from tandem.heads.locate import resolve_heads

    return resolve_heads(args.heads, root)


def run_coordinator(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    stop_with_launcher()
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    cfg = CoordinatorConfig(
        server=_server_options(args), tokenizer_dir=resolve_or_prepare(args.tokenizer, root),
        target_addrs=_addresses(args.target_addr), draft_addrs=_addresses(args.draft_addr),
        discovery=args.discovery, workers_file=args.workers_file, target_service=args.target_service,
        draft_service=args.draft_service, target_port=args.target_port, draft_port=args.draft_port,
        namespace=args.namespace, kubeconfig=args.kubeconfig,
        default_max_new_tokens=args.max_new_tokens, default_k=args.k, pipelining=not args.no_pipelining,
        draft_stops=not args.no_draft_stops,
        call_timeout_s=args.call_timeout, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        redis_url=args.redis_url, continuation_cache=not args.no_continuation_cache,
        max_moves=args.max_moves, move_wait_s=args.move_wait, placement=args.placement,
        scheduling_policy=args.scheduling_policy, room_hold_s=args.room_hold, http_port=args.http_port,
        chat_template=args.chat_template, served_model_names=tuple(args.served_model_name),
        log_stats_interval_s=args.log_stats_interval, log_requests=args.log_requests,
        **coordinator_options(args),
    )
    from coordinator.main import serve

    asyncio.run(serve(cfg))
    return 0
