"""Wire encoding of draft distributions: the cost per draft step, before and after batching it.

A sampled draft step turns R rows of q (one per sequence drafting in the
step, over the whole vocabulary) into wire messages. Before: one
``encode_distribution`` per row (nonzero, ``.numpy()`` and ``.tolist()`` row
by row; ``.numpy()`` raises on a GPU tensor). After: ``encode_distributions``
over the batch (mask, support and float16 values computed on q's device,
packed, one device-to-host copy, split on the host).

Two figures per R:

* ``encode``: q -> messages, old per-row against new batched;
* ``step``: all the work of one sampled draft step after the forward pass
  and ``probabilities``: encoding, what the draft samples from, drawing one
  token per row. Old: ``wire_roundtrip(q)`` (encode + decode per row),
  ``torch.multinomial`` over each dense decoded row, and the service's
  second encoding; new: ``encode_for_sampling(q)`` (encode once; the decoded
  rows built from the same host arrays) and ``torch.multinomial`` over each
  row's support.

Two kinds of q over 151,936 ids (Qwen's vocabulary): ``peaked``, softmax of
N(0, 4^2) logits (a few thousand ids above the 1e-6 cut, like an LM at
temperature 1) and ``flat``, softmax of N(0, 1) logits (almost every id kept:
the worst case). Median of --reps rounds after --warmup untimed ones; each
round runs old and new in turn. One torch thread by default (--threads).

Writes wire_encoding.json into --out (default benchmarks/results) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/wire_encoding.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import DEFAULT_RESULTS_DIR, interleaved_medians, markdown_table, write_json  # noqa: E402
from tandem.rpc import distributions  # noqa: E402
from tandem.v1 import common_pb2  # noqa: E402

VOCAB = 151_936
ROWS = (1, 4, 8)
KINDS = {"peaked": 4.0, "flat": 1.0}  # logit scale


# ----- the encoder as it was (tandem/rpc/wire.py before batching), for reference -----------
def old_encode_distribution(q: torch.Tensor) -> common_pb2.SparseDistribution:
    ids = torch.nonzero(q >= distributions.MIN_WIRE_PROB).squeeze(-1)
    values = q[ids].to(torch.float16).numpy().astype("<f2")
    return common_pb2.SparseDistribution(token_ids=ids.tolist(), probs_fp16=values.tobytes())


def old_decode_distribution(msg: common_pb2.SparseDistribution, vocab_size: int) -> torch.Tensor:
    values = np.frombuffer(msg.probs_fp16, dtype="<f2").astype(np.float64)
    ids = np.asarray(msg.token_ids, dtype=np.int64)
    dense = np.zeros(vocab_size, dtype=np.float64)
    dense[ids] = values / values.sum()
    return torch.from_numpy(dense).float()


def old_encode(q: torch.Tensor) -> list[common_pb2.SparseDistribution]:
    return [old_encode_distribution(row) for row in q]


def old_step(q: torch.Tensor, generator: torch.Generator) -> list[common_pb2.SparseDistribution]:
    sampled_from = torch.stack([old_decode_distribution(old_encode_distribution(row), q.shape[-1]) for row in q])
    for r in range(q.shape[0]):
        torch.multinomial(sampled_from[r : r + 1], 1, generator=generator)
    return [old_encode_distribution(row) for row in sampled_from]  # the service's second encoding


def new_step(q: torch.Tensor, generator: torch.Generator) -> list[common_pb2.SparseDistribution]:
    wire = distributions.encode_for_sampling(q)
    for r in range(q.shape[0]):
        wire.token_ids[r][int(torch.multinomial(wire.probs[r][None], 1, generator=generator)[0])]
    return wire.messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="timed runs per case (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    load_before = os.getloadavg()[0]
    records = []
    for kind, scale in KINDS.items():
        for rows in ROWS:
            gen = torch.Generator().manual_seed(rows)
            q = torch.softmax(torch.randn(rows, VOCAB, generator=gen) * scale, -1)
            support = int((q >= distributions.MIN_WIRE_PROB).sum(-1).float().mean())
            record = {"q": kind, "rows": rows, "support_per_row": support}
            names = ("encode_old_ms", "encode_new_ms", "step_old_ms", "step_new_ms")
            calls = [(lambda q=q: old_encode(q), None), (lambda q=q: distributions.encode_distributions(q), None),
                     (lambda q=q, gen=gen: old_step(q, gen), None), (lambda q=q, gen=gen: new_step(q, gen), None)]
            # Old and new alternate within each round: machine noise hits both alike.
            for name, seconds in zip(names, interleaved_medians(calls, args.reps, args.warmup)):
                record[name] = seconds * 1e3
            record["encode_speedup"] = record["encode_old_ms"] / record["encode_new_ms"]
            record["step_speedup"] = record["step_old_ms"] / record["step_new_ms"]
            records.append(record)
            print(f"{kind:>6} R={rows}: encode {record['encode_old_ms']:.2f} -> {record['encode_new_ms']:.2f} ms, "
                  f"step {record['step_old_ms']:.2f} -> {record['step_new_ms']:.2f} ms", file=sys.stderr)

    settings = {"vocab": VOCAB, "rows": list(ROWS), "kinds": KINDS, "reps": args.reps, "warmup": args.warmup,
                "threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
                "min_wire_prob": distributions.MIN_WIRE_PROB, "cpus": os.cpu_count(),
                # other work on the machine inflates every figure; the ratios hold better (interleaved rounds)
                "load_average_1min": [load_before, os.getloadavg()[0]]}
    path = write_json(args.out, "wire_encoding", {"settings": settings, "records": records})
    columns = ["q", "rows", "support_per_row", "encode_old_ms", "encode_new_ms", "encode_speedup",
               "step_old_ms", "step_new_ms", "step_speedup"]
    print(markdown_table(records, columns))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
