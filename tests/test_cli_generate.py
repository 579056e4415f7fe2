"""`tandem generate`: the JSON contract, and bad input refused before any work."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tandem.cli import main


def generate_json(capsys, *args: str) -> dict:
    """`tandem generate ... --json` in this process (no interpreter start, no torch import per call)."""
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["none", "early-exit", "ngram", "hybrid"])
def test_generate_json_is_the_target_only_output_with_its_stats(tiny_served_dir, method, capsys):
    """The JSON contract, asserted as behaviour: the greedy tokens are the target's own (for every method),
    the text is their decoding, and the counts add up."""
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    prompt = "Name three colors."
    expected = target_only(tiny_served_dir, [prompt], dtype="float32", max_new_tokens=24)[prompt]
    # --fixed-k: the draft drafts every round (adaptive k rightly declines a draft as dear as the target);
    # dense and in float32, the draft is the target itself (a lean one, int8 in bf16 where the CPU has native
    # bf16, may disagree with it: on the tiny model it did once in 18 tokens when its 17-64-row passes took the
    # int8 kernel)
    draft = (["--draft", str(tiny_served_dir), "--fixed-k", "--draft-quantization", "none", "--draft-dtype", "float32"]
             if method == "hybrid" else [])
    out = generate_json(capsys, prompt, "--chat", "--target", str(tiny_served_dir), "--method", method, *draft,
                        "--max-new-tokens", "24", "--dtype", "float32", "--early-exit-layers", "2")
    assert out["token_ids"] == expected
    assert out["text"] == load_tokenizer(tiny_served_dir).decode(expected, skip_special_tokens=True)
    assert out["finish_reason"] == ("length" if len(expected) == 24 else "stop")
    stats = out["stats"]
    assert stats["method"] == method
    assert stats["generated"] == len(expected)
    assert 0 <= stats["accepted"] <= stats["drafted"]
    if method == "none":  # the prefill gives the first token, then one token per round, nothing drafted
        assert stats["drafted"] == 0 and stats["rounds"] == len(expected) - 1
    if method == "hybrid":  # the target drafting for itself: every draft token is kept
        assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]
        assert stats["rounds"] < len(expected)


def test_penalty_flags_change_the_output_and_speculation_keeps_it(tiny_served_dir, capsys):
    """--repetition-penalty and --frequency-penalty reach the target's rows: the text changes, and a
    speculative method gives the penalised target-only text."""
    common = ["--target", str(tiny_served_dir), "--max-new-tokens", "24", "--dtype", "float32", "--chat"]
    penalties = ["--repetition-penalty", "1.3", "--frequency-penalty", "0.8", "--presence-penalty", "0.2"]
    plain = generate_json(capsys, "Count to ten.", *common, "--method", "none")["token_ids"]
    alone = generate_json(capsys, "Count to ten.", *common, *penalties, "--method", "none")["token_ids"]
    early = generate_json(capsys, "Count to ten.", *common, *penalties, "--method", "early-exit",
                          "--early-exit-layers", "2", "--fixed-k")
    assert alone != plain
    assert early["token_ids"] == alone and early["stats"]["drafted"] > 0


def test_a_json_schema_file_constrains_the_answer(tmp_path, capsys):
    """--json-schema @FILE in process: a tiny random model (one character per token) answers a JSON string of
    two to eight "!" and "#", then the stop token."""
    from tests.spec.losslessness import save_six_token_pair

    target, _ = save_six_token_pair(tmp_path / "pair")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "string", "pattern": "^[!#]{2,8}$"}')
    out = generate_json(capsys, "!#", "--target", str(target), "--json-schema", f"@{schema}",
                        "--max-new-tokens", "24", "--dtype", "float32", "--method", "ngram")
    assert out["finish_reason"] == "stop" and re.fullmatch(r'"[!#]{2,8}"', out["text"]), out


def test_a_tokenizer_structured_output_cannot_read_is_named(tiny_served_dir, capsys):
    assert main(["generate", "hi", "--target", str(tiny_served_dir), "--json-object", "--dtype", "float32",
                 "--max-new-tokens", "4"]) != 0
    assert "response_format: structured output cannot read this model's tokenizer" in capsys.readouterr().err


def test_a_system_turn_goes_before_the_prompt_through_the_chat_template(tiny_served_dir, capsys):
    from tandem.tokenizer import encode_messages, encode_prompt, load_tokenizer
    from tests.references import target_only

    turns = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]
    ids = encode_messages(load_tokenizer(tiny_served_dir), turns)
    expected = target_only(tiny_served_dir, [ids], dtype="float32", max_new_tokens=16)[tuple(ids)]
    out = generate_json(capsys, "Name a color.", "--system", "Answer in one word.", "--target", str(tiny_served_dir),
                        "--method", "none", "--max-new-tokens", "16", "--dtype", "float32")
    assert out["token_ids"] == expected
    assert encode_prompt(load_tokenizer(tiny_served_dir), "Name a color.", chat=True) != ids  # (the turn counts)


def test_chat_template_kwargs_reach_the_template(tiny_served_dir, capsys):
    """--chat-template-kwargs: the template's extra variables (this one writes ``greeting``); a name the template
    is given by the request itself, or text that is not a JSON object, is refused before any model loads."""
    from tandem.tokenizer import encode_messages, load_tokenizer
    from tests.references import target_only

    turns = [{"role": "user", "content": "Name a color."}]
    tokenizer = load_tokenizer(tiny_served_dir)
    ids = encode_messages(tokenizer, turns, kwargs={"greeting": "Hello!"})
    assert ids != encode_messages(tokenizer, turns)
    expected = target_only(tiny_served_dir, [ids], dtype="float32", max_new_tokens=8)[tuple(ids)]
    out = generate_json(capsys, "Name a color.", "--chat-template-kwargs", '{"greeting": "Hello!"}', "--target",
                        str(tiny_served_dir), "--method", "none", "--max-new-tokens", "8", "--dtype", "float32")
    assert out["token_ids"] == expected
    for bad, message in (("[1]", "must be a JSON object"), ('{"tools": []}', "tools: set by the request itself"),
                         ("{oops", "not JSON")):
        assert main(["generate", "hi", "--chat-template-kwargs", bad, "--target", "/nonexistent"]) == 2
        assert f"--chat-template-kwargs: {message}" in capsys.readouterr().err


def test_a_prefill_is_continued_as_the_assistants_open_turn(tiny_served_dir, capsys):
    """--prefill: the prompt ends inside an assistant turn that starts with it, and the model continues it; the
    plain output prints it first, --json's text holds only the continuation."""
    from tandem.tokenizer import encode_messages, load_tokenizer
    from tests.references import target_only

    tokenizer = load_tokenizer(tiny_served_dir)
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color"}]
    ids = encode_messages(tokenizer, turns, continue_final=True)
    assert ids != encode_messages(tokenizer, turns)  # an open turn, not a closed one and a new one
    expected = target_only(tiny_served_dir, [ids], dtype="float32", max_new_tokens=12)[tuple(ids)]
    flags = ["--prefill", "The color", "--target", str(tiny_served_dir), "--method", "ngram", "--max-new-tokens", "12",
             "--dtype", "float32"]
    out = generate_json(capsys, "Name a color.", *flags, "--draft", "none")  # (`tandem up`'s "no draft model")
    assert out["token_ids"] == expected and out["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert main(["generate", "Name a color.", *flags]) == 0
    assert capsys.readouterr().out == "The color" + out["text"] + "\n"
    with pytest.raises(ValueError, match="must be an assistant's; got user"):
        encode_messages(tokenizer, turns[:1], continue_final=True)


def test_the_client_sends_a_conversation_as_chat_messages():
    from tandem.client import build_request

    request = build_request([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                            max_new_tokens=4)
    assert request.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "hi")]
    assert build_request([5, 6]).token_ids.ids == [5, 6] and build_request("hi").text == "hi"


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["-k", "-2"], "k (draft tokens per round) must be in 0..15"),
    (["-k", "40"], "k (draft tokens per round) must be in 0..15"),
    (["--heads-nodes", "99"], "heads nodes must be in 0..15"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--min-p", "1.5"], "min_p must be in [0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--method", "draft"], "needs a draft model"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--frequency-penalty", "2.5"], "frequency_penalty must be in [-2, 2]"),
    (["--presence-penalty", "-3"], "presence_penalty must be in [-2, 2]"),
    (["--json-schema", "{oops"], "response_format: json_schema is not JSON"),
    (["--json-schema", '{"type": "colour"}'], "response_format: the JSON schema cannot be enforced"),
    (["--json-schema", "@/nonexistent/schema.json"], "--json-schema: cannot read /nonexistent/schema.json"),
    (["--tools", "tools.json"], "--tools: only with --addr"),
    (["--tool-choice", "required"], "--tool-choice and --single-call need --tools"),
    (["--single-call"], "--tool-choice and --single-call need --tools"),
    (["--stop", " 6"], "--stop: only with --addr"),  # in process they were ignored, silently
    (["--timeout", "5"], "--timeout: only with --addr"),
    (["--no-pipelining"], "--no-pipelining: only with --addr"),
    (["--priority", "-1"], "--priority: only with --addr"),
    (["--seed", str(2**64)], "seed must be a 64-bit integer"),
    # with --addr, refused before connecting (nothing listens on port 1): 0 used to mean "unset" on the wire, and
    # a request of 0 tokens got 256
    (["--addr", "127.0.0.1:1", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--addr", "127.0.0.1:1", "--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--addr", "127.0.0.1:1", "--seed", str(-(2**63) - 1)], "seed must be a 64-bit integer"),
    # in-process flags with --addr were ignored, silently: the coordinator's workers decide them
    (["--addr", "127.0.0.1:1", "--target", "/nonexistent"], "--target: in process only"),
    (["--addr", "127.0.0.1:1", "--target", "x", "--dtype", "float32", "--ngram-max", "6"],
     "--target, --ngram-max, --dtype: in process only"),
    (["--addr", "127.0.0.1:1", "--method", "early-exit"], "--method early-exit: in process only"),
    (["--addr", "127.0.0.1:1", "--no-cuda-graphs"], "--no-cuda-graphs: in process only"),
    (["--cuda-graphs"], "--cuda-graphs needs --device cuda, and the models would run on cpu"),
    (["--prediction", "/nonexistent/old.py"], "--prediction /nonexistent/old.py: cannot read it"),
    (["--addr", "127.0.0.1:1", "--prediction", "/nonexistent/old.py"], "--prediction /nonexistent/old.py: cannot read"),
    (["--suffix", "x", "--chat"], "--suffix: not with --chat"),
    (["--addr", "127.0.0.1:1", "--suffix", "x", "--system", "s", "--prefill", "p"], "not with --system, --prefill"),
])
def test_bad_flags_fail_fast_with_a_named_error(flags, message, capsys, monkeypatch):
    from tandem import model_store

    def no_model_work(*args, **kwargs):
        raise AssertionError("a model was resolved before the flags were validated")

    monkeypatch.setattr(model_store, "resolve_model", no_model_work)
    where = [] if "--addr" in flags else ["--target", "/nonexistent"]  # (--target is in process only)
    assert main(["generate", "hi", *where, *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (None, "--tools: cannot read"),
    ("{oops", "is not JSON"),
    ("{}", "must hold a list of tools, got dict"),
    ("[]", "must hold a list of tools, got list (empty)"),
    ('[{"type": "retrieval"}]', "--tools[0].type: function tools only, got 'retrieval'"),
    ('[{"description": "no name"}]', "--tools[0]: a function with a name"),
    ('[{"name": "f", "parameters": [1]}]', "--tools[0].parameters: a JSON schema (an object), got [1]"),
])
def test_a_bad_tools_file_is_refused_naming_what_is_wrong_before_any_call(tmp_path, content, message, capsys):
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    assert main(["generate", "hi", "--addr", "127.0.0.1:1", "--tools", str(path)]) == 2  # nothing listens there
    assert message in capsys.readouterr().err


