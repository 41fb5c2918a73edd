"""The ``specdec`` command line (also ``python -m specdec_ext``): generate, audit, bench, demo, serve, train-eagle."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import warnings
from typing import Dict, List, NoReturn, Optional

from .arg_types import (OneLineParser, USAGE_ERROR_STATUS, at_least, int_in, int_list, non_negative, positive,
                        probability, read_text_option, tree_shape, usage_error_line)
from .stats import format_measured
from .bench.workloads import heldout_prompts
from .eagle import command as eagle_command
from .plots import check_plot_option, write_plot
from .processing import REPETITION_PENALTY_RANGE
from .progress import hf_progress_bars_off, progress_bar, progress_wanted

DEMO_PROMPT_LINES = 20  # lines of each held-out file used as a demo prompt
DEMO_FILES = 3
DEMO_NEW_TOKENS = 64
DEMO_THREADS = 1  # the bundled models are small: intra-op threads cost more than they save on a CPU
BUNDLED_PAIR_DTYPE = "bfloat16"  # the bundled pair's stored dtype: a pass reads half the bytes of float32
# specdec serve's start-up request (Engine.calibrate): ordinary code, whatever the model
SERVE_CALIBRATION_TEXT = "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as handle:\n"
DEFAULT_AUDIT_PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Parser:\n    def __init__(self"]
GENERATE_PROGRESS_DELAY_S = 3.0  # a generation shows a progress bar only once it has run this long


def _draft_length(value: str):
    """-k: 'auto' or an int >= 1."""
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {value!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {value!r}")
    return k


def _json(value) -> str:
    """Strict JSON: a NaN or an infinity (an acceptance nobody measured) is null (json.dumps wrote a bare NaN)."""
    def strict(v):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return None
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [strict(x) for x in v]
        return v
    return json.dumps(strict(value), indent=2, allow_nan=False)


# --draft's help, by command (what each command runs)
EAGLE_HELP = ("'eagle' for the bundled target's EAGLE-3 head, or an EAGLE-3 checkpoint directory (with its --target; "
              "alone: a head for the bundled target)")
LOOKUP_AND_HEADS_HELP = ("'ngram' for lookup drafting over the prompt and the generated tokens (no draft model); "
                         "'heads' for the bundled target's Medusa-style heads, or a heads directory "
                         "(tools/train_heads.py) with --target")
DRAFT_HELP = ("draft model sharing the target's vocabulary, or with another tokenizer (see --draft-tokenizer); "
              f"{LOOKUP_AND_HEADS_HELP}; {EAGLE_HELP} (default: the bundled pair's draft)")
DEMO_DRAFT_HELP = ("draft model sharing the target's vocabulary; "
                   f"{LOOKUP_AND_HEADS_HELP}; {EAGLE_HELP} (default: the bundled pair's draft)")
AUDIT_DRAFT_HELP = ("draft model sharing the target's vocabulary, or with another tokenizer (see --draft-tokenizer); "
                    f"{EAGLE_HELP} (default: the bundled pair's draft); lookup drafting and heads are not audited")
SERVE_DRAFT_HELP = ("draft model sharing the target's vocabulary, or with another tokenizer (see --draft-tokenizer); "
                    f"'ngram' for lookup drafting; {EAGLE_HELP}, drafting chains; 'none' for plain decoding (one "
                    "target pass per token); heads and trees are not served (default: the bundled pair's draft)")


def _model_args(parser: argparse.ArgumentParser, threads: Optional[int] = None, draft_help: str = DRAFT_HELP) -> None:
    parser.add_argument("--target", help="target model: a local path or model id, loaded offline "
                        "(default: the bundled pair's target; give --target and --draft together)")
    parser.add_argument("--draft", help=draft_help)
    parser.add_argument("--threads", type=at_least(1), default=threads,
                        help="torch CPU threads (default: " + ("torch's choice" if threads is None else str(threads))
                        + "; 1 is best for small models on a busy CPU)")
    parser.add_argument("--runner", default="auto", choices=["auto", "lean", "paged", "recompute"],
                        help="model runner: auto (the lean runner for Llama-family models: the CPU kernels on a CPU, "
                        "a pure-torch forward elsewhere; the paged "
                        "KV cache otherwise and where CUDA graphs run), lean, paged, or the slow full-recompute "
                        "oracle (default: auto)")


def _report_args(parser: argparse.ArgumentParser, figure: str) -> None:
    parser.add_argument("--plot", metavar="FILE.png", help=f"also draw {figure} into FILE.png (needs matplotlib: "
                        'pip install ".[plot]" in the specdec_ext checkout)')
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (they go to stderr, and only when it is a terminal)")


def _sampling_args(parser: argparse.ArgumentParser, temperature: float, seed: str = "random",
                   greedy: str = "0 is greedy") -> None:
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"sampling temperature; {greedy} (default: {temperature:g})")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off (default: 1)")
    parser.add_argument("--seed", type=int, default=None, help=f"Philox seed of every row (default: {seed})")


def _generate_parser(sub) -> None:
    """The ``specdec generate`` subcommand's flags."""
    g = sub.add_parser("generate", help="generate text (streamed) and print the stats",
                       description="Generate continuations of the prompts with speculative decoding, stream the "
                       "text as tokens are accepted, then print the stats (tokens per target pass, acceptance "
                       "by draft position, draft/verify time, tokens/s, TPOT, cost-model prediction).")
    g.add_argument("prompts", nargs="*", help="prompt texts (use --prompt-file for multi-line prompts)")
    g.add_argument("--prompt", action="append", default=[], dest="prompt_flags", metavar="TEXT",
                   help="a prompt text, as an option (repeatable; added after the positional prompts)")
    g.add_argument("--prompt-file", action="append", default=[],
                   help="a file whose content is one prompt (repeatable; - reads standard input)")
    _model_args(g)
    g.add_argument("--max-new-tokens", type=at_least(0), default=128,
                   help="exact cap on new tokens per prompt (default: 128)")
    _draft_tokenizer_arg(g, mode="--explain names the mode")
    g.add_argument("--tree", type=tree_shape, default=None, metavar="B,D,N",
                   help="draft a token tree instead of a chain: top-B per node, D levels, N nodes (a draft model "
                   "or heads; heads default to 3,3,8); -k is then ignored")
    g.add_argument("-k", "--k", type=_draft_length, default=None, dest="k",
                   help="draft tokens per step, or 'auto' (chosen per step from the measured acceptance and "
                   "costs; seeded sampling is then not reproducible) (default: generate()'s: 'auto', or 4 with "
                   "--seed at temperature > 0, with --tp, and where CUDA graphs capture the steps)")
    _sampling_args(g, temperature=0.0)
    g.add_argument("--eos-token-id", type=int, action="append", default=None,
                   help="stop a row at this token (repeatable; default: the target's EOS)")
    g.add_argument("--no-eos", action="store_true", help="do not stop at EOS")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); excluded from the text")
    _processing_args(g)
    g.add_argument("--no-stream", action="store_true", help="print each prompt's text at the end instead of streaming")
    g.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else: the "
                   "stats' fields (strict: null for what was not measured) with each prompt's \"text\" and "
                   "\"token_ids\" (nothing is streamed; the summary on stderr is left out)")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="shard --target over N ranks with tensor parallelism: run under "
                   "torchrun --nproc_per_node=N -m specdec_ext generate --tp N ... (rank 0 prints; docs/multi-gpu.md)")
    g.add_argument("--tp-check", default=None, choices=TP_CHECK_CHOICES,
                   help="with --tp: broadcast rank 0's proposals and verdicts (default), verify that the ranks "
                   "agree and fail otherwise, or trust that they do")
    g.add_argument("--explain", action="store_true",
                   help="print the decode plan first: one line per choice (drafter, k, runners, CUDA graphs, "
                   "cache) and why")
    _report_args(g, "acceptance by draft position and tokens per pass against the cost model")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="specdec", description="Lossless speculative decoding for Hugging Face models: a small draft "
        "proposes k tokens, the target verifies them in one pass, and the output is distributed exactly as "
        "sampling from the target.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"specdec_ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,audit,bench,demo,serve,train-eagle}")

    _generate_parser(sub)

    a = sub.add_parser("audit", help="check losslessness on your pair and where speculation breaks even",
                       description="For the first --positions generated tokens, compare speculative and plain "
                       "sampling (chi-square, total variation, sample sizes) and print a verdict; then a "
                       "break-even report: measured acceptance, draft cost c, verify cost v, predicted and "
                       "measured speedup for each k.")
    a.add_argument("prompts", nargs="*", help="prompt texts (default: two short code prompts)")
    _model_args(a, draft_help=AUDIT_DRAFT_HELP)
    _sampling_args(a, temperature=1.0, seed="0, so that a verdict is reproducible",
                   greedy="> 0: greedy decoding has no distribution to test (its tokens are checked against plain "
                   "greedy's token for token instead)")
    _draft_tokenizer_arg(a, mode="the audit samples, so it checks the shared-tokens mode")
    a.add_argument("--positions", type=at_least(1), default=3, help="generated positions compared (default: 3)")
    a.add_argument("--samples", type=at_least(2), default=1000,
                   help="samples per prompt of each sampler, speculative and plain (default: 1000; too few to fill "
                   "two categories of the chi-square test give the verdict INCONCLUSIVE)")
    a.add_argument("--ks", type=int_list, default=list(range(1, 9)), help="draft lengths of the break-even report (default: 1..8)")
    a.add_argument("--bench-tokens", type=at_least(1), default=48, help="new tokens per timed break-even run (default: 48)")
    a.add_argument("--alpha", type=probability, default=1e-3, help="family-wise significance level (default: 0.001)")
    a.add_argument("--max-prompts", type=at_least(1), default=2, help="prompts used (default: 2)")
    a.add_argument("--no-break-even", action="store_true", help="skip the timed break-even report")
    _report_args(a, "the TV per position next to its noise floor and the predicted vs measured speedup per k")

    b = sub.add_parser("bench", help="benchmark against HF plain, assisted and prompt-lookup generation",
                       description="HF plain greedy generate, HF assisted "
                       "generation, HF prompt lookup and ours at several k, side by side (tokens/s, speedup, "
                       "tokens per target pass, identical to plain greedy?). Run `specdec bench --help` for "
                       "its flags.", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (specdec bench --help)")

    d = sub.add_parser("demo", help="complete held-out code prompts with the bundled pair, next to plain decoding",
                       description="Complete a few held-out code prompts (the first lines of Python files the "
                       "bundled pair was not trained on) with speculative decoding and print each text with "
                       "tokens/s, speedup over plain decoding of the same target, and tokens per target pass.")
    _model_args(d, threads=DEMO_THREADS, draft_help=DEMO_DRAFT_HELP)
    d.add_argument("--files", type=at_least(1), default=DEMO_FILES, help=f"held-out files to complete (default: {DEMO_FILES})")
    d.add_argument("--lines", type=at_least(1), default=DEMO_PROMPT_LINES,
                   help=f"lines of each file used as the prompt (default: {DEMO_PROMPT_LINES})")
    d.add_argument("--max-new-tokens", type=at_least(1), default=DEMO_NEW_TOKENS,
                   help=f"new tokens per prompt (default: {DEMO_NEW_TOKENS})")
    d.add_argument("-k", "--k", type=_draft_length, default=None, dest="k",
                   help="draft tokens per step, or 'auto' (default: generate()'s, 'auto' on the CPU)")
    d.add_argument("--dtype", default=BUNDLED_PAIR_DTYPE, choices=["bfloat16", "float32"],
                   help=f"dtype of the models (default: {BUNDLED_PAIR_DTYPE}, the bundled pair's stored dtype: each "
                   "pass reads half the bytes of float32)")
    _serve_parser(sub)
    eagle_command.add_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    from .serve import DEFAULT_MAX_QUEUE, DEFAULT_MAX_ROWS, DEFAULT_SHUTDOWN_GRACE_S

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                       description="Serve the pair over HTTP with the OpenAI API (POST /v1/completions, "
                       "/v1/chat/completions, streaming or not; GET /v1/models, /health, /metrics). Requests join "
                       "and leave the running batch between decode steps; each keeps its own sampling parameters, "
                       "seed and stop checks, so a seeded request returns the same tokens whatever else runs. "
                       "Needs the [serve] extra (FastAPI, uvicorn).")
    _model_args(s, draft_help=SERVE_DRAFT_HELP)
    _draft_tokenizer_arg(s, mode="the start-up line then says drafter cross-tokenizer")
    s.add_argument("--device", default=None,
                   help="where the models run: cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu); "
                   "on CUDA with a draft model, an EAGLE-3 head or none the decode steps are captured in CUDA graphs")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help=f"dtype of the target and draft model: auto is {BUNDLED_PAIR_DTYPE} for the bundled pair (its "
                   "stored dtype: each pass reads half the bytes of float32) and the loaded dtype for a --target "
                   "(default: auto); an EAGLE-3 head keeps its float32 weights (its CPU kernels read bf16 copies)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="port to bind; 0: a free port the system chooses, which uvicorn names at --log-level info "
                   "(default: 8000)")
    s.add_argument("--model-name", default=None,
                   help="the model id clients ask for (default: the target directory's name, or "
                   f"{BUNDLED_MODEL_NAME!r} for the bundled pair)")
    s.add_argument("-k", "--k", type=at_least(1), default=None, dest="k",
                   help="draft tokens per step, fixed (default: by load: each step drafts the k that maximises the "
                   "measured tokens/s at the running batch width, 0 where speculation does not pay; seeded "
                   "requests draft a fixed k so that they reproduce)")
    s.add_argument("--prefill-chunk", type=at_least(0), default=None, dest="prefill_chunk",
                   help="prompt tokens prefilled per decode step for joining requests, so running rows keep "
                   "emitting while a long prompt joins; 0 prefills whole prompts before the next step (default: "
                   "256 where the target runner can, lean or recompute)")
    s.add_argument("--no-calibrate", action="store_false", dest="calibrate",
                   help="skip the start-up request that times every draft length before the server listens (with "
                   "k by load: without it the first clients' steps measure the costs)")
    s.add_argument("--tpot-slo-ms", type=positive, default=None, dest="tpot_slo_ms",
                   help="a target time per output token: each step's prefill chunk is cut to what the target "
                   "leaves after the decode step, and a waiting request joins only while the batch it would make "
                   "is measured to meet it; misses are counted in /metrics (default: no target)")
    s.add_argument("--max-rows", type=at_least(1), default=DEFAULT_MAX_ROWS,
                   help=f"rows that decode at once (slots; default: {DEFAULT_MAX_ROWS})")
    s.add_argument("--max-queue", type=at_least(0), default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait for a row; more get 429 with Retry-After (default: {DEFAULT_MAX_QUEUE})")
    s.add_argument("--max-seq-len", type=at_least(1), default=None,
                   help="positions per row: prompt + max_tokens + two steps of drafts (default: the models' "
                   "max_position_embeddings)")
    s.add_argument("--cache-tokens", type=at_least(1), default=None,
                   help="with the paged runner: positions in the target's page pool shared by the rows (default: "
                   "max-rows x max-seq-len); a request that does not fit waits")
    s.add_argument("--shutdown-grace", type=non_negative, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="seconds running requests get to finish after SIGTERM before they are aborted "
                   f"(default: {DEFAULT_SHUTDOWN_GRACE_S:g})")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")


BUNDLED_MODEL_NAME = "specdec-default-pair"


# ---------------------------------------------------------------------------------------- commands
def _set_threads(threads: Optional[int]) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


BUNDLED_DRAFT_DIRECTORIES = {"heads": "a heads directory trained for it (tools/train_heads.py)",
                             "eagle": "an EAGLE-3 head directory trained for it (specdec train-eagle --target it)"}


def _pair_args(args):
    if args.draft in ("ngram", "heads", "eagle"):  # no draft model (the target defaults to the bundled one)
        if args.draft in BUNDLED_DRAFT_DIRECTORIES and args.target is not None:
            from .models import is_bundled_target
            if not is_bundled_target(args.target):
                raise ValueError(f"--draft {args.draft} is the bundled target's, and --target {args.target} is another "
                                 f"model: give --draft {BUNDLED_DRAFT_DIRECTORIES[args.draft]}")
        return args.target, args.draft
    if _is_heads_directory(args.draft):
        if args.target is None:
            raise SystemExit(f"specdec {args.command}: error: --draft {args.draft}: a heads directory needs the "
                             "--target it was trained for (--draft heads uses the bundled target's heads)")
        from .heads import load_heads
        return args.target, load_heads(args.draft)
    if args.target is None and args.draft is not None:
        from .eagle.spec import is_eagle_draft
        if is_eagle_draft(args.draft):  # a head trained for the bundled target (specdec train-eagle --out DIR)
            return None, args.draft
    if (args.target is None) != (args.draft is None):
        raise SystemExit(f"specdec {args.command}: error: give --target and --draft together (or neither, for the "
                         "bundled pair; an EAGLE-3 head directory alone drafts for the bundled target)")
    return args.target, args.draft


def _is_heads_directory(draft: Optional[str]) -> bool:
    """Whether --draft names a directory of Medusa-style heads (tools/train_heads.py)."""
    return draft is not None and os.path.isfile(os.path.join(draft, "heads.safetensors"))


def cmd_generate(args) -> int:
    from .generate import generate

    prompts: List[str] = list(args.prompts) + list(args.prompt_flags)
    for path in args.prompt_file:
        if path == "-":
            if sys.stdin is None:  # (started with standard input closed)
                raise SystemExit("specdec generate: error: --prompt-file -: standard input is closed")
            prompts.append(sys.stdin.read())
            continue
        prompts.append(read_text_option("--prompt-file", path))
    if not prompts:
        raise SystemExit("specdec generate: error: give at least one prompt (positional, --prompt or --prompt-file)")
    _check_ignored_options(args)
    target, draft = _pair_args(args)
    eos = False if args.no_eos else args.eos_token_id
    kw = dict(max_new_tokens=args.max_new_tokens, k=args.k, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, eos_token_id=eos, stop=args.stop or None, runner=args.runner,
              draft_tree=args.tree, explain=args.explain)
    if args.draft_tokenizer is not None:
        kw["draft_tokenizer"] = _load_tokenizer_arg(args.draft_tokenizer)
    kw.update(_processing_kwargs(args))
    check_plot_option("generate", args.plot)  # (before any work, --tp's too)
    if args.tp is not None:
        _generate_tensor_parallel(args, prompts, target, draft, kw)
    streamed = not (args.no_stream or args.json)  # (--json: stdout is one JSON document)
    # streamed to a terminal, the text is its own progress (a bar next to it would tear it)
    show_bar = progress_wanted(args.quiet) and (not streamed or not sys.stdout.isatty())
    if not streamed and not show_bar:
        result = generate(prompts, target, draft, **kw)
    else:
        with progress_bar(args.max_new_tokens * len(prompts), "generating", unit="token", show=show_bar,
                          delay_s=GENERATE_PROGRESS_DELAY_S, leave=False) as bar:
            result = _consume(generate(prompts, target, draft, stream=True, **kw), bar, echo=streamed,
                              rows=len(prompts))
    _print_result(result, prompts, args.json, streamed)
    if args.plot:
        pair = f"target / draft: {args.target or 'bundled'} / {args.draft or 'bundled'}"
        write_plot("generate", lambda: result.stats.plot(args.plot, label=pair))
    return 0


TP_CHECK_CHOICES = ("broadcast", "verify", "off")  # --tp-check (the first: the default with --tp)
NO_DRAFT_MODEL = ("none", "ngram", "heads", "eagle")  # --draft values with no draft model (and no tokenizer of one)


def _check_ignored_options(args) -> None:
    """ValueError naming an option the command would run without using: given, it was meant to change something."""
    draft = getattr(args, "draft", None)
    if getattr(args, "draft_tokenizer", None) is not None and draft in NO_DRAFT_MODEL:
        raise ValueError(f"--draft-tokenizer is the tokenizer of a draft model, and --draft {draft} has none: "
                         "drop one of them")
    if getattr(args, "no_eos", False) and getattr(args, "eos_token_id", None) is not None:
        raise ValueError("--eos-token-id and --no-eos contradict each other: give one of them")
    if getattr(args, "tp_check", None) is not None and getattr(args, "tp", None) is None:
        raise ValueError("--tp-check applies to a tensor-parallel run: give --tp N too, or drop it")
    if draft == "none" and getattr(args, "k", None) is not None:
        raise ValueError("-k is a draft length, and --draft none drafts nothing: drop one of them")


def _processing_args(parser) -> None:
    """generate()'s logits processors and structured output (specdec_ext/processing.py, grammar.py)."""
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this x the top token's "
                        "probability after temperature (default: 0, off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: 0)")
    low, high = REPETITION_PENALTY_RANGE
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help=f"HF's: a seen token's logit is divided by it where positive, multiplied where not; in "
                        f"[{low:g}, {high:g}] (default: 1, off)")
    parser.add_argument("--logit-bias", default=None, metavar="JSON",
                        help='token id -> bias in [-100, 100], as JSON: \'{"11": 2.5, "25": -100}\'')
    parser.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                        help="the output is JSON matching this schema (a file, or the schema's JSON text: a value "
                        "that ends in .json, or holds a / and does not start with { or [, is a file)")
    parser.add_argument("--regex", default=None, help="the output matches this regular expression")
    parser.add_argument("--grammar", default=None, metavar="FILE", help="the output follows this Lark grammar (a file)")


