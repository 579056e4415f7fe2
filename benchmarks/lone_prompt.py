"""A long prompt on an idle target, and a short request that arrives while it is read: chunked or whole.

A target computes a prompt that arrives while other streams decode in chunks beside them
(tandem/rpc/prefill_chunks.py). A lone prompt, one that arrives while nothing else runs, is cut
too, into larger chunks (``PrefillChunks.lone_size``): a request arriving during its prefill then
waits one chunk, not the whole prompt, and a client that gives up stops it at the next chunk.
Two configurations, each on processes of its own (tandem.cluster.LocalCluster, as `tandem up`
starts them): the target worker as it is, and with ``--prefill-chunk-tokens 0`` (every prompt
whole: what a lone prompt was before it was cut). One target replica, no draft model, method
none, so that what is measured is prompt reading. Workloads, each ``--reps`` times with a new
long prompt each time (nothing cached from the time before):

  alone      the long prompt of ``--long-tokens`` alone, ``--long-new-tokens`` after it: the
             price of the chunks to its own time to first token
  newcomer   the long prompt, then ``--delay`` seconds later a short one of ``--short-tokens``
             writing ``--short-new-tokens``: the newcomer's time to first token (from its send)
  cancelled  the long prompt, cancelled by its client after ``--delay`` seconds, then the short
             one at once: how long the target goes on reading a prompt nobody waits for

Reported per configuration and workload: the median of each time, in seconds, per request
from its own send.

Writes lone_prompt.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/lone_prompt.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.shared_prompt_wait import prompt_of  # noqa: E402

NAME = "lone_prompt"
CONFIGS = {"lone chunks (default)": (), "--prefill-chunk-tokens 0": ("--prefill-chunk-tokens", "0")}
WORKLOADS = ("alone", "newcomer", "cancelled")
TIMES = ("long_ttft_s", "short_ttft_s", "short_wall_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--long-tokens", type=int, default=2000, help="the long prompt, tokens")
    p.add_argument("--long-new-tokens", type=int, default=4, help="tokens the long prompt's request writes")
    p.add_argument("--short-tokens", type=int, default=32, help="the newcomer's prompt, tokens")
    p.add_argument("--short-new-tokens", type=int, default=16, help="tokens the newcomer writes")
    p.add_argument("--delay", type=float, default=5.0, help="seconds after the long prompt's send: the newcomer's "
                                                            "send, or the long one's cancel")
    p.add_argument("--reps", type=int, default=2, help="times per workload (median kept), a new long prompt each")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


class Streamed:
    """One request streamed on a thread of its own: its time to first token and its end, from its send."""

    def __init__(self, client: Any, request: Any) -> None:
        self.sent = time.perf_counter()
        self.call = client.stream(request)
        self.first_s: float | None = None
        self.wall_s: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                if self.first_s is None and message.token_ids:
                    self.first_s = time.perf_counter() - self.sent
            self.wall_s = time.perf_counter() - self.sent
        except BaseException as exc:  # noqa: BLE001 - a cancelled call ends so; the caller reads it
            self.error = exc

    def join(self) -> Streamed:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self

    def cancel(self) -> None:
        self.call.cancel()
        self._thread.join()


def one_time(client: Any, workload: str, seed: int, args: argparse.Namespace) -> dict[str, float | None]:
    from tandem.client import build_request

    long = build_request(prompt_of(seed, args.long_tokens), max_new_tokens=args.long_new_tokens, method="none",
                         ignore_eos=True)
    short = build_request(prompt_of(seed + 10_000, args.short_tokens), max_new_tokens=args.short_new_tokens,
                          method="none", ignore_eos=True)
    first = Streamed(client, long)
    if workload == "alone":
        return {"long_ttft_s": first.join().first_s, "short_ttft_s": None, "short_wall_s": None}
    time.sleep(args.delay)
    if workload == "cancelled":
        first.cancel()
        if first.first_s is not None:
            raise SystemExit(f"the long prompt gave its first token within --delay {args.delay} s: nothing to cancel")
        newcomer = Streamed(client, short).join()
        return {"long_ttft_s": None, "short_ttft_s": newcomer.first_s, "short_wall_s": newcomer.wall_s}
    newcomer = Streamed(client, short).join()
    return {"long_ttft_s": first.join().first_s, "short_ttft_s": newcomer.first_s, "short_wall_s": newcomer.wall_s}


def run_config(name: str, target_args: tuple[str, ...], args: argparse.Namespace, workdir: Path
               ) -> list[dict[str, Any]]:
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(target=args.target, draft=None, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                       target_args=target_args, log_dir=workdir / ("chunks" if not target_args else "whole"))
    print(f"[{NAME}] {name}: starting {args.target}", file=sys.stderr, flush=True)
    rows = []
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=3600) as client:
        client.generate(build_request([11, 12, 13], max_new_tokens=2, method="none"))  # a first call, uncounted
        for w, workload in enumerate(WORKLOADS):
            times = []
            for rep in range(args.reps):
                print(f"[{NAME}] {name}: {workload} {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
                times.append(one_time(client, workload, 100 * w + rep, args))
                time.sleep(1.0)  # a cancelled prompt's release reaches the worker before the next time starts
            row: dict[str, Any] = {"config": name, "workload": workload}
            for key in TIMES:
                values = [t[key] for t in times if t[key] is not None]
                row[key] = statistics.median(values) if values else None
            rows.append(row)
    return rows


def chart(rows: list[dict[str, Any]], out: Path, name: str, long_tokens: int) -> Path:
    fig, axes = new_figure(ncols=2, width=5.5)
    cell = {(r["config"], r["workload"]): r for r in rows}
    grouped_bars(axes[0], ["alone", "newcomer"],
                 {c: [cell[c, "alone"]["long_ttft_s"], cell[c, "newcomer"]["long_ttft_s"]] for c in CONFIGS},
                 "long prompt's time to first token, s")
    axes[0].set_title(f"the long prompt ({long_tokens} tokens)")
    grouped_bars(axes[1], ["newcomer", "cancelled"],
                 {c: [cell[c, "newcomer"]["short_ttft_s"], cell[c, "cancelled"]["short_ttft_s"]] for c in CONFIGS},
                 "short request's time to first token, s")
    axes[1].set_title("a short request arriving during it")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = build_parser().parse_args(argv)
    counts = (args.long_tokens, args.long_new_tokens, args.short_tokens, args.short_new_tokens, args.reps)
    if min(counts) < 1 or args.delay < 0:
        raise SystemExit("--long-tokens, --long-new-tokens, --short-tokens, --short-new-tokens and --reps must be "
                         ">= 1, --delay >= 0")
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as workdir:
        rows = [row for name, flags in CONFIGS.items() for row in run_config(name, flags, args, Path(workdir))]
    machine = machine_info()
    table = markdown_table(rows, ["workload", "config", *TIMES])
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "A long prompt on an idle target, and a short request arriving during it",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name, args.long_tokens)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
