#!/usr/bin/env python
"""Train Medusa-style draft heads (specdec_ext/heads.py) for a frozen target, on a CPU, reproducibly.

Data: the training files of the bundled pair (tools/train_default_pair.py: *.py of the stdlib, torch
and transformers as installed, the same held-out files by name hash), in a seeded order, tokenised
with the target's tokenizer until ``--max-tokens``, cut into windows of 257 tokens. Held-out files
give the evaluation windows.

Loss of head i (1-based) at position t, from the target's hidden state h_t (the input of its LM
head): ``alpha * KL(p_target(. | x_<=t+i) || head_i(h_t)) + (1 - alpha) * CE(x_{t+1+i})``: the head
learns the target's own distribution of token t+1+i (self-distillation) plus a little of the data.
The target is frozen (bf16 autocast); only the residual blocks train (AdamW, linear warmup, cosine to
10 %, gradient clipping at 1.0, fp32 master weights).

``--minutes`` plans the step count from the speed of the first steps (recorded in
``train_summary.json``); ``--steps`` fixes it (replays a recorded run step for step: same data order,
initialisation and schedule).

Evaluation (before and after training, on held-out windows): per head, top-1 agreement with the
target's argmax for the same token (what a greedy tree verify accepts) and the mean probability the
head gives the target's argmax.

Example (the shipped heads):
    python tools/train_heads.py --out runs/heads --minutes 20
    cp runs/heads/final/* specdec_ext/default_pair/heads/
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_default_pair import collect_files, is_heldout, read_text, log  # noqa: E402
from specdec_ext.progress import progress_bar, progress_wanted  # noqa: E402

SEQ = 256
EVAL_WINDOWS = 48


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="target model dir (default: the bundled target)")
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--kl-alpha", type=float, default=0.9)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    p.add_argument("--max-tokens", type=int, default=4_000_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (it goes to stderr, and only when it is a terminal)")
    return p.parse_args(argv)


def load_target(path):
    from specdec_ext.default_pair import load_default_pair
    if path is None:
        target, _, tokenizer = load_default_pair(dtype=torch.float32)
        return target, tokenizer, "specdec_ext/default_pair/target"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    return target, AutoTokenizer.from_pretrained(path, local_files_only=True), path


def token_streams(tokenizer, max_tokens, seed):
    """(train stream, held-out stream) as uint16/int64 arrays, each file preceded by the EOS token."""
    files = collect_files()
    train = [(n, p) for n, p in files if not is_heldout(n)]
    held = [(n, p) for n, p in files if is_heldout(n)]
    random.Random(seed).shuffle(train)
    sep = tokenizer.eos_token_id

    def stream(items, limit):
        parts, count = [], 0
        for start in range(0, len(items), 64):
            texts = [t for t in (read_text(p) for _, p in items[start:start + 64]) if t and t.strip()]
            for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
                parts.append(np.asarray([sep] + enc.ids, dtype=np.int64))
                count += len(enc.ids) + 1
            if count >= limit:
                break
        return np.concatenate(parts)[:limit]

    return stream(train, max_tokens), stream(held, (EVAL_WINDOWS * SEQ) + 1)


def windows(ids, count, rng):
    starts = rng.integers(0, len(ids) - SEQ - 1, size=count)
    return torch.from_numpy(np.stack([ids[s:s + SEQ + 1] for s in starts]))


class HiddenCapture:
    """Forward pre-hook on the LM head: keeps its input (the hidden states the heads read)."""

    def __init__(self, lm_head):
        self.hidden = None
        self.handle = lm_head.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.hidden = args[0]


def target_pass(target, capture, inp):
    """hidden [B, T, H] fp32 and target log-probs [B, T, V] (no gradients)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = target(input_ids=inp).logits
    return capture.hidden.float(), F.log_softmax(logits.float(), -1)


