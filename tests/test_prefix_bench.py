"""benchmarks/prefix_bench.py: its gap statistics, hit rates and goal checks, its workloads, and a --quick run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import prefix_bench
from benchmarks.prefix_bench import Gaps, cache_delta, scenario_rows, summarize, verdicts
from tandem.v1 import common_pb2

SMOLLM2 = Path.home() / ".cache" / "tandem" / "models" / "smollm2"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="smollm2 is not prepared")


def arrivals(stall_s: float, chunk_step_s: float) -> list[tuple[float, int]]:
    """A stream at 100 ms a token for 2 s, the long prompt sent at 0 and prefilled for 3 s (one stall of
    ``stall_s`` when unchunked, else steps of ``chunk_step_s``), then 100 ms again."""
    times = [-2.0 + 0.1 * i for i in range(21)]  # up to 0.0: before the long prompt
    t = 0.0
    while t < 3.0:
        t += stall_s if stall_s else chunk_step_s
        times.append(t)
    times += [t + 0.1 * (i + 1) for i in range(5)]
    return [(x, 1) for x in times]


def test_gaps_before_and_while_a_long_prompt_is_prefilled():
    stalled = Gaps.of(arrivals(stall_s=3.2, chunk_step_s=0), first=3.0).row()
    assert stalled["p50_before_ms"] == pytest.approx(100)
    assert stalled["p99_during_ms"] == pytest.approx(3200)  # the one gap that spans the whole prefill
    assert stalled["ratio"] == pytest.approx(32)
    chunked = Gaps.of(arrivals(stall_s=0, chunk_step_s=0.15), first=3.0).row()
    assert chunked["ratio"] == pytest.approx(1.5)
    assert chunked["tokens_per_message"] == 1
    pooled = Gaps.of(arrivals(3.2, 0), 3.0) + Gaps.of(arrivals(0, 0.15), 3.0)
    assert pooled.row()["gaps"] == stalled["gaps"] + chunked["gaps"]
    assert pooled.row()["ratio"] > 20  # one stream's stall among 21 gaps while prefilled still dominates the p99


def test_scenario_rows_give_each_stream_and_the_pooled_figures():
    scenario = {"sent": 0.0, "first_token": 3.0, "long_prompt": {"ttft_s": 3.0},
                "streams": [{"arrivals": arrivals(3.2, 0)}, {"arrivals": arrivals(0, 0.15)}]}
    rows = scenario_rows("one-replica", scenario)
    assert [r["stream"] for r in rows] == ["0", "1", "pooled"]
    assert rows[-1]["long_prompt_ttft_s"] == 3.0 and rows[1]["ratio"] == pytest.approx(1.5)


def info(prompt: int, reused: int, evictions: int = 0) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(prefix_cache=common_pb2.PrefixCacheInfo(
        enabled=True, prompt_tokens=prompt, reused_tokens=reused, evictions=evictions))


def test_the_hit_rate_is_the_workers_counter_deltas_summed_over_the_replicas_of_a_role():
    before = {"target@a": info(100, 10), "target@b": info(50, 0), "draft@c": info(100, 100)}
    after = {"target@a": info(300, 160, 2), "target@b": info(150, 50), "draft@c": info(200, 120)}
    assert cache_delta(before, after, "target") == {"prompt_tokens": 300, "reused_tokens": 200, "evictions": 2}
    assert prefix_bench.hit_rate(cache_delta(before, after, "draft")) == 0.2
    assert prefix_bench.hit_rate(cache_delta(before, before, "target")) is None  # nothing sent: no rate


def result(config: str, chat_e2e: float, reused: int, probe_ttfts: tuple[float, float]) -> dict:
    """One configuration's result as run_config returns it: 1,000 prompt tokens per workload."""
    def workload(seconds: float, ttfts: tuple[float, ...], hits: int) -> dict:
        requests = [{"prompt_tokens": 1000 // len(ttfts), "reused_tokens": hits // len(ttfts), "tokens": 8,
                     "ttft_s": t, "seconds": seconds / len(ttfts), "target": f"t{i % 2}", "draft": ""}
                    for i, t in enumerate(ttfts)]
        return {"wall_s": seconds, "requests": requests,
                "target_cache": {"prompt_tokens": 1000, "reused_tokens": hits, "evictions": 0},
                "draft_cache": {"prompt_tokens": 0, "reused_tokens": 0, "evictions": 0}}

    workloads = {"chat": workload(chat_e2e, (1.0, 2.0), reused), "samples": workload(5.0, (1.0,), reused),
                 "system": workload(5.0, (1.0,), reused), "probe": workload(3.0, probe_ttfts, reused)}
    return {"config": config, "workloads": workloads, "scenario": None}


