"""`tandem heads`: train speculation heads on a target's own outputs, prepare the default ones, list them.

``train`` runs the target once over a corpus (its own greedy labels and hidden states,
kept in resumable shards), trains Medusa heads or an EAGLE-3 head on them, prints the
held-back accuracy per head / draft step, and writes the heads (Tandem's layout, with
their provenance) to ``--out``. ``prepare`` does that for the catalog's target with
settings fixed here, on the target's own answers to 1,000 prompts (``answers``, kept in
``$TANDEM_HOME/answers``), into ``$TANDEM_HOME/heads/<target>-<kind>``, unless already there.
The directory is printed last on stdout; progress and the accuracy go to stderr.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from tandem import model_store
from tandem.heads.config import KINDS, HeadsConfig, HeadsConfigError
from tandem.heads.locate import heads_root
from tandem.heads.train.options import (
    DEFAULT_LR,
    PREPARE_ANSWERS,
    TRAIN_DTYPES,
    AnswerSettings,
    TrainOptions,
    answers_root,
    default_out_dir,
    default_work_dir,
    prepare_options,
)

PREPARE_TARGET = "qwen-coder-1.5b"  # the catalog's benchmark target (`tandem up`'s default)
_CORPUS_HELP = (
    "training text: files, directories of text files, or .jsonl files with a \"text\" field per line (repeatable). "
    "Default: the Python sources of the third-party packages installed beside Tandem (site-packages, each under its "
    "distribution's licence) and Debian package documentation under /usr/share/doc (each under its package's "
    "copyright), pieces wrapped in the target's chat template. The Python standard library, HumanEval and "
    "Spec-Bench are never used: Tandem is measured on them"
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `heads` command and its subcommands to the top-level parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="cache root holding models/ and heads/ (default: $TANDEM_HOME, else ~/.cache/tandem)")
    running = argparse.ArgumentParser(add_help=False)
    running.add_argument("--device", default="cpu", help="torch device for the target and the training (default: "
                         "%(default)s; e.g. cuda)")
    running.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")

    heads = sub.add_parser(
        "heads", help="train, prepare and list speculation heads (Medusa, EAGLE-3)",
        description="Speculation heads read the target's own hidden states and guess its next tokens; "
        "they are trained on the target's own outputs (self-distillation), so they fit one target only.",
    )
    actions = heads.add_subparsers(dest="heads_command", metavar="ACTION", required=True)

    train = actions.add_parser(
        "train", parents=[common, running], help="train heads for a target",
        description="Run the target once over a corpus, keeping per token its greedy label (what the target "
        "itself says next) and the hidden states the heads read; train the heads on them with AdamW; print "
        "top-1/top-3 accuracy per Medusa head / EAGLE draft step on held-back sequences; write the heads "
        "with their provenance (command, seed, corpus sources and licences, time, accuracy). Feature "
        "shards and checkpoints go to --work-dir; an interrupted run continues with --resume.",
    )
    train.add_argument("--target", required=True, metavar="MODEL",
                       help="the target: catalog name, Hugging Face directory or .gguf file")
    train.add_argument("--kind", required=True, choices=KINDS,
                       help="medusa: K heads on the final hidden state; eagle: one EAGLE-3 decoder layer on a low, "
                       "a middle and a high layer's states, trained over --ttt-steps draft steps")
    train.add_argument("--corpus", action="append", type=Path, metavar="PATH", default=[], help=_CORPUS_HELP)
    train.add_argument("--out", type=Path, metavar="DIR", default=None,
                       help="where the heads go (default: <cache>/heads/<target>-<kind>, the name --heads accepts)")
    train.add_argument("--work-dir", type=Path, metavar="DIR", default=None,
                       help="feature shards and checkpoints (default: .<out name>.work beside --out); "
                       "features are kept for another run over the same corpus")
    defaults = TrainOptions(kind="medusa")
    train.add_argument("--tokens", type=int, default=defaults.tokens,
                       help="corpus tokens run through the target, 5%% of them held back (default: %(default)s)")
    train.add_argument("--seq-len", type=int, default=defaults.seq_len,
                       help="tokens per sequence (default: %(default)s)")
    train.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default: %(default)s)")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size,
                       help="sequences per step (default: %(default)s)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak AdamW learning rate, after a linear warm-up, then a cosine to a tenth (default: "
                       + ", ".join(f"{lr:g} for {kind}" for kind, lr in DEFAULT_LR.items()) + ")")
    train.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                       help="the heads score the N ids the target says most often in the corpus (default: the whole "
                       "vocabulary up to 32768 ids, else 32000)")
    train.add_argument("--num-heads", type=int, default=defaults.num_heads,
                       help="medusa heads, each one token further ahead (default: %(default)s)")
    train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                       help="eagle draft steps trained at once, each on the previous one's output "
                       "(default: %(default)s)")
    train.add_argument("--eagle-intermediate-size", type=int, default=None, metavar="N",
                       help="MLP width of the EAGLE layer (default: a third wider than the target's hidden size, "
                       "at most the target's own width: every draft step runs it)")
    train.add_argument("--seed", type=int, default=defaults.seed,
                       help="corpus sampling, batch order and initialisation (default: %(default)s)")
    train.add_argument("--train-dtype", default="auto", choices=TRAIN_DTYPES,
                       help="compute dtype (master weights stay fp32); auto: bf16 autocast on a GPU; on a CPU "
                       "whichever of fp32 and bf16 autocast runs a step faster here (timed at the start)")
    train.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                       help="steps between checkpoints, each with the optimizer state (default: %(default)s)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint (same flags: the run is checked), bit for bit")
    train.set_defaults(func=_train)

    prepare = actions.add_parser(
        "prepare", parents=[common, running], help=f"train the default heads for {PREPARE_TARGET}",
        description=f"Train the default heads of --kind for the catalog's target ({PREPARE_TARGET}, prepared "
        f"first if needed) with fixed settings: the target's own greedy answers to {PREPARE_ANSWERS.prompts} "
        "prompts built from this machine's text (as `tandem heads answers` writes them, kept in <cache>/answers/), "
        f"then the heads trained on those answers with seed 0, into <cache>/heads/{PREPARE_TARGET}-<kind>, unless "
        "heads made with the same settings are there already. An interrupted run continues where it stopped. "
        "About 77 minutes on a 2-core CPU with native bf16 (answers, the target's pass over them, the training).",
    )
    prepare.add_argument("--kind", default="eagle", choices=KINDS, help="which heads (default: %(default)s)")
    prepare.set_defaults(func=_prepare)

    answers = actions.add_parser(
        "answers", parents=[common, running], help="write the target's own answers to prompts: a training corpus",
        description="Build --prompts requests from the text on this machine (third-party functions to complete, "
        "coding tasks, code to explain, Debian documentation to summarize and answer from, questions and writing "
        "about installed packages, arithmetic word problems, German to translate; never HumanEval, Spec-Bench or "
        "the standard library), have the target answer them greedily in batches, and append each answer to --out "
        "as a conversation (JSONL). Pass that file to `tandem heads train --corpus`: heads learn best from what "
        "the target says while it answers. An interrupted run continues where it stopped.",
    )
    answers.add_argument("--target", required=True, metavar="MODEL",
                         help="the target: catalog name, Hugging Face directory or .gguf file")
    answers.add_argument("--out", required=True, type=Path, metavar="FILE", help="the JSONL file to append to")
    answers.add_argument("--prompts", type=int, default=1200, help="how many prompts (default: %(default)s; the "
                         "German translated back adds about a tenth)")
    answers.add_argument("--max-new-tokens", type=int, default=AnswerSettings().max_new_tokens,
                         help="tokens per answer at most (default: %(default)s)")
    answers.add_argument("--batch-size", type=int, default=AnswerSettings().batch_size,
                         help="answers generated together (default: %(default)s)")
    answers.add_argument("--seed", type=int, default=0, help="which files and numbers the prompts use "
                         "(default: %(default)s)")
    answers.set_defaults(func=_answers)

    listing = actions.add_parser("list", parents=[common], help="list prepared heads",
                                 description="List the heads under <cache>/heads: kind, target, draft vocabulary "
                                 "and held-back top-1 accuracy of the first head / step.")
    listing.set_defaults(func=_list)


def _root(args: argparse.Namespace) -> Path:
    return model_store.cache_root_from(args.cache_dir, os.environ)


def _options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(
        kind=args.kind, tokens=args.tokens, seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, draft_vocab=args.draft_vocab, num_heads=args.num_heads, ttt_steps=args.ttt_steps,
        eagle_intermediate_size=args.eagle_intermediate_size, seed=args.seed, train_dtype=args.train_dtype,
        checkpoint_every=args.checkpoint_every,
    )


def command_line(target: str, options: TrainOptions, corpus: list[Path], out: Path | None = None) -> str:
    """The `tandem heads train` command that asks for exactly this run (every setting spelled out)."""
    words = ["tandem", "heads", "train", "--target", target, "--kind", options.kind]
    for path in corpus:
        words += ["--corpus", str(path)]
    if out is not None:
        words += ["--out", str(out)]
    flags = {"tokens": options.tokens, "seq-len": options.seq_len, "steps": options.steps,
             "batch-size": options.batch_size, "lr": options.lr, "seed": options.seed,
             "train-dtype": options.train_dtype, "checkpoint-every": options.checkpoint_every}
    if options.draft_vocab is not None:
        flags["draft-vocab"] = options.draft_vocab
    if options.kind == "medusa":
        flags["num-heads"] = options.num_heads
    else:
        flags["ttt-steps"] = options.ttt_steps
        if options.eagle_intermediate_size is not None:
            flags["eagle-intermediate-size"] = options.eagle_intermediate_size
    for name, value in flags.items():
        words += [f"--{name}", str(value)]
    return shlex.join(words)


def _run(target_spec: str, options: TrainOptions, args: argparse.Namespace, out: Path | None, resume: bool,
         corpus: list[Path], work_dir: Path | None = None, strict: bool = True) -> int:
    """Resolve the target, train, print the accuracy table (stderr) and the heads' directory (stdout)."""
    from tandem.cli.generate import resolve_or_prepare
    from tandem.heads.train.pipeline import TrainRequest, train_heads  # torch: only once the flags are good

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    root = _root(args)
    target_dir = Path(resolve_or_prepare(target_spec, root))
    target_name = target_spec if target_spec in model_store.CATALOG else target_dir.name
    out = out or default_out_dir(root, target_name, options.kind)
    request = TrainRequest(
        target_dir=target_dir, target_name=target_name, out=out,
        work_dir=work_dir or default_work_dir(out), corpus=tuple(corpus), device=args.device, resume=resume,
        resume_strict=strict, command=command_line(target_spec, options, corpus, out),
    )
    result = train_heads(request, options)
    assert result is not None  # only a test stops a run early
    print(result.table, file=sys.stderr)
    print(result.out, flush=True)
    return 0