def head_losses(heads, lm_head, hidden, target_logp, tokens, alpha):
    """Per-head loss (KL to the target's distribution of token t+1+i, plus CE on the data)."""
    losses = []
    T = hidden.shape[1]
    for i, block in enumerate(heads.blocks, start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = lm_head(block(hidden[:, : T - i]))
        logp = F.log_softmax(logits.float(), -1)  # [B, T-i, V]
        teacher = target_logp[:, i:]  # [B, T-i, V]: the target's distribution of token t+1+i
        kl = (teacher.exp() * (teacher - logp)).sum(-1).mean()
        ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), tokens[:, i:].reshape(-1))
        losses.append(alpha * kl + (1 - alpha) * ce)
    return losses


@torch.no_grad()
def evaluate(heads, target, capture, lm_head, held):
    """Per head: top-1 agreement with the target's argmax, mean head probability of that argmax."""
    agree = [0.0] * heads.num_heads
    prob = [0.0] * heads.num_heads
    count = [0] * heads.num_heads
    for start in range(0, len(held), 8):
        x = held[start:start + 8]
        hidden, target_logp = target_pass(target, capture, x[:, :-1])
        T = hidden.shape[1]
        for i, block in enumerate(heads.blocks, start=1):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = lm_head(block(hidden[:, : T - i])).float()
            want = target_logp[:, i:].argmax(-1)  # [B, T-i]
            agree[i - 1] += float((logits.argmax(-1) == want).sum())
            prob[i - 1] += float(torch.softmax(logits, -1).gather(-1, want[..., None]).sum())
            count[i - 1] += want.numel()
    return [dict(head=i + 1, top1_agreement=round(agree[i] / count[i], 4),
                 prob_of_target_argmax=round(prob[i] / count[i], 4)) for i in range(heads.num_heads)]


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from specdec_ext.heads import MedusaHeads, lm_head_of

    target, tokenizer, target_name = load_target(args.target)
    target.requires_grad_(False)
    lm_head = lm_head_of(target)
    capture = HiddenCapture(lm_head)
    vocab, hidden_size = lm_head.weight.shape
    heads = MedusaHeads(int(hidden_size), args.num_heads, int(vocab), target_name)
    t0 = time.time()
    train_ids, held_ids = token_streams(tokenizer, args.max_tokens, args.seed)
    log(f"data: {len(train_ids):,} train tokens, {len(held_ids):,} held-out tokens ({time.time() - t0:.0f}s)")
    rng = np.random.default_rng(args.seed)
    held = torch.from_numpy(np.stack([held_ids[s * SEQ: s * SEQ + SEQ + 1]
                                      for s in range((len(held_ids) - 1) // SEQ)]))
    before = evaluate(heads, target, capture, lm_head, held)
    log(f"before training: {before}")

    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total, plan, step = args.steps, [], 0
    start = time.time()
    bar = progress_bar(total, "heads", unit="step", show=progress_wanted(args.quiet))
    while total is None or step < total:
        x = windows(train_ids, args.batch, rng)
        if total is None and step == 5:  # plan from the speed of steps 1..4 (step 0 warms up)
            per_step = (time.time() - first_timed) / 4
            total = max(step + 1, int(args.minutes * 60 / per_step))
            plan.append([step, total])
            log(f"planned {total} steps ({per_step:.2f} s/step)")
            bar.total = total
            bar.refresh()
        if step == 1:
            first_timed = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10 ** 9, args.lr, args.warmup)
        hidden, target_logp = target_pass(target, capture, x[:, :-1])
        losses = head_losses(heads, lm_head, hidden, target_logp, x[:, 1:], args.kl_alpha)
        loss = sum(losses) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        step += 1
        bar.set_postfix_str(f"loss {loss.item():.3f}", refresh=False)
        bar.update()
        if step % 25 == 0 or step == total:
            log(f"step {step}/{total}: loss {loss.item():.4f} per head "
                f"{[round(l.item(), 3) for l in losses]} ({time.time() - start:.0f}s)")
    bar.close()
    after = evaluate(heads, target, capture, lm_head, held)
    log(f"after training: {after}")
    out = os.path.join(args.out, "final")
    heads.save(out)
    summary = dict(args=vars(args), steps=step, plan=plan, train_tokens=int(len(train_ids)),
                   tokens_seen=step * args.batch * SEQ, minutes=round((time.time() - start) / 60, 1),
                   eval_before=before, eval_after=after, torch=torch.__version__)
    with open(os.path.join(out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
