"""``specdec train-eagle``: train an EAGLE-3 head for a frozen target by self-distillation, on a CPU or a GPU.

The target continues pieces of text (``--data``: files or directories; by default, for the bundled target,
the bundled pair's training files, default_pair/corpus.py) and the head learns its distribution with the
training-time test (eagle/training.py). ``--out`` holds the head in the SafeAILab/EAGLE layout (load_eagle
and ``generate(..., draft=DIR)`` read it) and the trainer state: the same command again resumes, and more
``--steps`` continues. ``--export DIR`` also writes the head as the bundled one ships (int8, a scale per
row) with a train_summary.json.

    specdec train-eagle --out runs/eagle --steps 400 --pieces 256
    specdec train-eagle --target my-llama --data corpus/ --out runs/eagle --steps 4000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from ..arg_types import at_least, device, fraction, non_negative, positive

DEFAULTS = dict(pieces=4096, chars=400, steps=2400, draft_vocab=2048, prompt_tokens=32, new_tokens=64,
                ttt_steps=3, batch=8, lr=1e-3, warmup_steps=50, min_lr_ratio=0.1, save_every=100, seed=0)


def add_parser(sub) -> None:
    """The ``train-eagle`` subcommand of ``specdec`` (cli.py)."""
    t = sub.add_parser("train-eagle", help="train an EAGLE-3 head for a target by self-distillation",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--out", required=True, help="where the head and the trainer state go (resumed when present)")
    t.add_argument("--target", help="the target model directory (default: the bundled target)")
    t.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files or directories the target continues (default, for the bundled target: the "
                   "bundled pair's training files; needed with --target)")
    d = DEFAULTS
    t.add_argument("--steps", type=at_least(1), default=d["steps"], help=f"optimizer steps in all (default: {d['steps']})")
    t.add_argument("--pieces", type=at_least(1), default=d["pieces"], help=f"text pieces continued (default: {d['pieces']})")
    t.add_argument("--chars", type=at_least(1), default=d["chars"], help=f"characters per piece (default: {d['chars']})")
    t.add_argument("--prompt-tokens", type=at_least(1), default=d["prompt_tokens"],
                   help=f"tokens of each piece kept as the prompt (default: {d['prompt_tokens']})")
    t.add_argument("--new-tokens", type=at_least(1), default=d["new_tokens"],
                   help=f"tokens the target continues each prompt with (default: {d['new_tokens']})")
    t.add_argument("--temperature", type=non_negative, default=0.0, help="of the continuations (default: 0, greedy)")
    t.add_argument("--draft-vocab", type=at_least(1), default=d["draft_vocab"],
                   help=f"the head's vocabulary: the most frequent tokens of the continuations (default: {d['draft_vocab']})")
    t.add_argument("--layer-ids", help="the target layers whose inputs the head fuses, e.g. 1,3,5 "
                   "(default: 2, L // 2, L - 3)")
    t.add_argument("--intermediate-size", type=at_least(1), help="the head's MLP width (default: the target's)")
    t.add_argument("--ttt-steps", type=at_least(1), default=d["ttt_steps"],
                   help=f"draft steps unrolled in training (default: {d['ttt_steps']})")
    t.add_argument("--batch", type=at_least(1), default=d["batch"], help=f"sequences per step (default: {d['batch']})")
    t.add_argument("--lr", type=positive, default=d["lr"], help=f"peak learning rate (default: {d['lr']})")
    t.add_argument("--warmup-steps", type=at_least(0), default=d["warmup_steps"],
                   help=f"linear warm-up of the learning rate (default: {d['warmup_steps']})")
    t.add_argument("--min-lr-ratio", type=fraction, default=d["min_lr_ratio"],
                   help=f"the cosine schedule's floor at the last step, a fraction of --lr (default: {d['min_lr_ratio']})")
    t.add_argument("--save-every", type=at_least(1), default=d["save_every"],
                   help=f"steps between checkpoints (default: {d['save_every']})")
    t.add_argument("--seed", type=int, default=d["seed"], help=f"pieces, initialisation and batches (default: {d['seed']})")
    t.add_argument("--threads", type=at_least(1), default=None, help="torch intra-op threads (default: torch's)")
    t.add_argument("--device", type=device, default=None, help="where the target and the head run (default: cuda if torch sees it)")
    t.add_argument("--export", metavar="DIR", help="also write the head as the bundled one ships (int8, a scale "
                   "per row) and a train_summary.json to DIR")
    t.add_argument("--quiet", action="store_true", help="no progress bar")


def _layer_ids(text: Optional[str]):
    if not text:
        return None
    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise SystemExit(f"specdec train-eagle: --layer-ids takes comma-separated integers, not {text!r}") from None


def _load_target(args, device: str):
    import transformers

    from ..default_pair import load_default_pair

    if args.target is None:
        target, _, tokenizer = load_default_pair(device=device)
        return target, tokenizer
    try:  # (offline, as generate's models: a missing directory is not a Hub download of 5 retries)
        target = transformers.AutoModelForCausalLM.from_pretrained(args.target, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"specdec train-eagle: --target {args.target}: could not load a causal LM and its "
                         f"tokenizer from it (offline, local files only): {first}") from None
    return target.to(device).eval(), tokenizer


EXPORT_SUMMARY = "train_summary.json"  # what marks an --export directory


def _check_out_dirs(out: str, export: Optional[str]) -> None:
    """SystemExit unless --out is new, empty or a train-eagle run, and --export new, empty or an earlier export
    of its own: both write config.json and model weights, which overwrote a model directory (the target's own,
    given as --out) without a word; --export in --out would replace the run's fp32 head by its int8 one."""
    from .training import DATA, TRAINER_STATE  # (a run's files: resumed, never overwritten)

    _check_writable_dir("--out", out)
    if _holds_other_files(out, (TRAINER_STATE, DATA)):
        raise SystemExit(f"specdec train-eagle: --out {out} is not empty and holds no train-eagle run (no "
                         f"{TRAINER_STATE} or {DATA}): give a new or empty directory (it would overwrite what is there)")
    if export is None:
        return
    _check_writable_dir("--export", export)
    if os.path.abspath(export) == os.path.abspath(out):
        raise SystemExit("specdec train-eagle: --export must be another directory than --out (its int8 head would "
                         "replace the run's fp32 one)")
    if _holds_other_files(export, (EXPORT_SUMMARY,)):
        raise SystemExit(f"specdec train-eagle: --export {export} is not empty and holds no earlier export (no "
                         f"{EXPORT_SUMMARY}): give a new or empty directory (it would overwrite what is there)")