def _train(args: argparse.Namespace) -> int:
    options = _options(args)  # validated before anything is loaded
    return _run(args.target, options, args, args.out, args.resume, args.corpus, args.work_dir)


def _answers(args: argparse.Namespace) -> int:
    settings = AnswerSettings(args.max_new_tokens, args.batch_size)
    _write_answers(args.target, args.out, args.prompts, args.seed, settings, args)
    print(args.out, flush=True)
    return 0


def _write_answers(target_spec: str, out: Path, prompts: int, seed: int, settings: AnswerSettings,
                   args: argparse.Namespace) -> None:
    """The target's answers to ``prompts`` prompts appended to ``out`` (those it holds already are skipped)."""
    from tandem.cli.generate import resolve_or_prepare
    from tandem.heads.train.answers import write_answers  # torch: only once the flags are good

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target_dir = Path(resolve_or_prepare(target_spec, _root(args)))
    line = model_store.ProgressLine(f"{target_spec}-answers")
    try:
        count = write_answers(target_dir, out, prompts, seed, settings, args.device, line)
    except BaseException as exc:
        line.close("stopped" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise
    line.close("ready")
    skipped = f"; {count.too_long} prompts over {settings.max_prompt_tokens} tokens skipped" if count.too_long else ""
    print(f"{count.written} answers written to {out}{skipped}", file=sys.stderr)


def _prepare(args: argparse.Namespace) -> int:
    options = prepare_options(args.kind)
    root = _root(args)
    name = Path(PREPARE_TARGET).name  # a catalog name (tests swap in a directory)
    out = default_out_dir(root, name, args.kind)
    plan = PREPARE_ANSWERS
    answers = answers_root(root) / plan.file_name(name)  # named by its plan: another plan, another file
    if _prepared_with(out, options, answers):
        print(f"heads already prepared in {out} (same settings)", file=sys.stderr)
        print(out)
        return 0
    # The target's own answers first (kept: both kinds train on them, and a stopped run resumes them), then
    # the heads trained on them.
    answers.parent.mkdir(parents=True, exist_ok=True)
    _write_answers(PREPARE_TARGET, answers, plan.prompts, plan.seed, plan.settings, args)
    code = _run(PREPARE_TARGET, options, args, out, True, [answers], strict=False)  # continues an interrupted run
    shutil.rmtree(default_work_dir(out), ignore_errors=True)  # features for one fixed run: not worth keeping
    return code


def _prepared_with(out: Path, options: TrainOptions, answers: Path) -> bool:
    """Whether ``out`` holds heads trained with ``options`` on the answers file ``answers`` alone."""
    from tandem.heads.store import CONFIG_FILE, is_tandem_layout  # torch: not for the slim coordinator's CLI

    if not is_tandem_layout(out):
        return False
    try:
        cfg = HeadsConfig.load(out / CONFIG_FILE)
    except HeadsConfigError:
        return False
    origins = cfg.training.get("corpus", {}).get("origins", {})
    return cfg.training.get("options") == options.to_json() and [Path(o).name for o in origins] == [answers.name]


def _list(args: argparse.Namespace) -> int:
    from tandem.heads.store import CONFIG_FILE, is_tandem_layout

    root = heads_root(_root(args))
    rows = []
    for path in sorted(root.glob("*")) if root.is_dir() else []:
        if not is_tandem_layout(path):
            continue
        try:
            cfg = HeadsConfig.load(path / CONFIG_FILE)
        except HeadsConfigError as exc:
            rows.append((path.name, "unreadable", "", "", "", str(exc)))
            continue
        first = (cfg.training.get("accuracy", {}).get("trained") or [{}])[0]
        top1 = f"{first['top1']:.1%}" if "top1" in first else "-"
        size = cfg.num_heads if cfg.kind == "medusa" else cfg.intermediate_size
        rows.append((path.name, cfg.kind, cfg.target_name or "?", str(cfg.draft_vocab_size), top1,
                     f"{'heads' if cfg.kind == 'medusa' else 'mlp'} {size}  {path}"))
    if not rows:
        print(f"no heads in {root} (`tandem heads prepare` or `tandem heads train`)", file=sys.stderr)
        return 0
    header = ("NAME", "KIND", "TARGET", "DRAFT VOCAB", "TOP-1", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5])
    return 0