def _processing_kwargs(args) -> dict:
    """The processors' flags as generate() keywords (only those set); a bad JSON value exits naming the flag."""
    kw = {}
    for name, off in (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                      ("repetition_penalty", 1.0)):
        if getattr(args, name) != off:
            kw[name] = getattr(args, name)
    if args.logit_bias is not None:
        kw["logit_bias"] = _json_flag("--logit-bias", args.logit_bias)
    if args.json_schema is not None:
        text = args.json_schema
        if os.path.isfile(text) or _names_a_file(text):
            kw["json_schema"] = _json_flag("--json-schema", read_text_option("--json-schema", text),
                                           f": the file {text} is not valid JSON")
        else:
            kw["json_schema"] = _json_flag("--json-schema", text, " is not valid JSON" if text.lstrip()[:1] in "{["
                                           else " is neither a file nor valid JSON")
    if args.regex is not None:
        kw["regex"] = args.regex
    if args.grammar is not None:
        kw["grammar"] = read_text_option("--grammar", args.grammar)
    return kw


def _names_a_file(value: str) -> bool:
    """Whether a FILE|JSON value that is no file here was meant as one: it ends in .json, or holds a path
    separator, and does not start as a JSON object or array does."""
    if value.lstrip().startswith(("{", "[")):
        return False
    return value.endswith(".json") or "/" in value or os.sep in value


