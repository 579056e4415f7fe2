"""`tandem generate`: generate text from a prompt, in process or through a running coordinator.

Without --addr the models run in this process; with --addr HOST:PORT the
request goes to a coordinator (`tandem up`, `tandem serve coordinator`) and
the text streams back as it is generated. Flags are validated (sampling, method, k) before any model is loaded; the
models are resolved (catalog name, directory or GGUF) and loaded; then one
request runs through the speculation loop. ``--json`` prints one JSON object
on the last line: ``text``, ``token_ids`` (generated only), ``finish_reason``
and ``stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tandem import model_store
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options
from tandem.cli.security_flags import add_client_flags, client_options
from tandem.cli.tool_flags import add_tool_flags, tool_options_from_args
from tandem.config import ATTENTION_BACKENDS, DTYPES, PACKED_WEIGHTS, PACKED_WEIGHTS_HELP, EngineConfig
from tandem.errors import InvalidRequestError, ModelFileError
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import MAX_K
from tandem.spec.options import MAX_TREE_WIDTH, METHODS, TREE_MODES, SpecOptions, heads_fallback, resolve_method
from tandem.structured_output import check_response_format
from tandem.tokenizer import template_kwargs

if TYPE_CHECKING:
    from tandem.v1 import generation_pb2

DEFAULT_TARGET = "qwen-coder-1.5b"
DEFAULT_COORDINATOR_PORT = 50051  # `tandem up` and `tandem serve coordinator` listen there unless told otherwise
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_K = 4  # draft tokens per round from a draft model, as a coordinator's --k


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads models in process."""
    p.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL",
                   help="target model: catalog name, Hugging Face directory or .gguf file (default: %(default)s)")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model for --method draft/hybrid/auto; 'none' (as with `tandem up`) or left out: no "
                        "draft model")
    add_draft_flags(p)
    p.add_argument("--method", default="auto", choices=METHODS,
                   help="proposer: none (target only), draft (draft model), ngram (prompt lookup), hybrid "
                        "(n-gram when the text repeats, else the draft model), early-exit (the target's first "
                        "layers; in process only), medusa / eagle (the target's own heads, --heads), auto (the "
                        "target's heads if --heads is given, with hybrid rounds while they measure slower if "
                        "--draft is given too; else hybrid if --draft is given, else ngram)")
    p.add_argument("--heads", default=None, metavar="PATH|NAME",
                   help="the target's speculation heads: a directory (Tandem's layout, the Medusa project's, or "
                        "EAGLE-3 as vLLM's speculators library writes it) or the name of heads prepared with "
                        "`tandem heads prepare`; they must have been trained for this target")
    p.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                   help=f"most draft tokens per round (default: {DEFAULT_K} from a draft model; up to {MAX_K} from "
                        "lookup: the text's own repeats, a prediction, as their kind of match earns); given, it caps "
                        "both; 0 disables speculation")
    p.add_argument("--no-draft-stops", action="store_true",
                   help="the draft model drafts every token of a round's k instead of stopping where it is unsure "
                        "(in process; a coordinator's own --no-draft-stops decides for its requests)")
    p.add_argument("--fixed-k", action="store_true",
                   help="always draft k tokens instead of adapting k per request and stopping a round's draft "
                        "where it is unsure (heads: ask them every round)")
    p.add_argument("--heads-nodes", type=int, default=0, metavar="N",
                   help=f"medusa / eagle: the most nodes of the heads' tree per round, 1..{MAX_K}; 0 (default): "
                        "as many as the target's measured forward cost prices at a quarter of a step")
    p.add_argument("--tree", default="auto", choices=TREE_MODES,
                   help="speculation trees: verify the draft's next-best tokens and other n-gram continuations "
                        "beside the chain in the same pass. auto: when the cost model says the extra rows pay "
                        "(they do where a verification of 16 tokens costs about one of 1, as on a GPU); on: "
                        "whenever there are candidates; off: chains only (default: %(default)s)")
    p.add_argument("--tree-width", type=int, default=2,
                   help=f"most other candidates per position in a tree, 1..{MAX_TREE_WIDTH} (default: %(default)s)")
    p.add_argument("--early-exit-layers", type=int, default=None,
                   help="layers of the target used as self-draft (default: a quarter of them)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched (default: %(default)s)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="the target's weights and activations dtype (default auto: bfloat16 where the hardware "
                        "multiplies it natively, else float16 on a GPU, float32 with packed weights on a CPU)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="attention backend")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode and verify steps as captured CUDA graphs (default: on with --device cuda; "
                        "see `tandem serve target --help`)")
    p.add_argument("--packed-weights", default="auto", choices=PACKED_WEIGHTS,
                   help=PACKED_WEIGHTS_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 disables")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the likeliest token (after temperature); in [0, 1], "
                        "0 disables (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampler (reproducible runs)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide (multiply, when negative) the logits of every token already in the text, prompt "
                        "included, by this; > 0, 1 is none (default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count in the generated text from its logit; in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token the generated text holds; in [-2, 2]")
    structure = p.add_mutually_exclusive_group()
    structure.add_argument("--json-object", action="store_true", help="the answer is a JSON object (JSON mode)")
    structure.add_argument("--json-schema", default="", metavar="SCHEMA|@FILE",
                           help="the answer is JSON valid under this JSON schema (its text, or @ and a file with it)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling flags, validated (a bad value names its field)."""
    schema = args.json_schema
    if schema.startswith("@"):
        try:
            schema = Path(schema[1:]).read_text()
        except OSError as exc:
            raise InvalidRequestError(f"--json-schema: cannot read {schema[1:]}: {exc.strerror}") from None
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed,
                              repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, json_object=args.json_object,
                              json_schema=schema, min_p=args.min_p)
    check_response_format(sampling)
    return sampling


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt (in process, or via --addr a coordinator)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system turn before the prompt (implies --chat): instructions, or reference text that "
                        "every request repeats (workers cache it: a repeat reads only what follows it)")
    p.add_argument("--prefill", default=None, metavar="TEXT",
                   help="the answer's start, which the model continues (implies --chat): an assistant turn left "
                        "open, as vLLM's continue_final_message (\"```python\", \"{\"); printed first, but not part "
                        "of --json's text")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra variables for the chat template, a JSON object (implies --chat), as vLLM's "
                        "chat_template_kwargs: '{\"enable_thinking\": false}' for Qwen3; a template ignores the ones "
                        "it does not read")
    p.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: the answer is the text between the prompt and TEXT (the code before and "
                        "after an editor's cursor), asked in the model's own fill-in-the-middle tokens (Qwen2.5-Coder, "
                        "StarCoder, DeepSeek-Coder); a model without them is refused. The prompt may then be empty")
    p.add_argument("--prediction", default=None, metavar="FILE",
                   help="text the answer is expected to repeat, from FILE ('-': standard input): the file an edit "
                        "rewrites, as OpenAI's Predicted Outputs. Rounds propose what follows in it; the answer is "
                        "the same without it, and sooner where it copies it")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats) last")
    p.add_argument("--addr", default=None, metavar="HOST[:PORT]",
                   help="send the request to a running coordinator instead of loading models here (port: "
                        f"{DEFAULT_COORDINATOR_PORT} when left out); of the model flags, only --method, -k, --fixed-k, "
                        "--heads-nodes and --tree travel with the request, and the others are refused")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable; with --addr)")
    p.add_argument("--no-pipelining", action="store_true", help="with --addr: no pipelined drafting")
    p.add_argument("--priority", type=int, default=0,
                   help="with --addr: the request's priority, lower first where a target's KV pool runs short (a "
                        "coordinator started with --scheduling-policy priority; others take only 0) (default: 0)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"with --addr: request deadline in seconds (default: {DEFAULT_TIMEOUT_S:g})")
    add_tool_flags(p)
    add_client_flags(p)
    add_sampling_flags(p)
    add_model_flags(p)
    p.set_defaults(func=run)


def resolve_or_prepare(spec: str, root: os.PathLike[str]) -> os.PathLike[str]:
    """A catalog name that is not prepared yet is prepared now (with progress bars)."""
    try:
        return model_store.resolve_model(spec, root, progress=True)
    except ModelFileError:
        if spec in model_store.CATALOG:
            print(f"preparing {spec} (first use)...", file=sys.stderr)
            return model_store.prepare(spec, root, progress=True)
        raise


def options_from_args(args: argparse.Namespace, heads: str = "") -> tuple[str, SpecOptions]:
    """The resolved method and the speculation options the flags ask for (validated, nothing loaded);
    ``heads``: the kind of the target's heads (``--heads``), "" for none."""
    method = resolve_method(args.method, args.draft is not None, heads=heads)
    if args.early_exit_layers is not None and args.early_exit_layers < 1:
        raise InvalidRequestError(f"--early-exit-layers must be >= 1, got {args.early_exit_layers}")
    k = DEFAULT_K if args.k is None else args.k
    return method, SpecOptions(method, k, not args.fixed_k, lookup_k_max=MAX_K if args.k is None else k,
                               ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                               tree=args.tree, tree_width=args.tree_width, heads_nodes=args.heads_nodes,
                               heads_fallback=heads_fallback(args.method, method, args.draft is not None),
                               draft_stops=not args.no_draft_stops)


def configs_from_args(
    args: argparse.Namespace,
) -> tuple[SamplingParams, SpecOptions, EngineConfig, EngineConfig | None]:
    """Validate every flag, then resolve the models; nothing heavy is loaded yet."""
    sampling = sampling_from_args(args)
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    heads_kind = ""
    if getattr(args, "heads", None):
        from tandem.heads.formats import heads_kind as read_heads_kind
        from tandem.heads.locate import resolve_heads

        args.heads = resolve_heads(args.heads, root)
        heads_kind = read_heads_kind(args.heads)
    method, options = options_from_args(args, heads_kind)
    if args.max_new_tokens <= 0:
        raise InvalidRequestError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = EngineConfig(resolve_or_prepare(args.target, root), args.dtype, args.device,
                          attention_backend=args.attention, packed_weights=args.packed_weights,
                          cuda_graphs=args.cuda_graphs)
    draft = None
    if method in ("draft", "hybrid") or options.draft_between_heads:
        draft = EngineConfig(resolve_or_prepare(args.draft, root), device=args.device,
                             attention_backend=args.attention, packed_weights=args.packed_weights,
                             cuda_graphs=args.cuda_graphs, **draft_engine_options(args))
    return sampling, options, target, draft


def chat_turns(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """The conversation ``--system``, ``--prefill`` and ``--chat-template-kwargs`` make of the prompt (a system
    turn, the prompt as the user's, the assistant's open turn); None without any."""
    if args.system is None and args.prefill is None and args.chat_template_kwargs is None:
        return None
    turns = [] if args.system is None else [{"role": "system", "content": args.system}]
    turns.append({"role": "user", "content": args.prompt})
    if args.prefill is not None:
        turns.append({"role": "assistant", "content": args.prefill})
    return turns


def check_request_flags(args: argparse.Namespace) -> None:
    """What both paths refuse alike, before anything connects or loads."""
    if args.suffix is not None:
        chat_flags = {"--chat": args.chat, "--system": args.system is not None, "--prefill": args.prefill is not None,
                      "--chat-template-kwargs": args.chat_template_kwargs is not None, "--tools": bool(args.tools)}
        given = [flag for flag, on in chat_flags.items() if on]
        if given:
            raise InvalidRequestError(f"--suffix: not with {', '.join(given)} (a fill-in-the-middle prompt is the "
                                      "code around the gap, with no chat template)")
        if not args.prompt and not args.suffix:
            raise InvalidRequestError("--suffix and the prompt are both empty: give the text around the gap")
    elif not args.prompt:
        raise InvalidRequestError("the prompt is empty: give the text to continue")
    if args.max_new_tokens <= 0:  # (on the wire 0 means "unset": the server would give the default)
        raise InvalidRequestError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise InvalidRequestError(f"--cuda-graphs needs --device cuda, and the models would run on {args.device}")
    if args.addr:
        if args.timeout is not None and not args.timeout > 0:  # NaN too
            raise InvalidRequestError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        if args.method == "early-exit":
            raise InvalidRequestError("--method early-exit: in process only (a coordinator has no early-exit "
                                      "rounds); leave out --addr, or choose another method")
        ignored = in_process_flags_given(args)
        if ignored:
            raise InvalidRequestError(f"{', '.join(ignored)}: in process only (with --addr the coordinator's workers "
                                      "decide models, dtype, device and drafting); leave them out, or --addr")
        return
    remote_only = {"--stop": bool(args.stop), "--timeout": args.timeout is not None,
                   "--no-pipelining": args.no_pipelining, "--priority": args.priority != 0}
    for flag, given in remote_only.items():
        if given:
            raise InvalidRequestError(f"{flag}: only with --addr (a coordinator applies it); in process it would "
                                      "be ignored")


# The model flags a request carries to a coordinator (SpeculationOptions); every other one is the in-process pipeline's.
REQUEST_MODEL_FLAGS = frozenset({"method", "k", "fixed_k", "heads_nodes", "tree"})


def in_process_flags_given(args: argparse.Namespace) -> list[str]:
    """The in-process model flags set to something other than their default: with --addr they would be ignored."""
    probe = argparse.ArgumentParser(add_help=False)
    add_model_flags(probe)
    given = [(action, getattr(args, action.dest, action.default)) for action in probe._actions
             if action.dest not in REQUEST_MODEL_FLAGS]
    return [_flag_as_given(action, value) for action, value in given if value != action.default]


def _flag_as_given(action: argparse.Action, value: object) -> str:
    """The flag that set ``value``: ``--no-X`` for an ``X/--no-X`` pair set false, else its long form."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return action.option_strings[0 if value else 1]
    return action.option_strings[-1]


def read_prediction(path: str | None) -> str:
    """``--prediction``'s text ("" without one); a file that cannot be read is named."""
    if path is None:
        return ""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--prediction {path}: cannot read it ({exc})") from None
    if not text:
        raise InvalidRequestError(f"--prediction {path}: the file is empty (a prediction proposes its text)")
    return text


def coordinator_address(addr: str) -> str:
    """``--addr`` as gRPC takes it: a bare host gets the coordinator's default port (gRPC's own would be 443)."""
    if "://" in addr or addr.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return addr  # a gRPC target name: as given
    if addr.startswith("["):  # [v6] or [v6]:port
        return f"{addr}:{DEFAULT_COORDINATOR_PORT}" if addr.endswith("]") else addr
    return f"{addr}:{DEFAULT_COORDINATOR_PORT}" if ":" not in addr else addr


def run(args: argparse.Namespace) -> int:
    if args.draft == "none":  # `tandem up`'s spelling of "no draft workers"
        args.draft = None
    tools = tool_options_from_args(args)  # (refused in process, before any model loads)
    check_request_flags(args)
    args.prediction_text = read_prediction(args.prediction)  # (a file that cannot be read: named before any load)
    try:
        args.template_kwargs = template_kwargs(args.chat_template_kwargs or "")
    except ValueError as exc:
        raise InvalidRequestError(f"--chat-template-kwargs: {exc}") from None
    try:
        return run_remote(args, tools) if args.addr else run_in_process(args)
    except KeyboardInterrupt:  # Ctrl-C mid-answer: end the streamed line, say so (the request's KV is freed)
        print("\n[interrupted]", file=sys.stderr, flush=True)
        return 130


def run_in_process(args: argparse.Namespace) -> int:
    """Load the models here and stream the answer as it is generated."""
    from tandem.infill import InfillFormat, no_infill_message
    from tandem.inprocess import GenerationRequest
    from tandem.pipeline import LocalPipeline
    from tandem.text_stream import TextStream
    from tandem.tokenizer import encode_messages, encode_prompt, load_tokenizer

    sampling, options, target_cfg, draft_cfg = configs_from_args(args)
    infill = None
    if args.suffix is not None:  # (a model without markers refused from its tokenizer, before the weights load)
        infill = InfillFormat.of(load_tokenizer(target_cfg.model_dir))
        if infill is None:
            raise InvalidRequestError(no_infill_message("--suffix"))
    t0 = time.perf_counter()
    pipeline = LocalPipeline.load(target_cfg, options.method, options, draft_cfg, args.early_exit_layers,
                                  heads_path=args.heads)
    print(f"loaded {pipeline.method} pipeline in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    turns = chat_turns(args)
    stop_ids = pipeline.stop_ids
    if infill is not None:
        prompt_ids = infill.prompt_ids(pipeline.tokenizer, args.prompt, args.suffix)
        stop_ids = stop_ids | infill.stop_ids  # (the format's end tokens end a middle, as the coordinator's do)
    elif turns is not None:
        prompt_ids = encode_messages(pipeline.tokenizer, turns, continue_final=args.prefill is not None,
                                     kwargs=args.template_kwargs)
    else:
        prompt_ids = encode_prompt(pipeline.tokenizer, args.prompt, args.chat)
    # The text as it is generated, as with --addr (a decoder's pieces held back until they are whole characters)
    stream = None if args.json else TextStream(pipeline.tokenizer, skip_token_ids=stop_ids)
    if stream is not None and args.prefill:
        print(args.prefill, end="", flush=True)

    def show(tokens: list[int]) -> None:
        for token in tokens:
            stream.push(token)
        print(stream.take(), end="", flush=True)

    prediction = args.prediction_text
    request = GenerationRequest(prompt_ids, args.max_new_tokens, sampling, stop_ids,
                                prediction_ids=pipeline.tokenizer.encode(prediction, add_special_tokens=False)
                                if prediction else [],
                                on_tokens=show if stream is not None else None)
    result = pipeline.generator().generate([request])[0]
    if args.json:
        text = pipeline.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        stats = {**result.stats.as_dict(), "method": pipeline.method}
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": stats}))
    else:
        stream.finish()
        print(stream.take(), flush=True)
        s = result.stats
        print(f"[{s.generated} tokens, {s.tokens_per_s:.2f} tok/s, method {pipeline.method}, "
              f"accepted {s.accepted}/{s.drafted} drafted in {s.rounds} rounds]", file=sys.stderr)
    return 0


def run_remote(args: argparse.Namespace, tools: generation_pb2.ToolOptions | None = None) -> int:
    """Stream from a coordinator; the server validates the request and names any bad field. With ``tools`` the
    prompt goes as a conversation (tools are shown by the chat template) and the calls are printed after the text."""
    import grpc

    from tandem.client import TandemClient, build_request

    sampling = sampling_from_args(args)
    method = "" if args.method == "auto" else args.method
    prompt: str | list[dict[str, str]] = chat_turns(args) or args.prompt
    if tools is not None and isinstance(prompt, str):
        prompt = [{"role": "user", "content": args.prompt}]
    request = build_request(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, method=method,
                            k=args.k, fixed_k=args.fixed_k, pipelining=not args.no_pipelining, chat=args.chat,
                            stop_strings=tuple(args.stop), tree=args.tree, heads_nodes=args.heads_nodes,
                            prediction=args.prediction_text)
    request.priority = args.priority
    if tools is not None:
        request.tools.CopyFrom(tools)
    if args.suffix is not None:  # (replaces the text in the request's input)
        request.infill.prefix, request.infill.suffix = args.prompt, args.suffix
    if args.chat_template_kwargs is not None:
        request.messages.template_kwargs = json.dumps(args.template_kwargs)
    if args.prefill is not None:
        request.messages.continue_final_message = True
        if not args.json:
            print(args.prefill, end="", flush=True)
    tokens: list[int] = []
    text_parts: list[str] = []
    calls: list[dict[str, object]] = []
    last = None
    tls, token = client_options(args)
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    with TandemClient(coordinator_address(args.addr), timeout_s=timeout, tls=tls, token=token) as client:
        try:
            for chunk in client.stream(request):
                tokens.extend(chunk.token_ids)
                text_parts.append(chunk.text)
                calls += [{"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)} for c in chunk.tool_calls]
                if not args.json:
                    print(chunk.text, end="", flush=True)
                last = chunk
        except grpc.RpcError as exc:
            hint = ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and last is None and "connect" in (exc.details() or ""):
                hint = f" (is a coordinator running at {coordinator_address(args.addr)}? `tandem up` starts one)"
            print(f"tandem: error: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
            return 2
    stats = last.stats if last is not None else None
    if args.json:
        from google.protobuf.json_format import MessageToDict

        stats_dict = (
            MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            if stats else {}
        )
        out = {"text": "".join(text_parts), "token_ids": tokens, "finish_reason": last.finish_reason if last else "",
               "stats": stats_dict}
        if tools is not None:
            out["tool_calls"] = calls
        print(json.dumps(out))
    else:
        print()
        for call in calls:  # one JSON object a line, after the text
            print(json.dumps(call))
        if stats:
            print(f"[{stats.generated_tokens} tokens, {stats.tokens_per_s:.2f} tok/s, method {stats.method}, "
                  f"accepted {stats.accepted}/{stats.drafted} drafted in {stats.rounds} rounds]", file=sys.stderr)
    return 0
