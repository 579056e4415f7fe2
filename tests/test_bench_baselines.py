"""spec_bench and engine_speed: every speedup over both baselines, and the forward(1) <= forward(5) check."""

from __future__ import annotations

from typing import Any

from benchmarks import engine_speed, spec_bench
from benchmarks.common import markdown_table


def run(method: str, category: str, tokens: int, seconds: float, decode_seconds: float | None = None) -> dict[str, Any]:
    """A per-prompt row as spec_bench's run_prompt writes it (decode fields where the method times its prefill)."""
    row: dict[str, Any] = {"prompt_id": f"{category}/0", "category": category, "method": method, "prompt_tokens": 10,
                           "tokens": tokens, "seconds": seconds, "matches_target_only": True}
    if decode_seconds is not None:
        row.update(decode_tokens=tokens - 1, decode_seconds=decode_seconds)
    return row


def test_every_speedup_is_given_over_target_only_and_over_hf_plain():
    runs = [run("target-only", "humaneval", 10, 1.0, 0.9), run("hf-plain", "humaneval", 10, 2.0, 1.8),
            run("hf-assisted", "humaneval", 10, 0.5),
            run("target-only", "qa", 20, 2.0, 1.9), run("hf-plain", "qa", 20, 1.0, 0.95),
            run("hf-assisted", "qa", 20, 4.0)]
    rows = spec_bench.summarize(runs, ["target-only", "hf-plain", "hf-assisted"], {})
    by = {(r["method"], r["category"]): r for r in rows}
    assert by[("hf-assisted", "humaneval")]["speedup"] == 2.0
    assert by[("hf-assisted", "humaneval")]["speedup_vs_hf_plain"] == 4.0
    assert by[("hf-assisted", "qa")]["speedup"] == 0.5
    assert by[("hf-assisted", "qa")]["speedup_vs_hf_plain"] == 0.25
    assert by[("hf-assisted", "spec-bench-mix")]["speedup_vs_hf_plain"] == 0.25  # humaneval left out
    assert by[("hf-assisted", "all")]["speedup_vs_hf_plain"] == 30 / 4.5 / (30 / 3.0)
    assert by[("target-only", "humaneval")]["speedup_vs_hf_plain"] == 2.0
    assert by[("hf-plain", "qa")]["speedup"] == 2.0
    # the decoding phase too: hf-plain's is timed apart from its prefill, so it is a baseline of decode_speedup
    assert by[("target-only", "humaneval")]["decode_speedup_vs_hf_plain"] == 2.0
    assert by[("hf-plain", "humaneval")]["decode_speedup"] == 0.5


def test_hf_plain_runs_in_every_spec_bench_run():
    args = spec_bench.resolve_args(spec_bench.build_parser().parse_args(["--methods", "spec-ngram"]))
    assert args.methods == ["target-only", "hf-plain", "spec-ngram"]
    assert "hf-plain" in spec_bench.DEFAULT_METHODS


def test_sampled_runs_compare_speed_but_count_no_mismatches():
    """Sampled outputs differ run to run: nothing to count against target-only's tokens, and a bad temperature is
    refused before anything loads."""
    runs = [{**run("target-only", "qa", 20, 2.0, 1.9), "matches_target_only": None},
            {**run("hf-plain", "qa", 30, 2.0, 1.9), "matches_target_only": None}]
    by = {(r["method"], r["category"]): r for r in spec_bench.summarize(runs, ["target-only", "hf-plain"], {})}
    assert by[("hf-plain", "qa")]["speedup"] == 1.5
    assert by[("hf-plain", "qa")]["mismatches"] is None and by[("hf-plain", "qa")]["mismatch_rate"] is None
    assert by[("target-only", "qa")]["mismatches"] is None
    greedy = [run("target-only", "qa", 20, 2.0, 1.9), {**run("hf-plain", "qa", 20, 2.0), "matches_target_only": False}]
    assert {r["method"]: r["mismatches"] for r in spec_bench.summarize(greedy, ["target-only", "hf-plain"], {})
            if r["category"] == "qa"} == {"target-only": 0, "hf-plain": 1}
    for bad in ("-0.5", "nan", "inf"):
        try:
            spec_bench.resolve_args(spec_bench.build_parser().parse_args(["--temperature", bad]))
        except SystemExit as exc:
            assert "--temperature" in str(exc)
        else:
            raise AssertionError(f"--temperature {bad} was taken")


def test_the_markdown_names_both_baselines():
    header = markdown_table([], spec_bench.COLUMNS, spec_bench.HEADERS).splitlines()[0]
    assert "| x target-only |" in header and "| x hf-plain |" in header
    assert "| decode x hf-plain |" in header