def _json_flag(flag: str, text: str, problem: str = " is not valid JSON"):
    """``text`` parsed as JSON; else exit with the flag, the ``problem`` and where the parser stopped."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SystemExit(f"specdec generate: error: {flag}{problem}: {error}") from None


def _draft_tokenizer_arg(parser, mode: str) -> None:
    """--draft-tokenizer; ``mode`` says where the command names the cross-tokenizer mode it runs."""
    parser.add_argument("--draft-tokenizer", metavar="PATH",
                        help="the draft's tokenizer, when it differs from the target's (default: the one next to "
                        "--draft): a draft with another tokenizer drafts through text when greedy and from the "
                        f"tokens both vocabularies share when sampling, still lossless ({mode})")


def _load_tokenizer_arg(path: str):
    """--draft-tokenizer PATH, loaded offline (exits with the reason when it cannot be)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"--draft-tokenizer {path}: could not load a tokenizer from it (offline, local files "
                         f"only): {error}") from error


def _generate_tensor_parallel(args, prompts, target, draft, kw) -> NoReturn:
    """``generate --tp N`` under torchrun: every rank runs the loop; rank 0 prints. A rank that fails
    prints its error and exits 1, and torchrun then ends the other ranks (the process group's timeout,
    SPECDEC_TP_TIMEOUT_S, bounds any wait in between). Each rank leaves through ``distributed.exit_rank``."""
    from . import distributed
    from .generate import generate

    if target is None:
        raise SystemExit("specdec generate --tp: give --target PATH (the model to shard) and --draft")
    try:
        result = generate(prompts, target, draft, tp_size=args.tp, tp_check=args.tp_check or TP_CHECK_CHOICES[0],
                          **kw)
    except Exception as error:
        print(f"specdec generate --tp {args.tp}: rank {distributed.rank()} failed: {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)
        distributed.exit_rank(1)
    if distributed.rank() == 0:
        _print_result(result, prompts, args.json, streamed=False)
        if args.plot:  # (it was dropped: rank 0 draws what every rank ran)
            label = f"target / draft: {args.target} / {args.draft or 'bundled'}, tp {args.tp}"
            write_plot("generate", lambda: result.stats.plot(args.plot, label=label))
    distributed.destroy()
    distributed.exit_rank(0)



def _print_result(result, prompts: List[str], as_json: bool, streamed: bool) -> None:
    """generate's output: with ``as_json`` one JSON document on stdout (the stats' fields, each prompt's
    text and token ids); else each prompt's text (unless it was ``streamed``) and the stats' summary on stderr."""
    texts = result.text or [str(t) for t in result.token_ids]
    if as_json:
        print(_json({**result.stats.as_dict(), "prompts": list(prompts), "text": list(texts),
                     "token_ids": [list(map(int, t)) for t in result.token_ids]}))
        return
    if not streamed:
        for i, text in enumerate(texts):
            print(f"--- [{i}] {prompts[i]!r}\n{text}")
    print("\n" + result.stats.summary(), file=sys.stderr)


def _consume(stream, bar, *, echo: bool, rows: int):
    """Run a generation stream to its end, advancing ``bar`` by the tokens of each piece and printing the
    pieces when ``echo``; -> its GenerationResult. Several prompts are shown one after the other, each under
    one header: the first prompt's pieces as they come, the others' when the generation ends (interleaved,
    the rows' pieces made neither text readable)."""
    held: Dict[int, List[str]] = {index: [] for index in range(1, rows)}
    if echo and rows > 1:
        print("--- [0] ", end="")
    for piece in stream:
        bar.update(len(piece.token_ids))
        if echo and piece.index > 0:
            held[piece.index].append(str(piece))
        elif echo:
            print(piece, end="", flush=True)
    if echo:
        for index in range(1, rows):
            print(f"\n--- [{index}] " + "".join(held[index]), end="")
        print()
    return stream.result


def cmd_audit(args) -> int:
    from .audit import audit

    if args.draft in ("ngram", "heads") or _is_heads_directory(args.draft):
        raise SystemExit(f"specdec audit: error: --draft {args.draft}: the audit runs a draft model or an EAGLE-3 "
                         "head, not lookup drafting or heads")
    target, draft = _pair_args(args)
    check_plot_option("audit", args.plot)
    ks = tuple(args.ks)
    report = audit(target, draft, args.prompts or DEFAULT_AUDIT_PROMPTS, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, positions=args.positions, samples=args.samples, ks=ks,
                   bench_tokens=args.bench_tokens, alpha=args.alpha, seed=0 if args.seed is None else args.seed, runner=args.runner,
                   max_prompts=args.max_prompts, run_break_even=not args.no_break_even,
                   progress=progress_wanted(args.quiet),
                   draft_tokenizer=None if args.draft_tokenizer is None else _load_tokenizer_arg(args.draft_tokenizer))
    if args.plot:
        write_plot("audit", lambda: report.plot(args.plot))
    return 0 if report.passed else 1


def cmd_bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args.bench_args)