def test_the_goals_read_the_right_configurations():
    results = [result("cache-off", 10.0, 0, (2.0, 2.0)), result("cache-on+prefix", 4.0, 850, (2.0, 0.2)),
               result("one-replica", 4.0, 900, (2.0, 0.2))]
    rows = summarize(results)
    assert len(rows) == 12 and {r["per_replica"] for r in rows} == {"1/1", "1"}
    scenario = scenario_rows("one-replica", {"sent": 0.0, "first_token": 3.0, "long_prompt": {"ttft_s": 3.0},
                                             "streams": [{"arrivals": arrivals(0, 0.15)}]})
    summary, lines = verdicts(results, rows, scenario)
    assert summary["probe_cached_over_uncached"] == pytest.approx(0.1)
    assert summary["hit_rate_prefix_over_one_replica"] == pytest.approx(850 / 900)
    assert summary["chat_e2e_prefix_over_off"] == pytest.approx(0.4)
    assert summary["chunked_ratio"] == pytest.approx(1.5) and summary["unchunked_ratio"] is None
    assert [line.split()[0] for line in lines[:4]] == ["PASS"] * 4
    worse = [result("cache-off", 10.0, 0, (2.0, 2.0)), result("cache-on+prefix", 6.0, 500, (2.0, 1.0)),
             result("one-replica", 4.0, 900, (2.0, 0.2))]
    _, lines = verdicts(worse, summarize(worse), [])
    assert [line.split()[0] for line in lines[:4]] == ["FAIL", "FAIL", "FAIL", "n/a"]


def test_quick_defaults_and_the_configurations_chosen():
    args = prefix_bench.resolve_args(["--quick", "--configs", "one-replica,cache-off"])
    assert args.target == "smollm2" and args.chat_turns == 3 and args.long_prompt_tokens == 400
    assert args.configs == ["cache-off", "one-replica"]  # table order
    full = prefix_bench.resolve_args([])
    assert full.target == "qwen-coder-1.5b" and full.chat_turns == 10 and full.probe_tokens == 2000
    table = prefix_bench.configs(256)
    assert table["cache-off"].worker_args == ("--no-prefix-caching",)  # drafts too
    assert table["cache-off"].target_args == ("--prefill-chunk-tokens", "256")  # a target's flag only
    assert table["cache-off"].placement == "load" and table["cache-on+prefix"].placement == "prefix"
    assert table["no-chunking"].target_args == ("--prefill-chunk-tokens", "0")
    with pytest.raises(SystemExit):
        prefix_bench.resolve_args(["--configs", "cache-sideways"])


def test_prompts_only_caches_no_generated_blocks_and_workloads_can_be_chosen():
    table = prefix_bench.configs(None)
    assert table["prompts-only"].worker_args == ("--no-cache-generated",) and table["prompts-only"].replicas == 1
    args = prefix_bench.resolve_args(["--workloads", "chat", "--configs", "prompts-only,one-replica"])
    assert args.workloads == ["chat"] and args.configs == ["one-replica", "prompts-only"]
    assert prefix_bench.resolve_args([]).workloads == [*prefix_bench.WORKLOADS, "scenario"]
    with pytest.raises(SystemExit, match="unknown or no workloads"):
        prefix_bench.resolve_args(["--workloads", "chat,lunch"])
    results = [result("one-replica", 4.0, 900, (2.0, 0.2)), result("prompts-only", 8.0, 500, (2.0, 0.2))]
    summary, lines = verdicts(results, summarize(results), [])
    assert summary["chat_e2e_generated_over_prompts_only"] == pytest.approx(0.5)
    assert any(line.startswith("  info  chat with generated blocks cached") for line in lines)


def test_heads_methods_give_every_target_worker_the_heads():
    args = prefix_bench.resolve_args(["--method", "eagle", "--heads", "qwen-coder-1.5b-eagle"])
    assert prefix_bench.heads_args(args) == ("--heads", "qwen-coder-1.5b-eagle")
    assert prefix_bench.heads_args(prefix_bench.resolve_args([])) == ()
    with pytest.raises(SystemExit, match="--method medusa needs --heads"):
        prefix_bench.resolve_args(["--method", "medusa"])
    with pytest.raises(SystemExit, match="--method none uses no --heads"):
        prefix_bench.resolve_args(["--heads", "qwen-coder-1.5b-eagle"])


@needs_smollm2
def test_workloads_grow_the_chat_to_its_target_and_share_no_text():
    from tandem.tokenizer import encode_messages, load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    args = prefix_bench.resolve_args(["--chat-turns", "10", "--chat-tokens", "2000", "--answer-tokens", "48"])
    w = prefix_bench.build_workloads(prefix_bench.TextPool(args.spec_bench, 0, tokenizer), tokenizer, args)
    messages = []
    for user in w.chat_turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "word " * 48}]
    last = encode_messages(tokenizer, messages[:-1])
    assert 1800 <= len(last) <= 2300  # about --chat-tokens at the last turn
    assert len(w.probe) == 2000 and len(w.long_prompt) == 4000 and len(w.stream_prompts) == 4
    texts = [*w.chat_turns, w.system, *w.questions, tokenizer.decode(w.probe), tokenizer.decode(w.long_prompt)]
    heads = [t[:40] for t in texts]
    assert len(set(heads)) == len(heads)  # every workload starts on text of its own


@pytest.mark.long
@needs_smollm2
def test_a_quick_run_writes_every_configuration_and_the_goals(tmp_path):
    assert prefix_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "prefix_bench.json").read_text())
    assert (tmp_path / "prefix_bench.md").is_file() and (tmp_path / "prefix_bench.png").is_file()
    rows = {(r["config"], r["workload"]): r for r in payload["rows"]}
    assert rows[("cache-off", "chat")]["hit_rate"] == 0  # the cache off reuses nothing
    assert rows[("cache-on+prefix", "chat")]["hit_rate"] > 0.3  # each turn reuses the conversation before it
    assert rows[("cache-on+prefix", "probe")]["per_replica"] == "2"  # the probe's two sends meet on one replica
    assert {r["config"] for r in payload["scenario"]} == {"one-replica", "no-chunking"}
    assert len(payload["thresholds"]) >= 4