def engine_rows(fwd_1: float, fwd_5: float) -> list[dict[str, Any]]:
    """engine_speed's two rows of one model, as measure_model makes them."""
    ours = engine_speed.record("qwen-coder-1.5b", "tandem", [], {1: fwd_1, 5: fwd_5, 9: 0.3}, [])
    theirs = engine_speed.record("qwen-coder-1.5b", "transformers", [], {1: 0.2, 5: 0.25, 9: 0.3}, [])
    ours.update(tokens_per_s=13.0, x_transformers=1.3)
    theirs.update(tokens_per_s=10.0, x_transformers=None)
    return [ours, theirs]


def test_engine_speed_records_and_checks_forward_1_against_forward_5():
    slow_step = engine_rows(fwd_1=0.19, fwd_5=0.155)  # issue 28's figures: a plain step cost more than 5 tokens
    assert slow_step[0]["fwd1_le_fwd5"] is False
    assert any(line.startswith("  FAIL") and "forward(1) <= forward(5)" in line
               for line in engine_speed.thresholds(slow_step))
    assert "does not hold" in engine_speed.summary(slow_step)[0]
    fixed = engine_rows(fwd_1=0.15, fwd_5=0.155)
    assert fixed[0]["fwd1_le_fwd5"] is True
    assert all(line.startswith("  PASS") for line in engine_speed.thresholds(fixed))
    assert "1.300x transformers'" in engine_speed.summary(fixed)[0]


def test_heads_rows_report_tokens_per_round_draft_cost_and_acceptance_per_head_position():
    def heads_run(offered: dict[int, int], kept: dict[int, int], accepted: int, rounds: int) -> dict[str, Any]:
        row = run("spec-eagle", "qa", accepted + rounds, 1.0, 0.9)
        row.update(drafted=40, accepted=accepted, rejected=rounds, rounds=rounds, spec_rounds=rounds,
                   ngram_rounds=0, k_sum=40, k_rounds=rounds, k_counts={8: rounds}, tree_rounds=rounds,
                   branch_tokens=0, depth_offered=offered, depth_kept=kept, draft_seconds=0.05)
        return row

    runs = [run("target-only", "qa", 20, 2.0, 1.9),
            heads_run({1: 5, 2: 5, 3: 5}, {1: 4, 2: 2}, 6, 5), heads_run({1: 5, 2: 5}, {1: 5, 2: 5}, 10, 5)]
    rows = spec_bench.summarize(runs, ["target-only", "spec-eagle"], {"spec-eagle": 0.0})
    row = next(r for r in rows if r["method"] == "spec-eagle" and r["category"] == "qa")
    assert row["tokens_per_round"] == (16 + 10) / 10  # the accepted drafts plus the target's own token
    assert row["draft_ms_per_round"] == 1000 * 0.1 / 10
    assert row["depth_acceptance"] == "0.90 0.70 0.00"  # depth 1: 9 of 10 rounds, depth 2: 7/10, depth 3: 0/5
    target = next(r for r in rows if r["method"] == "target-only" and r["category"] == "qa")
    assert target["depth_acceptance"] is None and target["tokens_per_round"] is None


def test_verify_cost_times_every_shape_at_every_context(tiny_qwen2_dir, tmp_path):
    import json

    from benchmarks import verify_cost

    assert verify_cost.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--contexts", "8,40",
                             "--reps", "1", "--out", str(tmp_path), "--name", "vc"]) == 0
    rows = json.loads((tmp_path / "vc.json").read_text())["rows"]
    assert [r["context"] for r in rows] == [8, 40]
    for row in rows:
        assert row["decode / decode"] == 1.0
        for shape in verify_cost.SHAPES:
            assert row[f"{shape} ms"] > 0
            assert row[f"{shape} / decode"] == row[f"{shape} ms"] / row["decode ms"]
    assert (tmp_path / "vc.md").is_file() and (tmp_path / "vc.png").is_file()


def test_verify_cost_refuses_contexts_that_are_not_lengths():
    import pytest

    from benchmarks import verify_cost

    with pytest.raises(SystemExit, match="--contexts"):
        verify_cost.contexts_from("300,a")
    with pytest.raises(SystemExit, match="--contexts"):
        verify_cost.contexts_from("0")


def test_prompt_scoring_times_a_plain_and_a_scored_prefill_at_every_length(tiny_qwen2_dir, tmp_path, monkeypatch):
    import json

    import pytest

    from benchmarks import prompt_scoring
    from tandem.models import packed

    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)  # rows fixed by position, as a real model's: scores kept

    assert prompt_scoring.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--lengths", "8,300",
                                "--contexts", "20,40", "--choices", "3", "--answer-tokens", "5",
                                "--reps", "1", "--out", str(tmp_path), "--name", "ps"]) == 0
    rows = json.loads((tmp_path / "ps.json").read_text())["rows"]
    assert [r["prompt tokens"] for r in rows] == [8, 300]  # 300: two steps of scored rows
    for row in rows:
        assert row["plain ms"] > 0 and row["scored / plain"] == row["scored ms"] / row["plain ms"]
        assert row["scored tokens/s"] == pytest.approx((row["prompt tokens"] - 1) / (row["scored ms"] / 1000))
    choices = json.loads((tmp_path / "ps.json").read_text())["choice_rows"]
    assert [(r["context tokens"], r["answers"], r["answer tokens"]) for r in choices] == [(20, 3, 5), (40, 3, 5)]
    assert all(r["speedup"] == r["cache off ms"] / r["cache on ms"] for r in choices)
    assert (tmp_path / "ps.md").is_file() and (tmp_path / "ps.png").is_file()