def _draft_shape(stats, tree: bool) -> str:
    """How a run drafted, for the demo's summary line: "k=4", "k=auto (mean k 5.2)" or "8-node tree"."""
    if tree:
        return f"{stats.k}-node tree"
    if stats.adaptive is not None:
        return f"k=auto (mean k {format_measured(stats.adaptive['mean_row_k'], '{:.1f}')})"
    return f"k={stats.k}"


def _in_dtype(models, dtype_name: str):
    """``models`` with their weights in ``dtype_name``: copies where the dtype differs, so that the bundled
    pair that load_models caches for the process keeps its own dtype. An EAGLE-3 head is left as it is: its
    CPU kernels run only over float32 master weights (they read bf16 copies, Eagle3Model.kernel_dtype)."""
    import torch

    from .models import cast_model

    dtype = getattr(torch, dtype_name)

    def cast(module):  # as from_pretrained(dtype=...) loads: the rotary frequencies (buffers) stay float32
        return None if module is None else cast_model(module, dtype, copy=True)

    draft = models.draft if models.drafter == "eagle" else cast(models.draft)
    return dataclasses.replace(models, target=cast(models.target), draft=draft, heads=cast(models.heads))


def _serve_dtype(args) -> Optional[str]:
    """The dtype ``specdec serve`` casts the models to (None: as loaded): ``--dtype``, where auto is the bundled
    pair's stored dtype for the bundled target."""
    if args.dtype != "auto":
        return args.dtype
    return BUNDLED_PAIR_DTYPE if args.target is None else None