def test_a_prediction_file_speeds_the_answer_and_changes_none_of_it(tiny_served_dir, tmp_path, capsys):
    """--prediction FILE (OpenAI's Predicted Outputs): with the target-only answer as prediction, the answer is
    the same and most of it came from the prediction; an empty file is refused by name."""
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    prompt = "Name three colors."
    expected = target_only(tiny_served_dir, [prompt], dtype="float32", max_new_tokens=24)[prompt]
    path = tmp_path / "answer.txt"
    path.write_text(load_tokenizer(tiny_served_dir).decode(expected, skip_special_tokens=True))
    out = generate_json(capsys, prompt, "--chat", "--target", str(tiny_served_dir), "--method", "ngram",
                        "--max-new-tokens", "24", "--dtype", "float32", "--prediction", str(path))
    assert out["token_ids"] == expected
    assert out["stats"]["prediction_accepted"] >= len(expected) // 2, out["stats"]
    path.write_text("")
    assert main(["generate", prompt, "--target", str(tiny_served_dir), "--prediction", str(path)]) == 2
    assert "--prediction " + str(path) + ": the file is empty" in capsys.readouterr().err


def test_in_process_an_answer_past_the_context_is_refused_as_the_coordinator_words_it(tiny_served_dir, capsys):
    assert main(["generate", "hello", "--target", str(tiny_served_dir), "--method", "none",
                 "--max-new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "this model's maximum context length is 2048 tokens" in err and "+ 100000 > 2048" in err


def test_unknown_method_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--method", "lookahead"])
    assert info.value.code == 2
    assert "invalid choice: 'lookahead'" in capsys.readouterr().err


def test_a_heads_method_without_heads_is_refused_before_models_load(capsys, tmp_path):
    assert main(["generate", "hi", "--method", "medusa", "--cache-dir", str(tmp_path)]) == 2
    assert "needs the target's medusa heads; the target serves no heads (start it with --heads)" in \
        capsys.readouterr().err


def test_unknown_heads_name_is_refused_with_what_is_prepared(capsys, tmp_path):
    assert main(["generate", "hi", "--heads", "nonesuch", "--cache-dir", str(tmp_path)]) == 2
    assert "--heads 'nonesuch': no such path, and no prepared heads of that name" in capsys.readouterr().err


@pytest.mark.slow
def test_draft_with_another_tokenizer_is_refused_before_weights_load(smollm2_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    draft = tmp_path / "draft"
    draft.mkdir()
    PreTrainedTokenizerFast(tokenizer_object=other, unk_token="[UNK]").save_pretrained(draft)
    shutil.copy(smollm2_dir / "config.json", draft / "config.json")
    (draft / "model.safetensors").write_bytes(b"never read: the tokenizer check comes first")
    code = main(["generate", "hi", "--target", str(smollm2_dir), "--draft", str(draft), "--method", "draft"])
    assert code == 2
    assert "tokenizer" in capsys.readouterr().err


def test_a_bare_host_in_addr_gets_the_coordinators_port_not_grpcs_443():
    from tandem.cli.generate import coordinator_address

    assert coordinator_address("localhost") == "localhost:50051"
    assert coordinator_address("10.0.0.7:9000") == "10.0.0.7:9000"
    assert coordinator_address("[::1]") == "[::1]:50051"
    assert coordinator_address("[::1]:9000") == "[::1]:9000"
    assert coordinator_address("unix:/tmp/tandem.sock") == "unix:/tmp/tandem.sock"
    assert coordinator_address("dns:///coordinator.svc:50051") == "dns:///coordinator.svc:50051"


def test_a_negative_seed_is_one_64_bit_seed_on_every_path():
    """`--seed -5 --addr` crashed encoding the request (the wire's seed is a uint64); HTTP wrapped it. A seed now
    wraps in SamplingParams itself, so in process, over gRPC and over HTTP -5 is the same seed."""
    from tandem.client import build_request
    from tandem.sampling_params import SamplingParams

    negative = SamplingParams(temperature=0.5, seed=-5)
    assert negative.seed == 2**64 - 5 == SamplingParams(temperature=0.5, seed=2**64 - 5).seed
    assert build_request("hi", sampling=negative).sampling.seed == 2**64 - 5


def test_an_empty_prompt_is_refused_before_any_model_loads(capsys, monkeypatch):
    """In process it was refused only after the models had loaded (seconds to minutes)."""
    from tandem import model_store

    monkeypatch.setattr(model_store, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    assert main(["generate", "", "--target", "/nonexistent"]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_fim_dir(tmp_path_factory):
    """The tiny served model, its tokenizer with Qwen2.5-Coder's fill-in-the-middle markers."""
    from tests.tiny_models import save_tiny_served_model

    return save_tiny_served_model(tmp_path_factory.mktemp("tiny-fim"), fim=True)


@pytest.mark.parametrize("method", ["none", "ngram", "hybrid"])
def test_suffix_fills_the_middle_in_the_models_format_and_its_end_token_ends_it(tiny_fim_dir, method, capsys):
    """--suffix: the answer is target-only's on the prompt spelled with the markers (independently of
    tandem.infill), up to and with the format's end token, which is no stop of the model's own; for every method.
    The tiny random model writes <|endoftext|> 31st after "f(" and ")"."""
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only
    from tests.tiny_models import TINY_FIM_SPECIALS

    end = next(i for i, name in TINY_FIM_SPECIALS.items() if name == "<|endoftext|>")
    ids = load_tokenizer(tiny_fim_dir).encode("<|fim_prefix|>f(<|fim_suffix|>)<|fim_middle|>", add_special_tokens=True)
    unstopped = target_only(tiny_fim_dir, [ids], dtype="float32", max_new_tokens=40)[tuple(ids)]
    assert end in unstopped[:-1]  # (what makes the stop below a stop)
    draft = (["--draft", str(tiny_fim_dir), "--fixed-k", "--draft-quantization", "none", "--draft-dtype", "float32"]
             if method == "hybrid" else [])
    out = generate_json(capsys, "f(", "--suffix", ")", "--target", str(tiny_fim_dir), "--method", method, *draft,
                        "--max-new-tokens", "40", "--dtype", "float32")
    assert out["token_ids"] == unstopped[:unstopped.index(end) + 1]
    assert out["finish_reason"] == "stop"


def test_suffix_on_a_model_without_markers_is_refused_before_its_weights_load(tiny_served_dir, capsys, monkeypatch):
    from tandem import pipeline

    monkeypatch.setattr(pipeline.LocalPipeline, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
    assert main(["generate", "f(", "--suffix", ")", "--target", str(tiny_served_dir)]) == 2
    assert "--suffix: this model's tokenizer has no fill-in-the-middle tokens" in capsys.readouterr().err
    assert main(["generate", "", "--suffix", "", "--target", str(tiny_served_dir)]) == 2
    assert "--suffix and the prompt are both empty" in capsys.readouterr().err


def test_suffix_with_addr_sends_the_prompt_and_suffix_as_an_infill(monkeypatch, capsys):
    from tandem.client import TandemClient

    sent = []
    monkeypatch.setattr(TandemClient, "stream", lambda self, request: sent.append(request) or iter(()))
    assert main(["generate", "", "--suffix", ")", "--addr", "127.0.0.1:1"]) == 0  # (an empty prefix: top of a file)
    assert sent[0].WhichOneof("input") == "infill" and (sent[0].infill.prefix, sent[0].infill.suffix) == ("", ")")


def test_the_flags_a_request_carries_pass_with_addr_and_reach_the_request(capsys):
    """--method, -k, --fixed-k, --heads-nodes and --tree travel in SpeculationOptions: not refused with --addr (the
    call then fails to connect: nothing listens on port 1)."""
    code = main(["generate", "hi", "--addr", "127.0.0.1:1", "--method", "ngram", "-k", "3", "--fixed-k",
                 "--heads-nodes", "4", "--tree", "off", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "in process only" not in err and "UNAVAILABLE" in err
    assert "(is a coordinator running at 127.0.0.1:1? `tandem up` starts one)" in err


def test_in_process_the_text_streams_as_it_is_generated_and_ends_as_the_whole_decoding(tiny_served_dir, capsys,
                                                                                          monkeypatch):
    """In process the answer was printed only once all of it was generated (with --addr it streams)."""
    from tandem.inprocess import SpeculativeGenerator
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    prompt = "Name three colors."
    expected = target_only(tiny_served_dir, [prompt], dtype="float32", max_new_tokens=24)[prompt]
    printed_during: list[str] = []  # stdout as each step's callback returns, while generate() still runs
    generate = SpeculativeGenerator.generate

    def watched(self, requests):
        [request] = requests
        inner = request.on_tokens
        assert inner is not None, "no callback: the text would be printed only at the end"

        def record(tokens):
            inner(tokens)
            printed_during.append(capsys.readouterr().out)
        request.on_tokens = record
        return generate(self, requests)

    monkeypatch.setattr(SpeculativeGenerator, "generate", watched)
    assert main(["generate", prompt, "--chat", "--target", str(tiny_served_dir), "--method", "none",
                 "--max-new-tokens", "24", "--dtype", "float32"]) == 0
    rest = capsys.readouterr().out
    text = load_tokenizer(tiny_served_dir).decode(expected, skip_special_tokens=True)
    assert len(printed_during) == len(expected)  # plain decoding commits one token a step
    assert sum(1 for piece in printed_during if piece) > 1  # several pieces, before the end
    assert "".join(printed_during) + rest == text + "\n"


def test_ctrl_c_mid_answer_ends_the_line_and_exits_130(monkeypatch, capsys):
    import tandem.cli.generate as generate

    def interrupted(args):
        print("half an answ", end="", flush=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run_in_process", interrupted)
    assert main(["generate", "hi", "--target", "/nonexistent"]) == 130
    out = capsys.readouterr()
    assert out.out == "half an answ" and out.err == "\n[interrupted]\n"