def test_attention_ab_runs_the_baseline_backend_from_git_beside_this_one(tiny_qwen2_dir, tmp_path):
    import json

    import pytest

    from benchmarks import attention_ab

    assert attention_ab.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--contexts", "9",
                              "--reps", "1", "--out", str(tmp_path), "--name", "ab"]) == 0
    (row,) = json.loads((tmp_path / "ab.json").read_text())["rows"]
    for shape in attention_ab.SHAPES:
        assert row[f"{shape} baseline ms"] > 0 and row[f"{shape} now ms"] > 0
        assert row[f"{shape} ratio"] == row[f"{shape} now ms"] / row[f"{shape} baseline ms"]
    assert (tmp_path / "ab.md").is_file() and (tmp_path / "ab.png").is_file()
    baseline = attention_ab.baseline_backend(attention_ab.BASELINE, None)
    assert type(baseline).__module__ == "baseline_sdpa"  # not this checkout's class under another name
    with pytest.raises(SystemExit, match="--baseline no-such-rev"):
        attention_ab.baseline_backend("no-such-rev", None)



def test_batched_attention_times_both_backends_per_layout_batch_and_shape(tiny_qwen2_dir, tmp_path):
    import json

    from benchmarks import batched_attention

    assert batched_attention.contexts_of("equal", 3, 9, 8) == [9, 9, 9]
    assert batched_attention.contexts_of("spread", 4, 9, 8) == [9, 11, 13, 15]
    assert batched_attention.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--batches", "3,1",
                                   "--context", "9", "--spread", "8", "--reps", "1", "--out", str(tmp_path),
                                   "--name", "ba"]) == 0
    rows = json.loads((tmp_path / "ba.json").read_text())["rows"]
    assert [(r["layout"], r["batch"], r["shape"]) for r in rows] == [
        (layout, batch, shape) for layout in batched_attention.LAYOUTS for batch in (1, 3)
        for shape in batched_attention.SHAPES]
    for row in rows:
        assert row["baseline ms"] > 0 and row["ratio"] == row["now ms"] / row["baseline ms"]
        tokens = row["batch"] * batched_attention.SHAPES[row["shape"]]
        assert row["now tokens/s"] == tokens / (row["now ms"] / 1000)
    assert (tmp_path / "ba.md").is_file() and (tmp_path / "ba.png").is_file()