def cmd_demo(args) -> int:
    import torch

    from .generate import generate, plain_generate
    from .models import load_models

    target_spec, draft_spec = _pair_args(args)
    models = _in_dtype(load_models(target_spec, draft_spec), args.dtype)  # loaded once, then passed as objects
    target, tokenizer = models.target, models.tokenizer
    draft = {"model": models.draft, "heads": models.heads, "ngram": "ngram", "eagle": models.draft}.get(models.drafter)
    if draft is None:
        raise ValueError(f"--draft {args.draft}: the demo runs a draft model sharing the target's vocabulary, 'ngram', "
                         f"'heads' or 'eagle', not a {models.drafter} draft: use specdec generate")
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=False, runner=args.runner, tokenizer=tokenizer)
    warm_up = {**kw, "max_new_tokens": 4}
    plan = generate(["x = 1"], target, draft, k=args.k, **warm_up).plan
    plain_generate(["x = 1"], target, **warm_up)
    print(f"models in {args.dtype}, {torch.get_num_threads()} thread(s); target runner "
          f"{dict(plan.reasons)['target runner']}\n")
    for name, prompt in heldout_prompts(args.files, args.lines):
        plain = plain_generate([prompt], target, **kw)
        spec = generate([prompt], target, draft, k=args.k, **kw)
        same = "identical to plain greedy" if spec.token_ids == plain.token_ids else "DIFFERS from plain greedy"
        print(f"=== {name} (first {args.lines} lines) ===")
        highlight = sys.stdout.isatty() and not os.environ.get("NO_COLOR")  # (no-color.org)
        print(prompt + "\033[1m" + spec.text[0] + "\033[0m" if highlight else prompt + spec.text[0])
        s, p = spec.stats, plain.stats
        how = _draft_shape(spec.stats, tree=spec.plan.is_tree)
        per_pass, acceptance = format_measured(s.tokens_per_pass, "{:.2f}"), format_measured(s.acceptance_rate, "{:.2f}")
        print(f"--- speculative {how}: {s.tokens_per_second:.1f} tok/s, plain: {p.tokens_per_second:.1f} tok/s, "
              f"speedup {s.tokens_per_second / p.tokens_per_second:.2f}x, {per_pass} tokens per target pass, "
              f"acceptance {acceptance}; {same}\n")
    return 0


