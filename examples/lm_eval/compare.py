"""Compare two lm-evaluation-harness runs of the same tasks, request by request (run with --log_samples).

    python compare.py RUN_A RUN_B [TASK ...]

For each task: the largest and the mean difference of the requests' log-likelihoods, how often the two agree on
whether a continuation was the model's greedy one, and on the chosen answer of a multiple-choice document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def samples(run: Path, task: str) -> list[dict]:
    [path] = sorted(run.glob(f"*/samples_{task}_*.jsonl"))[-1:] or [None]
    if path is None:
        raise SystemExit(f"{run}: no samples of {task} (run lm_eval with --log_samples)")
    return [json.loads(line) for line in path.read_text().splitlines()]


def scores(doc: dict) -> list[tuple[float, str | None]]:
    """Each request's (log-likelihood, is-greedy or None) of one document."""
    return [(float(r[0]), r[1]) if isinstance(r, list) else (float(r), None) for r in doc["filtered_resps"]]


def compare(a: Path, b: Path, task: str) -> str:
    diffs, greedy, chosen, docs = [], 0, 0, 0
    for x, y in zip(samples(a, task), samples(b, task), strict=True):
        sx, sy = scores(x), scores(y)
        diffs += [abs(p - q) for (p, _), (q, _) in zip(sx, sy, strict=True)]
        greedy += sum(gp == gq for (_, gp), (_, gq) in zip(sx, sy))
        chosen += max(range(len(sx)), key=lambda i: sx[i][0]) == max(range(len(sy)), key=lambda i: sy[i][0])
        docs += 1
    return (f"{task}: {len(diffs)} requests, |dlogL| max {max(diffs):.3g} mean {sum(diffs) / len(diffs):.3g} nats; "
            f"greedy flags agree {greedy}/{len(diffs)}; same choice {chosen}/{docs}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    run_a, run_b = Path(sys.argv[1]), Path(sys.argv[2])
    for name in sys.argv[3:] or ["tandem_mc", "tandem_ppl"]:
        print(compare(run_a, run_b, name))