def test_prompt_attention_times_both_backends_per_shape_and_compares_their_logits(tiny_qwen2_dir, tmp_path):
    import json

    import pytest

    from benchmarks import prompt_attention

    assert prompt_attention.shapes_of([9, 40], 8, 20) == {"prompt 9": (0, 9), "prompt 40": (0, 40),
                                                          "chunk 8 after 20": (20, 8)}
    assert prompt_attention.shapes_of([9], 0, 20) == {"prompt 9": (0, 9)}
    assert prompt_attention.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--lengths", "40,9",
                                  "--chunk", "8", "--chunk-after", "20", "--reps", "1", "--out", str(tmp_path),
                                  "--name", "pa"]) == 0
    rows = json.loads((tmp_path / "pa.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == ["prompt 9", "prompt 40", "chunk 8 after 20"]
    for row, new in zip(rows, (9, 40, 8)):
        assert row["baseline ms"] > 0 and row["ratio"] == row["now ms"] / row["baseline ms"]
        assert row["now tokens/s"] == new / (row["now ms"] / 1000)
        assert row["same logits"] is True
    assert (tmp_path / "pa.md").is_file() and (tmp_path / "pa.png").is_file()
    with pytest.raises(SystemExit, match="--chunk"):
        prompt_attention.main(["--model", str(tiny_qwen2_dir), "--chunk", "-1"])


def test_concurrent_streams_checks_out_the_baseline_with_its_stubs_and_checks_its_flags():
    import subprocess

    import pytest

    from benchmarks import concurrent_streams

    tree = concurrent_streams.checkout(concurrent_streams.BASELINE)
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert head == concurrent_streams.BASELINE[:7]
        assert (tree / "tandem" / "v1" / "target_pb2.py").is_file()  # built: its workers can start
    finally:
        concurrent_streams.remove_checkout(tree)
    assert not tree.exists()
    with pytest.raises(SystemExit, match="--baseline no-such-rev"):
        concurrent_streams.checkout("no-such-rev")
    with pytest.raises(SystemExit, match="--methods"):
        concurrent_streams.build_parser().parse_args(["--methods", "none,fast"])
    with pytest.raises(SystemExit, match="--streams"):
        concurrent_streams.build_parser().parse_args(["--streams", "0"])

def test_seeded_sampling_gives_plain_output_under_exact_draws_and_reports_both_rules(tiny_qwen2_dir, tmp_path):
    import json

    from benchmarks import seeded_sampling
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine

    target, draft = (ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32")) for _ in range(2))
    prompts = [[5, 17, 33], [9, 9, 9, 9, 9, 9]]
    rows = seeded_sampling.measure(target, draft, prompts, ["draft", "ngram"], 16, 0.9, 0.95, 0, 3, adaptive_k=False)
    assert len(rows) == 2 * (1 + 2 * len(seeded_sampling.RULES))
    assert all(r["same_as_plain"] for r in rows if r["rule"] == "exact" and r["method"] != "none")
    summary = seeded_sampling.summarize(rows)
    by = {(s["method"], s["rule"]): s for s in summary}
    assert by[("draft", "exact")]["same_as_plain"] == 2 and by[("none", "-")]["x_plain"] == 1.0
    assert by[("draft", "exact")]["acceptance"] > 0.9  # a draft of the target's own model draws the target's tokens
    seeded_sampling.report(rows, summary, {"test": True}, tmp_path, "ss")
    saved = json.loads((tmp_path / "ss.json").read_text())
    assert len(saved["summary"]) == 1 + 2 * len(seeded_sampling.RULES) and "token_ids" not in saved["runs"][0]
    assert (tmp_path / "ss.md").is_file() and (tmp_path / "ss.png").is_file()


def test_penalties_bench_keeps_target_only_output_in_both_settings_and_reports_them(tiny_qwen2_dir, tmp_path):
    import json

    from benchmarks import penalties
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.sampling import SamplingParams

    target, draft = (ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32")) for _ in range(2))
    prompts = [[5, 17, 33], [9, 9, 9, 9, 9, 9]]
    penalised = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
    rows = penalties.measure(target, draft, prompts, ["draft", "ngram"], 16,
                             {"plain": SamplingParams(), "penalised": penalised}, 3, adaptive_k=False)
    assert len(rows) == 2 * len(penalties.SETTINGS) * 3
    assert all(r["same_as_target_only"] for r in rows if r["method"] != "none")
    alone = {r["setting"]: r["token_ids"] for r in rows if r["method"] == "none" and r["prompt"] == 1}
    assert alone["plain"] != alone["penalised"]  # the penalised setting really is penalised
    summary = penalties.summarize(rows)
    by = {(s["setting"], s["method"]): s for s in summary}
    assert by[("penalised", "draft")]["acceptance"] == 1.0  # the target's own model, penalised alike, is always kept
    assert by[("plain", "target-only")]["x_target_only"] == 1.0
    penalties.report(rows, summary, {"test": True}, tmp_path, "pen", penalties.TITLE)
    saved = json.loads((tmp_path / "pen.json").read_text())
    assert len(saved["summary"]) == len(penalties.SETTINGS) * 3 and "token_ids" not in saved["runs"][0]
    assert (tmp_path / "pen.md").is_file() and (tmp_path / "pen.png").is_file()


def test_seeded_sampling_refuses_unknown_methods():
    import pytest

    from benchmarks import seeded_sampling

    with pytest.raises(SystemExit, match="--methods"):
        seeded_sampling.methods_from("draft,medusa")


def test_int8_rows_times_both_ways_and_names_the_rules_choice(tiny_qwen2_dir, tmp_path):
    import json

    import pytest

    from benchmarks import int8_rows

    assert int8_rows.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--rows", "4,40",
                           "--reps", "1", "--out", str(tmp_path), "--name", "ir"]) == 0
    rows = json.loads((tmp_path / "ir.json").read_text())["rows"]
    assert [r["rows"] for r in rows] == [4, 40]
    for row in rows:
        assert row["int8 ms"] > 0 and row["dense ms"] > 0
        assert row["faster"] == min(("int8", "dense"), key=lambda way: row[f"{way} ms"])
        assert row["rule's loss ms"] >= 0
    assert [r["rule takes"] for r in rows] == ["int8", "dense"]  # float32: dense past 16 rows
    assert (tmp_path / "ir.md").is_file() and (tmp_path / "ir.png").is_file()
    with pytest.raises(SystemExit, match="--rows"):
        int8_rows.rows_from("8,x")


def test_shared_prompt_runs_each_method_on_engines_of_its_own_and_finds_the_system_prompt_cached(tiny_qwen2_dir,
                                                                                                 tmp_path):
    import json

    from benchmarks import shared_prompt
    from tandem.config import EngineConfig

    config = EngineConfig(tiny_qwen2_dir, dtype="float32", block_size=4)  # prefix caching on, as a server's
    generators = {m: shared_prompt.generator_for(m, config, config, 3) for m in shared_prompt.METHODS}
    assert len({id(g.target.engine) for g in generators.values()}) == len(shared_prompt.METHODS)  # fresh caches
    system = list(range(10, 60))
    rows = shared_prompt.measure(generators, [[*system, 5, 6], [*system, 7, 8, 9]], 12, frozenset())
    assert len(rows) == 2 * len(shared_prompt.METHODS)
    assert all(r["target_reused"] == 0 for r in rows if r["question"] == 0)  # cold for every method
    assert all(r["target_reused"] >= 48 for r in rows if r["question"] == 1)  # then the system prompt is cached
    summary = shared_prompt.summarize(rows)
    assert [(s["group"], s["method"]) for s in summary] == [(g, m) for g in shared_prompt.GROUPS
                                                            for m in shared_prompt.METHODS]
    assert all(s["mismatches"] == 0 for s in summary)  # greedy: every method gives target-only's output
    assert all(s["x_target_only"] == 1.0 for s in summary if s["method"] == shared_prompt.BASELINE)
    shared_prompt.report(rows, summary, {"test": True}, tmp_path, "sp")
    saved = json.loads((tmp_path / "sp.json").read_text())
    assert len(saved["runs"]) == len(rows) and "token_ids" not in saved["runs"][0]
    assert (tmp_path / "sp.md").is_file() and (tmp_path / "sp.png").is_file()


def test_shared_prompt_checks_its_flags():
    import pytest

    from benchmarks import shared_prompt
    from benchmarks.common import DEFAULT_SPEC_BENCH

    assert shared_prompt.methods_from("spec-hybrid") == [shared_prompt.BASELINE, "spec-hybrid"]
    with pytest.raises(SystemExit, match="--methods"):
        shared_prompt.methods_from("spec-draft")
    assert len(shared_prompt.system_prompt(DEFAULT_SPEC_BENCH, 0)) > 2000  # a retrieved passage and its question
    with pytest.raises(SystemExit, match="--system-from"):
        shared_prompt.system_prompt(DEFAULT_SPEC_BENCH, 10_000)


def test_tool_calls_bench_data_compiles_and_its_validity_check_catches_bad_calls():
    import json

    from benchmarks import tool_calls
    from tandem.tool_calls import ToolCall, ToolSpec, ToolUse, check_tool_schemas

    spec = json.loads(tool_calls.TASKS.read_text())
    tools = tuple(ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                  for t in spec["tools"])
    check_tool_schemas(ToolUse(tools, "required"))  # every schema compiles to a grammar
    assert len(spec["tasks"]) == 14 and len(tools) == 5
    schemas = {t.name: t.schema for t in tools}
    good = ToolCall("c", "get_weather", '{"city": "Oslo"}')
    assert tool_calls.valid_calls([good], schemas) and tool_calls.valid_calls([], schemas)
    for bad in (ToolCall("c", "get_wether", '{"city": "Oslo"}'), ToolCall("c", "get_weather", "{}"),
                ToolCall("c", "get_weather", '{"city": "Oslo", "country": "NO"}')):
        assert not tool_calls.valid_calls([good, bad], schemas), bad
    args = tool_calls.build_parser().parse_args(["--limit", "2", "--methods", "ngram"])
    assert args.limit == 2 and not hasattr(args, "categories")  # its own prompts: no categories to choose


def test_unforced_methods_run_without_grammar_proposals_side_by_side(tmp_path):
    from benchmarks.sampling_settings import measure
    from tandem.config import EngineConfig, ModelConfig
    from tandem.engine import ModelEngine
    from tandem.sampling import SamplingParams
    from tandem.structured_output import StructuredOutput
    from tests.spec.losslessness import save_six_token_pair

    target_dir, _ = save_six_token_pair(tmp_path)
    target = ModelEngine.load(EngineConfig(target_dir, dtype="float32", block_size=4))
    forced = SamplingParams(grammar='start: /[!#]/ "!#!#!" /[!#]*/')  # five tokens forced after the first
    rows = measure(target, None, [[0, 3, 2, 5]], ["ngram", "ngram-unforced"], 12, {"forced": forced}, 2,
                   frozenset({1}), adaptive_k=False, structured=StructuredOutput(target_dir,
                                                                                 ModelConfig.from_dir(target_dir)))
    by = {r["method"]: r for r in rows}
    assert by["ngram"]["forced"] == 5 and by["ngram-unforced"]["forced"] == 0
    assert by["ngram"]["same_as_target_only"] and by["ngram-unforced"]["same_as_target_only"]


def test_structured_output_bench_settings_and_schema():
    import json

    import pytest

    from benchmarks import structured_output
    from benchmarks.common import names_from
    from tandem.sampling import SamplingParams
    from tandem.structured_output import check_response_format

    args = structured_output.build_parser().parse_args([])
    assert (args.settings, args.methods) == ("free,json", "draft,hybrid,ngram")  # make bench runs as before
    args = structured_output.build_parser().parse_args(["--settings", "schema", "--methods", "ngram,ngram-unforced"])
    assert names_from(args.methods, structured_output.GRAMMAR_METHODS) == ["ngram", "ngram-unforced"]
    with pytest.raises(SystemExit, match="--settings"):
        names_from("yaml", structured_output.SETTINGS, "--settings")
    check_response_format(SamplingParams(json_schema=json.dumps(structured_output.SCHEMA)))  # it compiles


def test_row_buckets_walks_each_rule_and_prices_a_prefill_under_both(tiny_qwen2_dir, monkeypatch, tmp_path):
    import argparse

    import pytest

    from benchmarks import row_buckets
    from tandem.models import packed

    bucketed = packed.padded_rows
    with row_buckets.row_rule("exact") as rule:
        assert packed.padded_rows is rule is row_buckets.exact_rows and rule((0, 2), 37) == 37
    assert packed.padded_rows is bucketed and bucketed((0, 2), 37) == 38

    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)  # pack the tiny model's layers, as a real model's are
    args = argparse.Namespace(model=str(tiny_qwen2_dir), dtype="float32", cache_dir=None)
    engine = row_buckets.load_engine(args, prompt_tokens=40)
    layers = row_buckets.decoder_layer_shapes(engine.model)
    assert layers and all(layer.packed_weight is not None for layer in layers)
    assert len({(layer.out_features, layer.in_features) for layer in layers}) == len(layers)
    walks = {rule: row_buckets.walk(layers, 200, rule, engine.backend.dtype) for rule in row_buckets.RULES}
    assert walks["exact"]["kernels per shape"] >= 200 - 8  # above the measured padding, one kernel per count
    assert walks["bucketed"]["kernels per shape"] <= 31 + 16 + 16 + 9  # 2..32, then 16 per octave up to 200
    assert all(w["first pass s"] > 0 and w["second pass s"] > 0 and w["RSS after MB"] > 0 for w in walks.values())

    prefills = row_buckets.prefill_costs(engine, [9, 37], reps=1)
    assert [(r["prompt tokens"], r["rows computed"]) for r in prefills] == [(9, 9), (37, 38)]
    assert all(r["same logits"] is True and r["ratio"] == r["bucketed ms"] / r["exact ms"] for r in prefills)
    assert not engine.kv_cache.has_sequence((row_buckets.NAME, 37))

    with pytest.raises(SystemExit, match="--max-rows"):
        row_buckets.main(["--model", str(tiny_qwen2_dir), "--max-rows", "1"])
    with pytest.raises(SystemExit, match="exact walk failed"):  # the child loads the tiny model unpacked
        row_buckets.main(["--model", str(tiny_qwen2_dir), "--max-rows", "40", "--out", str(tmp_path)])


def test_row_split_prices_both_rules_per_shape_and_prefill_and_checks_the_decoded_logits(tiny_qwen2_dir, monkeypatch,
                                                                                       tmp_path):
    import json

    import pytest

    from benchmarks import row_split
    from tandem.models import packed

    with pytest.raises(SystemExit, match="--limit"):
        row_split.main(["--model", str(tiny_qwen2_dir), "--limit", "1"])
    with pytest.raises(SystemExit, match="nothing to split"):  # test-sized layers stay dense
        row_split.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--out", str(tmp_path)])
    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)  # pack the tiny model's layers, as a real model's are
    with pytest.raises(SystemExit, match="give --limit N"):  # fp32: no probe, no limit
        row_split.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--out", str(tmp_path)])
    assert row_split.main(["--model", str(tiny_qwen2_dir), "--dtype", "float32", "--limit", "8", "--counts", "2,20",
                           "--lengths", "9,21", "--reps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "row_split.json").read_text())
    assert result["settings"]["limits"] == [8]
    assert {(r["rows"], r["split rows differing"]) for r in result["calls"]} == {(2, 0), (20, 0)}  # fp32: invariant
    assert all(r["ratio"] == r["split ms"] / r["one call ms"] for r in result["calls"])
    assert [(r["prompt tokens"], r["split = decoded"]) for r in result["prefills"]] == [(9, True), (21, True)]
    assert (tmp_path / "row_split.md").exists() and (tmp_path / "row_split.png").exists()


def test_predicted_outputs_keeps_target_only_output_and_counts_what_the_prediction_gave(tiny_qwen2_dir, tmp_path):
    import json

    from benchmarks import predicted_outputs
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator

    target, draft = (ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32")) for _ in range(2))
    prompts = [[5, 17, 33], [9, 9, 9, 9, 9, 9]]
    # Each request's prediction: its own target-only answer (an edit that changed nothing)
    answers = SpeculativeGenerator(target).generate([GenerationRequest(p, 24) for p in prompts])
    requests = [(p, a.token_ids) for p, a in zip(prompts, answers)]
    rows = predicted_outputs.measure(target, draft, requests, predicted_outputs.METHODS, 24, 3)
    assert len(rows) == 2 * (1 + len(predicted_outputs.METHODS))
    assert all(r["same_as_target_only"] for r in rows)
    summary = predicted_outputs.summarize(rows)
    by = {s["method"]: s for s in summary}
    assert by["target-only"]["x_target_only"] == 1.0 and by["target-only"]["tokens_per_round"] == 1.0
    assert by["ngram+prediction"]["prediction_kept"] > 24 and by["ngram"]["prediction_kept"] == 0
    assert by["ngram+prediction"]["tokens_per_round"] > 2 * by["ngram"]["tokens_per_round"]
    predicted_outputs.report(rows, summary, {"test": True}, tmp_path, "po")
    saved = json.loads((tmp_path / "po.json").read_text())
    assert len(saved["summary"]) == 1 + len(predicted_outputs.METHODS) and "token_ids" not in saved["runs"][0]
    assert (tmp_path / "po.md").is_file() and (tmp_path / "po.png").is_file()


def test_predicted_outputs_tasks_are_files_with_an_instruction():
    from benchmarks import predicted_outputs

    tasks = predicted_outputs.load_tasks(predicted_outputs.TASKS)
    assert len(tasks) == 6 and len({t["id"] for t in tasks}) == 6
    for task in tasks:
        assert task["instruction"] and task["file"].endswith("\n") and task["language"]
        prompt = predicted_outputs.INSTRUCTION.format(**task)
        assert task["file"] in prompt and task["instruction"] in prompt


def test_room_queue_bench_counts_requests_that_started_out_of_order_and_checks_its_flags(tmp_path):
    import pytest

    from benchmarks import room_queue_bench

    # (sent, first token, done): the third was sent last and saw its first token first, the first second
    runs = [(0.0, 5.0, 9.0), (1.0, 6.0, 8.0), (2.0, 4.5, 7.0)]
    row = room_queue_bench.summary("x", 0, runs, preemptions=4.0, tokens=10)
    assert row["inversions"] == 2 and row["pairs"] == 3  # (first, third) and (second, third)
    assert row["late_inversions"] == 1  # (second, third): 1.5 s apart; the first's is 0.5 s
    assert row["ttft_max_s"] == 5.0 and row["latency_max_s"] == 9.0 and row["tokens_per_s"] == 30 / 9.0
    with pytest.raises(SystemExit, match="--requests"):
        room_queue_bench.main(["--requests", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--coordinators >= 1"):
        room_queue_bench.main(["--coordinators", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="proto_build"):
        room_queue_bench.main(["--baseline", str(tmp_path), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--baseline-label and --label must differ"):
        room_queue_bench.main(["--baseline-room-hold", "0", "--label", "x", "--baseline-label", "x"])


def test_room_queue_bench_passes_each_sides_room_hold_to_every_coordinator_it_starts(tmp_path, monkeypatch):
    """``--baseline-room-hold`` without ``--baseline``: this checkout twice, the hold set per side on ``tandem up``
    and on each extra coordinator (and not at all where unset, for code older than the flag)."""
    from benchmarks import room_queue_bench

    started = []

    class Proc:
        pid = 0

        def __init__(self):
            self.stdout = iter(["ready\n"])  # (what tandem up prints once it serves)

        def poll(self):
            return 0

    def popen(cmd, **kwargs):
        started.append(cmd)
        return Proc()

    import subprocess
    import types

    # (the module's own name only: lscpu and matplotlib still start their processes)
    monkeypatch.setattr(room_queue_bench, "subprocess", types.SimpleNamespace(
        Popen=popen, PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setattr(room_queue_bench.Up, "_serving", staticmethod(lambda port: True))
    monkeypatch.setattr(room_queue_bench, "load", lambda urls, args: _two_requests())
    monkeypatch.setattr(room_queue_bench.Up, "preemptions", lambda self: 0.0)
    monkeypatch.setattr(room_queue_bench, "save_figure", lambda *a: None)
    room_queue_bench.main(["--coordinators", "2", "--room-hold", "1.5", "--baseline-room-hold", "0",
                           "--out", str(tmp_path)])
    holds = [cmd[cmd.index("--room-hold") + 1] if "--room-hold" in cmd else None for cmd in started]
    assert holds == ["0.0", "0.0", "1.5", "1.5"]  # the baseline first: tandem up, then its extra coordinator
    started.clear()
    room_queue_bench.main(["--out", str(tmp_path)])
    assert ["--room-hold" in cmd for cmd in started] == [False]


async def _two_requests() -> list:
    return [(0.0, 1.0, 2.0), (0.5, 1.5, 2.5)]  # (sent, first token, done) of two requests


def test_load_curve_compares_each_method_with_the_first_per_level_and_checks_its_flags(tmp_path):
    import argparse

    import pytest

    from benchmarks import load_curve

    def run(tokens_s: float, outputs: list[list[int]]) -> dict[str, Any]:
        return {"seconds": 1.0, "tokens/s": tokens_s, "own tokens/s p50": tokens_s / 2, "ttft p50 s": 0.1,
                "tokens per round": 2.0, "outputs": outputs, "all-busy tokens/s": tokens_s + 1,
                "target calls per step": 1.5, "draft calls per step": None}

    args = argparse.Namespace(concurrency=[1, 4], methods=["none", "auto"])
    rounds = [{(1, "none"): run(10.0, [[1, 2]]), (1, "auto"): run(20.0, [[1, 2]]),
               (4, "none"): run(40.0, [[1], [2], [3], [4]]), (4, "auto"): run(30.0, [[1], [2], [3], [9]])},
              {(1, "none"): run(12.0, [[1, 2]]), (1, "auto"): run(30.0, [[1, 2]]),
               (4, "none"): run(40.0, [[1], [2], [3], [4]]), (4, "auto"): run(34.0, [[1], [2], [3], [4]])}]
    rows = {(r["clients"], r["method"]): r for r in load_curve.summarise(args, rounds)}
    assert rows[(1, "auto")]["tokens/s"] == 25.0 and rows[(1, "auto")]["x none"] == 25.0 / 11.0
    assert rows[(4, "auto")]["x none"] == 32.0 / 40.0  # slower than target-only under load: shown, not hidden
    assert rows[(4, "auto")]["same as none"] == "7/8" and rows[(4, "none")]["same as none"] == "8/8"
    assert rows[(1, "none")]["runs tokens/s"] == [10.0, 12.0]
    assert rows[(4, "auto")]["all-busy tokens/s"] == 33.0 and rows[(4, "auto")]["all-busy x none"] == 33.0 / 41.0

    # The all-busy window ends when the first client has its last answer: client 0's two requests end at 3 s, client
    # 1's one at 10 s; tokens that arrived by 3 s count (2 + 3 + 4 of client 1's, not its 5 at 9 s), over 3 s.
    def request(ended: float, arrivals: list[tuple[float, int]]) -> dict[str, Any]:
        return {"ended": ended, "arrivals": arrivals}

    per_client = [[request(1.5, [(1.0, 2)]), request(3.0, [(2.5, 3)])],
                  [request(10.0, [(0.5, 4), (9.0, 5)])]]
    assert load_curve.all_busy_rate(0.0, per_client) == 9 / 3.0
    assert load_curve.all_busy_rate(0.0, [[], []]) is None
    assert rows[(4, "auto")]["target calls per step"] == 1.5 and rows[(4, "auto")]["draft calls per step"] is None

    # Calls per step between two scrapes of the workers' batch-size histograms: 6 target calls in 4 steps since
    # the first scrape; no draft step ran (ngram), so none is said.
    before = {"tandem_target_batch_size_sum": 10.0, "tandem_target_batch_size_count": 8.0,
              "tandem_draft_batch_size_sum": 3.0, "tandem_draft_batch_size_count": 3.0}
    after = {**before, "tandem_target_batch_size_sum": 16.0, "tandem_target_batch_size_count": 12.0}
    assert load_curve.calls_per_step(before, after) == {"target calls per step": 1.5, "draft calls per step": None}

    base = ["--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="--requests-per-client"):
        load_curve.main(["--requests-per-client", "0", *base])
    with pytest.raises(SystemExit, match="--categories"):
        load_curve.main(["--categories", "humaneval,poetry", *base])
    with pytest.raises(SystemExit, match="--draft none"):
        load_curve.main(["--draft", "none", "--methods", "none,auto", *base])
    with pytest.raises(SystemExit, match="--concurrency"):
        load_curve.main(["--concurrency", "0,2", *base])

    prompt_args = load_curve.build_parser().parse_args(["--concurrency", "1,3", "--categories", "humaneval,qa"])
    load_curve.check_args(prompt_args)
    prompts = load_curve.prompts_for(prompt_args)  # 3 clients x 2 requests, the categories in turn
    assert len(prompts) == 6 and prompts[0].startswith(("def ", "from ", "import ")) and "def " not in prompts[1][:4]
