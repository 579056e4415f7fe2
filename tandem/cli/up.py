"""`tandem up`: start the whole system (target and draft workers, coordinator) as local processes.

Workers load in parallel; the coordinator starts once they are all serving
and is health-checked before this prints "ready". Ctrl-C (or SIGTERM) stops
every process, coordinator first. Logs go to --log-dir.

While it runs, `tandem scale --target-replicas N --draft-replicas M` grows or
shrinks each fleet: the coordinator follows a workers file that `tandem up`
rewrites (new workers once they serve; leaving ones after their requests
finish), so it never restarts. `tandem up` listens for that on a local HTTP
control endpoint (127.0.0.1, --admin-port) and writes where it is to
<cache root>/run/up-<port>.json, which `tandem scale --port` reads.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from tandem import model_store
from tandem.cli.draft_flags import add_draft_flags, draft_worker_args
from tandem.cli.generate import DEFAULT_TARGET, resolve_or_prepare
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.config import DTYPES
from tandem.up_admin import AdminServer, state_file

DEFAULT_DRAFT = "qwen-coder-0.5b"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start coordinator, draft and target workers locally", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL", help="target model (default: %(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, metavar="MODEL",
                   help="draft model (default: %(default)s); 'none' for no draft workers (n-gram only)")
    p.add_argument("--port", type=int, default=50051, help="coordinator gRPC port (default: %(default)s)")
    p.add_argument("--target-replicas", type=int, default=1, help="target worker processes (default: 1)")
    p.add_argument("--draft-replicas", type=int, default=1, help="draft worker processes (default: 1)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="dtype of the target workers; drafts have --draft-dtype (default: %(default)s)")
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: all cores)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool per worker, in tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="each target worker splits its model over N ranks (see `tandem serve target --help`)")
    p.add_argument("--pipelining", action="store_true",
                   help="draft round r+1 while round r is verified (pays when draft and target have their own "
                        "hardware; off by default here, where they share this machine's cores)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="the coordinator shares its continuation cache through this Redis (see `tandem serve "
                        "coordinator --help`); default: in-process")
    add_draft_flags(p)
    p.add_argument("--admin-port", type=int, default=0,
                   help="port of the local control endpoint `tandem scale` calls, on 127.0.0.1 only "
                        "(default: a free one, recorded in <cache root>/run/up-<port>.json)")
    p.add_argument("--log-dir", type=Path, default=None, help="where each process writes its log")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    draft = None if args.draft == "none" else args.draft
    for model in filter(None, (args.target, draft)):  # prepare once here, not in every replica at the same time
        resolve_or_prepare(model, root)
    spec = ClusterSpec(
        target=args.target, draft=draft, port=args.port, target_replicas=args.target_replicas,
        draft_replicas=args.draft_replicas if draft else 0, dtype=args.dtype, worker_threads=args.worker_threads,
        kv_cache_tokens=args.kv_cache_tokens, tensor_parallel_size=args.tensor_parallel_size,
        pipelining=args.pipelining, draft_args=tuple(draft_worker_args(args)),
        log_dir=args.log_dir, cache_dir=args.cache_dir,
        coordinator_args=("--redis-url", args.redis_url) if args.redis_url else (), discovery="file",
    )
    cluster = LocalCluster(spec)
    print(f"starting Tandem (logs in {cluster.log_dir})...", file=sys.stderr)
    address = cluster.start()
    admin = AdminServer(cluster, args.admin_port)
    admin.start(state_file(root, cluster.coordinator.port))
    for service in cluster.services:
        print(f"  {service.role:<12} {service.address}  metrics :{service.metrics_port}  pid {service.process.pid}")
    print(f"  {'admin':<12} {admin.address}  (tandem scale --port {cluster.coordinator.port} --target-replicas N)")
    print(f"ready: tandem generate \"...\" --addr {address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            # A copy: `tandem scale` changes the fleet from the control endpoint's thread. Workers it removes
            # leave the list before they are stopped, so only an unexpected exit shows up here.
            dead = [s for s in list(cluster.services) if s.process.poll() is not None]
            if dead:
                print(f"{dead[0].role} exited (code {dead[0].process.returncode}); stopping", file=sys.stderr)
                break
    finally:
        print("stopping...", file=sys.stderr)
        admin.stop()
        cluster.stop()
    return 0