def _holds_other_files(path: str, markers) -> bool:
    """Whether ``path`` is a non-empty directory with none of ``markers`` in it."""
    return (os.path.isdir(path) and bool(os.listdir(path))
            and not any(os.path.exists(os.path.join(path, m)) for m in markers))


def _check_writable_dir(option: str, path: str) -> None:
    """SystemExit naming ``option`` unless ``path`` is a directory this process can write, or can be made one."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == os.path.abspath(path) and not os.path.isdir(existing):
        raise SystemExit(f"specdec train-eagle: {option} {path} is a file, not a directory")
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"specdec train-eagle: {option} {path}: {existing} is not a writable directory")


def export(head, out_dir: str, losses, seconds: float, argv) -> None:
    """The head as the bundled pair ships it (eagle/checkpoints.py INT8_WEIGHTS) and how it was trained
    (``argv``: the command's arguments)."""
    from .checkpoints import save_eagle

    save_eagle(head, out_dir, embed=False, int8=True)
    summary = {"command": "specdec " + " ".join(argv), "steps": len(losses), "loss_first": losses[0],
               "loss_last_100": sum(losses[-100:]) / len(losses[-100:]), "training_seconds": round(seconds),
               "parameters": sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed_tokens")),
               "draft_vocab_size": head.config.draft_vocab_size, "layer_ids": list(head.config.layer_ids or ())}
    with open(os.path.join(out_dir, EXPORT_SUMMARY), "w") as f:
        json.dump(summary, f, indent=2)


def run(args) -> int:
    from ..models import default_device
    from ..progress import progress_bar
    from .texts import read_pieces, text_files
    from .training import TrainConfig, train_eagle

    if args.target is not None and args.data is None:
        raise SystemExit("specdec train-eagle: --target needs --data (the texts it continues)")
    layer_ids = _layer_ids(args.layer_ids)
    _check_out_dirs(args.out, args.export)  # (before the training, not after it)
    try:
        files = text_files(args.data)
    except (OSError, ValueError) as error:
        raise SystemExit(f"specdec {error}") from None
    texts = read_pieces(files, args.pieces, args.chars, args.seed)
    if not texts:  # (before the target loads, not after)
        raise SystemExit(f"specdec train-eagle: --data: no file holds a piece of --chars {args.chars} characters")
    device = args.device or default_device()
    if args.target is not None:  # (a missing path: the loader would say "Repo id must be in the form ...")
        from ..models import missing_model_directory

        problem = missing_model_directory(args.target)
        if problem:
            raise SystemExit(f"specdec train-eagle: --target: {problem}")
    target, tokenizer = _load_target(args, device)
    from .checkpoints import check_layer_ids

    check_layer_ids(layer_ids, target)  # (before the training data are made: the longest part of a run)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    if args.draft_vocab > vocab:
        raise SystemExit(f"specdec train-eagle: --draft-vocab {args.draft_vocab} is more than the target's "
                         f"vocabulary of {vocab}")
    config = TrainConfig(draft_vocab_size=args.draft_vocab, prompt_tokens=args.prompt_tokens,
                         new_tokens=args.new_tokens, temperature=args.temperature, ttt_steps=args.ttt_steps,
                         batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup_steps,
                         min_lr_ratio=args.min_lr_ratio, save_every=args.save_every, seed=args.seed,
                         layer_ids=layer_ids, intermediate_size=args.intermediate_size)
    print(f"specdec train-eagle: {len(texts)} pieces, {args.steps} steps, target "
          f"{args.target or 'bundled'} on {device}, head in {args.out}", flush=True)
    started = time.time()
    with progress_bar(args.steps, "train-eagle", unit="step", show=None if not args.quiet else False) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.n = step
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update(0)

        result = train_eagle(target, tokenizer, texts, args.out, args.steps, config, on_step=on_step)
    losses = result.losses
    if result.start_step >= len(losses):
        print(f"the head in {args.out} already has {len(losses)} steps (--steps {args.steps}): nothing to do")
    else:
        print(f"trained steps {result.start_step}..{len(losses)} in {time.time() - started:.0f} s; loss "
              f"{losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} (mean of the last 10); head in {args.out}")
    if args.export:
        export(result.head, args.export, losses, result.seconds, getattr(args, "argv", sys.argv[1:]))
        print(f"exported (int8, a scale per row) to {args.export}")
    return 0