def cmd_serve(args) -> int:
    from .serve import ServeDependencyError, require_serve_dependencies

    try:
        require_serve_dependencies()
    except ServeDependencyError as error:
        raise SystemExit(str(error)) from None
    from .models import default_device, load_models
    from .serve.build import EngineOptions, build_engine, eos_token_ids
    from .serve.app import create_app
    from .serve.server import run_server

    _check_served_draft(args.draft)
    _check_ignored_options(args)
    if args.draft == "none":
        models = load_models(args.target, plain=True)
    else:
        draft_tokenizer = None if args.draft_tokenizer is None else _load_tokenizer_arg(args.draft_tokenizer)
        models = load_models(*_pair_args(args), draft_tokenizer=draft_tokenizer)
    dtype = _serve_dtype(args)
    if dtype is not None:
        models = _in_dtype(models, dtype)
    try:
        models.to(args.device or default_device())
    except ValueError as error:
        raise SystemExit(_prefixed("specdec serve", error)) from None
    options = EngineOptions(max_rows=args.max_rows, max_queue=args.max_queue, k=args.k, max_seq_len=args.max_seq_len,
                            cache_tokens=args.cache_tokens, runner=args.runner, prefill_chunk=args.prefill_chunk,
                            tpot_slo_ms=args.tpot_slo_ms)
    try:
        engine = build_engine(models, options)
        name = args.model_name or (os.path.basename(os.path.normpath(args.target)) if args.target else BUNDLED_MODEL_NAME)
        app = create_app(engine, models.tokenizer, model_name=name,
                         eos_token_ids=eos_token_ids(models.target, models.tokenizer))
    except ValueError as error:
        raise SystemExit(_prefixed("specdec serve", error)) from None
    if args.calibrate:
        steps = engine.calibrate(models.tokenizer.encode(SERVE_CALIBRATION_TEXT))
        engine.description += f"; step costs calibrated in {steps} steps" if steps else ""
    running_dtype = str(next(models.target.parameters()).dtype).replace("torch.", "")
    where = (f"http://{args.host}:{args.port}/v1" if args.port else
             f"http://{args.host}:PORT/v1, a free port the system chooses (uvicorn names it at --log-level info)")
    print(f"specdec serve: {name!r} on {where} (models in {running_dtype}; {engine.description})", file=sys.stderr)
    return run_server(app, engine, host=args.host, port=args.port, shutdown_grace_s=args.shutdown_grace,
                      log_level=args.log_level)


