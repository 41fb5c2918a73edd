#!/usr/bin/env python
"""Train an EAGLE-3 head (specdec_ext/eagle/) for a frozen target by self-distillation, on a CPU.

The texts: ``--texts`` (a directory of text files, or one file; each file cut into pieces of
``--chars`` characters), by default the bundled pair's training files (tools/train_default_pair.py:
*.py of the stdlib, torch and transformers as installed, the held-out files left out). The target
continues each piece's first ``--prompt-tokens`` tokens itself; the head learns its distribution over a
draft vocabulary of the ``--draft-vocab`` most frequent tokens, with the training-time test unrolled
over ``--ttt-steps`` draft steps (specdec_ext/eagle/training.py). ``--out`` holds the head in the
SafeAILab/EAGLE layout (load_eagle reads it) and the trainer state: running again resumes.

Example:
    python tools/train_eagle.py --out runs/eagle --steps 400 --pieces 256
    python -c "import specdec_ext as s; from specdec_ext.eagle import load_eagle; \
        t, _, tok = s.load_default_pair(); print(load_eagle('runs/eagle', t).config)"
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="target model dir (default: the bundled target)")
    p.add_argument("--texts", help="a text file or a directory of them (default: the bundled pair's training files)")
    p.add_argument("--pieces", type=int, default=128, help="text pieces continued by the target")
    p.add_argument("--chars", type=int, default=400, help="characters per piece")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--intermediate-size", type=int, help="the head's MLP width (default: the target's)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", metavar="DIR",
                   help="after training, also write the head to DIR in the compact int8 storage (a scale per row, "
                   "no embedding: the target's is used) with train_summary.json: how the bundled head ships")
    return p.parse_args(argv)


def export(head, out_dir: str, args, losses, seconds: float) -> None:
    """The head as the bundled pair ships it (eagle/checkpoints.py INT8_WEIGHTS) and how it was trained."""
    import json
    from specdec_ext.eagle import save_eagle
    save_eagle(head, out_dir, embed=False, int8=True)
    summary = {"command": "python tools/train_eagle.py " + " ".join(sys.argv[1:]), "steps": len(losses),
               "loss_first": losses[0], "loss_last_100": sum(losses[-100:]) / len(losses[-100:]),
               "seconds_this_run": round(seconds), "parameters": sum(p.numel() for name, p in head.named_parameters()
                                                                     if not name.startswith("embed_tokens")),
               "draft_vocab_size": head.config.draft_vocab_size, "layer_ids": list(head.config.layer_ids or ())}
    with open(os.path.join(out_dir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def read_pieces(texts, pieces: int, chars: int, seed: int):
    """``pieces`` random pieces of ``chars`` characters from the text files."""
    if texts is None:
        from train_default_pair import collect_files, is_heldout
        files = [path for name, path in collect_files() if not is_heldout(name)]
    elif os.path.isdir(texts):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(texts) for name in names)
    else:
        files = [texts]
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for path in files:
        with open(path, errors="replace") as f:
            text = f.read()
        for start in range(0, max(len(text) - chars, 0), chars * 4):
            out.append(text[start:start + chars])
            if len(out) == pieces:
                return out
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import specdec_ext
    from specdec_ext.eagle.training import TrainConfig, train_eagle
    if args.target is None:
        target, _, tokenizer = specdec_ext.load_default_pair()
    else:
        import transformers
        target = transformers.AutoModelForCausalLM.from_pretrained(args.target).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    texts = read_pieces(args.texts, args.pieces, args.chars, args.seed)
    config = TrainConfig(draft_vocab_size=args.draft_vocab, prompt_tokens=args.prompt_tokens,
                         new_tokens=args.new_tokens, temperature=args.temperature, ttt_steps=args.ttt_steps,
                         batch_size=args.batch, lr=args.lr, save_every=args.save_every, seed=args.seed,
                         intermediate_size=args.intermediate_size)
    started = time.time()
    result = train_eagle(target, tokenizer, texts, args.out, args.steps, config)
    losses = result.losses
    print(f"trained steps {result.start_step}..{len(losses)} in {time.time() - started:.0f} s; loss "
          f"{losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} (last 10); head in {args.out}")
    if args.export:
        export(result.head, args.export, args, losses, time.time() - started)
        print(f"exported (int8, a scale per row) to {args.export}")


if __name__ == "__main__":
    main()
