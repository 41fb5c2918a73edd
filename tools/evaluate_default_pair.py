#!/usr/bin/env python
"""Evaluate the default (target, draft) pair on its held-out files and print markdown tables.

Held-out files: the whole files that ``tools/train_default_pair.py`` held out (same trees, same
``sha1(name) % 100 < 2`` rule; cross-checked with ``heldout_files.txt`` when the pair dir has one).
Each file is preceded by ``<|endoftext|>``; the stream is cut into windows of 257 tokens (stride
256) and ``--max-windows`` evenly spaced windows are scored (the same true prefix for both models).

Metrics, per predicted position, averaged:
* validation loss (nats/token) and top-1 accuracy of target and draft;
* draft acceptance rate at T=1: sum_x min(p(x), q(x)) with p the target's, q the draft's softmax;
* greedy agreement: argmax q == argmax p;
* for ``--prompts`` held-out prompts (the first ``--prompt-lines`` lines of a held-out file), the
  target's plain greedy continuation (``generate(do_sample=False)``, no repetition penalty) of
  ``--new-tokens`` tokens and its distinct 4-gram ratio (distinct 4-grams / 4-grams of the
  generated tokens).

Usage:
    python tools/evaluate_default_pair.py                      # the shipped pair
    python tools/evaluate_default_pair.py --pair-dir runs/default_pair/final --json out.json
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_default_pair as tdp  # noqa: E402  (file list and held-out rule, shared)

DEFAULT_PAIR = os.path.join(os.path.dirname(HERE), "specdec_ext", "default_pair")


def load(pair_dir, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(pair_dir, "tokenizer"), local_files_only=True)
    ms = [AutoModelForCausalLM.from_pretrained(os.path.join(pair_dir, n), local_files_only=True,
                                               dtype=dtype).eval() for n in ("target", "draft")]
    return ms[0], ms[1], tok


def heldout_texts(pair_dir):
    files = [(n, p) for n, p in tdp.collect_files() if tdp.is_heldout(n)]
    listed = os.path.join(pair_dir, "heldout_files.txt")
    texts = [(n, tdp.read_text(p)) for n, p in files]
    texts = [(n, t) for n, t in texts if t is not None and t.strip()]
    if os.path.exists(listed):
        want = [l.strip() for l in open(listed) if l.strip()]
        have = [n for n, _ in texts]
        if want != have:
            print(f"WARNING: held-out files here differ from {listed} "
                  f"({len(set(want) - set(have))} missing, {len(set(have) - set(want))} extra); "
                  "the installed torch/transformers versions probably differ from training", file=sys.stderr)
    return texts


@torch.no_grad()
def score(target, draft, windows, batch):
    sums = dict(t_nll=0.0, d_nll=0.0, t_acc=0.0, d_acc=0.0, accept=0.0, agree=0.0)
    n = 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(np.stack(windows[i:i + batch]).astype(np.int64))
        inp, tgt = x[:, :-1], x[:, 1:]
        lt = target(input_ids=inp).logits.float()
        ld = draft(input_ids=inp).logits.float()
        lpt, lpd = F.log_softmax(lt, -1), F.log_softmax(ld, -1)
        sums["t_nll"] += -lpt.gather(-1, tgt[..., None]).sum().item()
        sums["d_nll"] += -lpd.gather(-1, tgt[..., None]).sum().item()
        at, ad = lt.argmax(-1), ld.argmax(-1)
        sums["t_acc"] += (at == tgt).sum().item()
        sums["d_acc"] += (ad == tgt).sum().item()
        sums["agree"] += (at == ad).sum().item()
        sums["accept"] += torch.minimum(lpt.exp(), lpd.exp()).sum(-1).sum().item()
        n += tgt.numel()
    return {k: v / n for k, v in sums.items()}, n


def distinct4(ids):
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair-dir", default=DEFAULT_PAIR)
    ap.add_argument("--max-windows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-lines", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the numbers and generations here")
    ap.add_argument("--show", type=int, default=2, help="print this many generations in full")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    target, draft, tok = load(args.pair_dir, torch.float32)
    eot = tok.convert_tokens_to_ids(tdp.EOT)
    texts = heldout_texts(args.pair_dir)
    enc = tok.backend_tokenizer.encode_batch([t for _, t in texts], add_special_tokens=False)
    stream = np.concatenate([np.concatenate([[eot], e.ids]).astype(np.int64) for e in enc])
    nwin = (len(stream) - 1) // tdp.SEQ
    pick = np.unique(np.linspace(0, nwin - 1, min(args.max_windows, nwin)).round().astype(int))
    windows = [stream[w * tdp.SEQ: w * tdp.SEQ + tdp.SEQ + 1] for w in pick]
    m, npos = score(target, draft, windows, args.batch)
    t_score = time.time() - t0

    # greedy generations from evenly spaced held-out files with at least prompt-lines lines
    cands = [(n, t) for n, t in texts if len(t.splitlines()) >= args.prompt_lines + 10]
    sel = [cands[i] for i in np.unique(np.linspace(0, len(cands) - 1, args.prompts).round().astype(int))]
    gens = []
    for name, text in sel:
        prompt = "".join(text.splitlines(keepends=True)[:args.prompt_lines])
        ids = torch.tensor([[eot] + tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                  do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                  num_beams=1, pad_token_id=eot, eos_token_id=eot)
        new = out[0, ids.shape[1]:].tolist()
        gens.append(dict(file=name, prompt_tokens=ids.shape[1], new_tokens=len(new), distinct4=distinct4(new),
                         text=tok.decode(new)))
    mean_d4 = float(np.mean([g["distinct4"] for g in gens]))
    a = m["accept"]

    print(f"\nHeld-out: {len(texts)} files, {len(stream):,} tokens; scored {len(windows)} windows x "
          f"{tdp.SEQ} = {npos:,} positions ({t_score:.0f}s)\n")
    print("| model | params | val loss (nats/token) | top-1 acc |")
    print("|---|---:|---:|---:|")
    for nm, mod, k in (("target", target, "t"), ("draft", draft, "d")):
        print(f"| {nm} | {sum(p.numel() for p in mod.parameters()) / 1e6:.2f}M | "
              f"{m[k + '_nll']:.3f} | {m[k + '_acc']:.3f} |")
    print("\n| pair metric | value | bar |")
    print("|---|---:|---|")
    print(f"| acceptance rate at T=1 (mean sum_x min(p,q)) | {a:.3f} | |")
    print(f"| greedy agreement (argmax q == argmax p) | {m['agree']:.3f} | >= 0.7 |")
    print(f"| target greedy distinct 4-gram ratio (mean of {len(gens)}) | {mean_d4:.3f} | >= 0.6 |")
    print(f"| target val loss below draft's by | {m['d_nll'] - m['t_nll']:.3f} nats | > 0 |")
    print("\nExpected tokens per target pass E = (1 - a^(k+1)) / (1 - a) at T=1: "
          + ", ".join(f"k={k}: {(1 - a ** (k + 1)) / (1 - a):.2f}" for k in (1, 2, 3, 4, 5)))
    print("\n| held-out prompt (first %d lines) | new tokens | distinct 4-gram ratio |" % args.prompt_lines)
    print("|---|---:|---:|")
    for g in gens:
        print(f"| {g['file']} | {g['new_tokens']} | {g['distinct4']:.3f} |")
    for g in gens[:args.show]:
        print(f"\n--- greedy continuation of {g['file']} ---\n{g['text']}\n--- end ---")
    ok = m["t_nll"] < m["d_nll"] and m["agree"] >= 0.7 and mean_d4 >= 0.6
    print(f"\nQuality bar {'MET' if ok else 'MISSED'} "
          f"(greedy agreement {m['agree']:.3f} vs 0.7, distinct-4 {mean_d4:.3f} vs 0.6, "
          f"target loss {m['t_nll']:.3f} vs draft {m['d_nll']:.3f}); total {time.time() - t0:.0f}s")
    if args.json:
        json.dump(dict(metrics=m, positions=npos, windows=len(windows), heldout_files=len(texts),
                       heldout_tokens=int(len(stream)), mean_distinct4=mean_d4, generations=gens,
                       bar_met=ok), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