SERVED_DRAFTS = ("a draft model sharing the target's tokenizer, a draft model with another tokenizer "
                 "(--draft-tokenizer), 'ngram', 'eagle' or an EAGLE-3 head directory (chains), or 'none'")


def _check_served_draft(draft: Optional[str]) -> None:
    """``specdec serve --draft``: the heads drafter (its bundled heads or a heads directory) is refused before
    any model loads, naming what is served."""
    if draft == "heads" or _is_heads_directory(draft):
        raise SystemExit(f"specdec serve: error: --draft {draft}: Medusa-style heads draft token trees, which "
                         f"continuous batching does not run; serve {SERVED_DRAFTS}")


def _prefixed(prefix: str, error: BaseException) -> str:
    """``error``'s message after ``prefix: ``, once (a library message may already start with the command)."""
    message = _one_line(str(error))
    return message if message.startswith(prefix) else f"{prefix}: {message}"


def _without_command(command: str, message: str) -> str:
    """``message`` as one line, less a leading "audit: " or "specdec audit: " (the library's own prefix, which the
    command's line already has)."""
    message = _one_line(message)
    for prefix in (f"specdec {command}: ", f"{command}: "):
        if command and message.startswith(prefix):
            return message[len(prefix):]
    return message


def _one_line(message: str) -> str:
    """A message of several lines (transformers' errors have some) as one."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


COMMANDS = {"generate": cmd_generate, "audit": cmd_audit, "bench": cmd_bench, "demo": cmd_demo, "serve": cmd_serve,
            "train-eagle": eagle_command.run}


# What a command's bad input raises (the library's checks name the argument): a line, not a traceback
# (SPECDEC_TRACEBACK=1 shows it). Other exceptions (a KeyError, an IndexError...) are bugs and keep theirs.
USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError)
# Exit statuses: 0 done; 1 bad input found after parsing (and audit's FAIL or INCONCLUSIVE); 2 a usage error
# (arg_types.USAGE_ERROR_STATUS, argparse's); 130 Ctrl-C and 141 a closed stdout (128 + SIGINT, SIGPIPE: what
# a shell reports for a program those signals end, as `yes | head` ends `yes`)
INTERRUPTED_STATUS = 130
CLOSED_PIPE_STATUS = 141


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    try:
        with _one_line_warnings(command):
            status = _run(argv)
            if sys.stdout is not None:  # (None: started with standard output closed, whose prints went nowhere)
                sys.stdout.flush()  # (here, a reader gone before the last bytes is a closed pipe, not a message at exit)
            return status
    except KeyboardInterrupt:
        print(f"specdec {command}: interrupted".replace("  ", " "), file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:  # the reader went away (| head): nothing more to say, and nowhere to say it
        try:  # (so that flushing stdout at exit does not raise again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # (a stdout without a file descriptor)
            pass
        return CLOSED_PIPE_STATUS
    except USER_ERRORS as error:
        if os.environ.get("SPECDEC_TRACEBACK") == "1":
            raise
        print(f"specdec {command}: error: {_without_command(command, str(error))}".replace("  ", " "), file=sys.stderr)
        return 1


def _bench_args(argv: List[str]) -> argparse.Namespace:
    """``specdec bench``'s arguments, parsed by its own parser (bench/compare.py), whose usage error is printed
    here as one line as every command's (arg_types.OneLineParser) instead of argparse's usage block."""
    from .bench.compare import parse_args

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = parse_args(argv)
    except SystemExit as exit_:
        said = captured.getvalue().strip().splitlines()
        if exit_.code != USAGE_ERROR_STATUS or not said:
            sys.stderr.write(captured.getvalue())
            raise
        prog, _, message = said[-1].partition(": error: ")  # (argparse's last line: "specdec bench: error: ...")
        if message.endswith(" --help lists the options)"):
            print(said[-1], file=sys.stderr)
        else:
            print(usage_error_line(prog, message), file=sys.stderr)
        raise
    sys.stderr.write(captured.getvalue())
    return args


DRAFT_KEYWORDS = ("ngram", "heads", "eagle")  # --draft values that name no directory (serve adds "none")
MODEL_PATH_OPTIONS = (("--target", "target"), ("--draft", "draft"), ("--draft-tokenizer", "draft_tokenizer"))


def _check_model_paths(args, drafts) -> None:
    """ValueError naming the option for a model or tokenizer option (--target, --draft, --draft-tokenizer) that
    names no directory here and no model in the Hugging Face cache: the models load offline, and the loader said
    "Repo id must use alphanumeric chars" of a missing path, never that it does not exist."""
    from .models import missing_model_directory

    for option, name in MODEL_PATH_OPTIONS:
        value = getattr(args, name, None)
        if value is None or (name == "draft" and value in drafts):
            continue
        problem = missing_model_directory(value)
        if problem:
            raise ValueError(f"{option}: {problem}")


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """A warning on the command line as one line, "specdec CMD: warning: ..." (Python's shows the file, the
    line number and the source line of the library's code that warned)."""
    def one_line(message, category, filename, lineno, line=None):
        return f"specdec {command}: warning: {message}\n".replace("  ", " ")

    saved, warnings.formatwarning = warnings.formatwarning, one_line
    try:
        yield
    finally:
        warnings.formatwarning = saved


def _run(argv: List[str]) -> int:
    if argv[:1] == ["bench"]:  # bench has its own parser (and its own --help)
        from .bench import main as bench_main

        _check_model_paths(_bench_args(argv[1:]), drafts=())
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # what the command was given (train-eagle records it)
    if args.command != "train-eagle":  # (train-eagle checks its --data before its --target: eagle/command.py)
        _check_model_paths(args, drafts=DRAFT_KEYWORDS + (("none",) if args.command == "serve" else ()))
    _set_threads(getattr(args, "threads", None))
    with hf_progress_bars_off(not progress_wanted(getattr(args, "quiet", False))):  # (a log is no terminal)
        return COMMANDS[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
