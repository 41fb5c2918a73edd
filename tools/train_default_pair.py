#!/usr/bin/env python
"""Train the bundled default (target, draft) model pair of specdec_ext, reproducibly, on a CPU.

What it builds (all from a fixed seed):

* a byte-level BPE tokenizer (HF ``tokenizers``: ByteLevel pre-tokenizer and decoder, vocab 8192,
  one special token ``<|endoftext|>`` used as BOS/EOS/PAD and as the separator between files), saved
  as a ``PreTrainedTokenizerFast`` directory (``tokenizer.json`` + ``tokenizer_config.json``);
* a Llama-style target (``LlamaForCausalLM``, untied embeddings, d_model 512, 6 layers, 8 heads,
  MLP 1280, about 26.5M parameters counting both embeddings);
* a Llama-style draft sharing the tokenizer (d_model 128, 2 layers, 4 heads, MLP 512, about 2.6M
  parameters), distilled from the finished target: loss = alpha * KL(p_target || q_draft) at T=1
  + (1 - alpha) * next-token cross entropy.

Data: Python source files (``*.py`` only) from exactly these three trees of the running interpreter:

1. ``stdlib``: ``sysconfig.get_paths()['stdlib']``, excluding its top-level ``test/`` and
   ``site-packages/`` directories (and anything under a ``__pycache__`` directory);
2. ``torch``: the installed package directory ``os.path.dirname(torch.__file__)``;
3. ``transformers``: the installed package directory ``os.path.dirname(transformers.__file__)``.

Files larger than 512 KiB or not valid UTF-8 are skipped. Each file is named ``<tree>/<relpath>``;
a file is held out for evaluation when ``int(sha1(name).hexdigest(), 16) % 100 < 2`` (whole files,
about 2 %). The held-out list is written to ``OUT/heldout_files.txt`` (and ``train_files.txt``).
Training text: the training files in a seeded random order, each preceded by ``<|endoftext|>``,
concatenated and cut into windows of 257 tokens (256 inputs + the shifted targets) with stride 256;
the windows are visited in a seeded random order, so step s always sees the same batch (``--resume``
continues with the same data order).

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup then cosine
decay to 10 %, gradient clipping at 1.0, bf16 autocast with fp32 master weights, one thread.
The number of steps of each phase is planned from ``--minutes`` by timing the first steps and
re-planned every 50 steps from the recent speed (the machine is shared), the cosine schedule following
the current plan; every change is logged and kept in ``train_summary.json`` (``target_plan``,
``draft_plan``: [step, total steps from then on]). ``--replay-plan OUT/final/train_summary.json``
follows a recorded plan exactly instead of timing (same step counts and LR schedule: data order,
initialisation and schedule then depend only on the seed and the plan, so the run is reproduced step
for step; floating-point results may still differ across CPUs and torch versions). ``--target-steps``
/ ``--draft-steps`` fix the counts with a plain cosine schedule. Checkpoints are written every
``--ckpt-minutes`` to ``OUT/ckpt/``.

Output: ``OUT/final/{target,draft,tokenizer}`` in bf16 safetensors, plus ``heldout_files.txt`` and
``train_summary.json``, ready to copy into ``specdec_ext/default_pair/``.

Example (the shipped pair: started with a 75-minute budget, interrupted after 12 minutes and resumed
with 80; see specdec_ext/default_pair/MODEL_CARD.md):
    python tools/train_default_pair.py --out runs/default_pair --minutes 75 --draft-fraction 0.21
    python tools/train_default_pair.py --out runs/default_pair --minutes 80 --draft-fraction 0.21 --resume
    # or, without timing, the exact recorded step plans:
    python tools/train_default_pair.py --out runs/default_pair \
        --replay-plan specdec_ext/default_pair/train_summary.json
"""
import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from specdec_ext.default_pair.corpus import collect_files, is_heldout, source_trees  # noqa: F401 (tools import them from here)
from specdec_ext.progress import progress_bar, progress_wanted, write_line

EOT = "<|endoftext|>"
SEQ = 256

TARGET_SHAPE = dict(hidden_size=512, intermediate_size=1280, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=8)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4)


def log(*a):
    write_line(" ".join(map(str, (time.strftime("%H:%M:%S"),) + a)))  # on stdout, under the progress bar


# ----------------------------------------------------------------------------------------- data
def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts, vocab_size, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   pad_token=EOT, unk_token=None,
                                   clean_up_tokenization_spaces=False, model_max_length=2048)
    fast.save_pretrained(out_dir)
    # name the class every transformers version knows (4.x and 5.x; 5.x aliases it to TokenizersBackend)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    return fast


def prepare_data(args):
    """Tokenizer + token stream, cached in OUT/data (deterministic, so a rerun rebuilds the same)."""
    from transformers import AutoTokenizer
    data_dir = os.path.join(args.out, "data")
    tok_dir = os.path.join(args.out, "tokenizer")
    ids_path = os.path.join(data_dir, "train_ids.npy")
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.exists(ids_path) and os.path.exists(meta_path) and os.path.exists(tok_dir):
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        return tok, np.load(ids_path, mmap_mode="r"), json.load(open(meta_path))
    os.makedirs(data_dir, exist_ok=True)
    t0 = time.time()
    files = collect_files()
    train, held = [], []
    for name, path in files:
        text = read_text(path)
        if text is None or not text.strip():
            continue
        (held if is_heldout(name) else train).append((name, text))
    log(f"files: {len(train)} train, {len(held)} held out ({time.time() - t0:.0f}s)")
    with open(os.path.join(args.out, "heldout_files.txt"), "w") as f:
        f.write("".join(n + "\n" for n, _ in held))
    with open(os.path.join(args.out, "train_files.txt"), "w") as f:
        f.write("".join(n + "\n" for n, _ in train))
    # tokenizer: trained on a deterministic third of the training files (by name hash)
    sub = [t for n, t in train if int(hashlib.sha1(n.encode()).hexdigest(), 16) % 3 == 0]
    tok = train_tokenizer(sub, args.vocab_size, tok_dir)
    log(f"tokenizer trained on {len(sub)} files, vocab {len(tok)} ({time.time() - t0:.0f}s)")
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    eot = tok.convert_tokens_to_ids(EOT)
    enc = tok.backend_tokenizer.encode_batch([train[i][1] for i in order], add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.array([eot], dtype=np.uint16))
        parts.append(np.asarray(e.ids, dtype=np.uint16))
    ids = np.concatenate(parts)
    np.save(ids_path, ids)
    per_tree = {}
    for n, t in train:
        per_tree.setdefault(n.split("/")[0], [0, 0])[0] += 1
    for n, t in held:
        per_tree.setdefault(n.split("/")[0], [0, 0])[1] += 1
    meta = dict(train_files=len(train), heldout_files=len(held), train_tokens=int(len(ids)),
                per_tree_train_heldout=per_tree, trees={t: r for t, r, _ in source_trees()},
                tokenizer_files=len(sub), vocab=len(tok))
    json.dump(meta, open(meta_path, "w"), indent=1)
    log(f"train stream: {len(ids):,} tokens ({time.time() - t0:.0f}s)")
    return tok, np.load(ids_path, mmap_mode="r"), meta


class Batches:
    """Deterministic batch b = windows perm[b*B:(b+1)*B] of the stream (new permutation per epoch)."""

    def __init__(self, ids, batch, seed):
        self.ids, self.batch, self.seed = ids, batch, seed
        self.n = (len(ids) - 1) // SEQ
        self._perm = {}

    def perm(self, epoch):
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng(self.seed + 1000 * epoch).permutation(self.n)}
        return self._perm[epoch]

    def get(self, step):
        rows = []
        for j in range(step * self.batch, (step + 1) * self.batch):
            w = self.perm(j // self.n)[j % self.n]
            rows.append(np.asarray(self.ids[w * SEQ: w * SEQ + SEQ + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


# ---------------------------------------------------------------------------------------- model
def make_model(shape, tok, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    eot = tok.convert_tokens_to_ids(EOT)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, rms_norm_eps=1e-5,
                      attention_dropout=0.0, **shape)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    m.config._attn_implementation = "sdpa"
    return m


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def make_opt(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0)],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def logits_of(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=x).logits.float()


# ------------------------------------------------------------------------------------ training
def save_ckpt(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def run_phase(args, phase, model, batches, peak_lr, warmup, budget_s, fixed_steps, ckpt_path,
              teacher=None, replay=None):
    """Train one phase. ``replay``: a recorded plan [(step, total), ...] to follow instead of timing."""
    replay = {int(s): int(t) for s, t in replay} if replay else None
    opt = make_opt(model, peak_lr)
    step, total, spent, plan = 0, fixed_steps, 0.0, []
    if args.resume and os.path.exists(ckpt_path):
        st = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if st["phase"] == phase:
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
            step, total, spent, plan = st["step"], st["total"], st["spent"], st["plan"]
            if replay is None and fixed_steps is not None and fixed_steps != total:
                total = fixed_steps
                plan.append((step, total))
            log(f"[{phase}] resumed at step {step}/{total}")
    if step and total and step >= total:
        return model
    model.train()
    step0, calib_t = step, None
    calib_at = step0 + 12
    t_start, last_ckpt, last_log = time.time(), time.time(), time.time()
    ema, tok_seen, hist = None, 0, []
    bar = progress_bar(total, phase, unit="step", show=progress_wanted(args.quiet))
    bar.update(step)
    while total is None or step < total:
        x = batches.get(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10 ** 9, peak_lr, warmup)
        inp, tgt = x[:, :-1], x[:, 1:]
        logits = logits_of(model, inp)
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(logits_of(teacher, inp), -1)
            s_logp = F.log_softmax(logits, -1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
            loss = args.kl_alpha * kl + (1 - args.kl_alpha) * ce
        else:
            loss = ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tok_seen += inp.numel()
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        now = time.time()
        if replay is not None:
            if step in replay:
                total = replay[step]
                plan.append((step, total))
        elif total is None and step == step0 + 2:
            calib_t = now
        if replay is None and total is None and step == calib_at:
            per_step = (now - calib_t) / 10
            per_step *= 1.08  # margin: the first steps run a little faster than the average
            total = max(step + 1, int((budget_s - spent - (now - t_start)) / per_step) + step)
            plan.append((step, total))
            log(f"[{phase}] {per_step:.2f}s/step -> total steps {total} for {budget_s / 60:.1f} min")
        if step % 50 == 0:
            hist.append((step, now))
        if replay is None and fixed_steps is None and total and step % 50 == 0 and step >= step0 + 100 and total - step > 100:
            # replan to the wall-clock budget from the recent speed (the machine is shared, so the
            # speed changes): shrink when behind by > 5 %, grow when ahead by > 8 %; this also lets
            # --resume with a different --minutes re-target the remaining steps
            el = spent + now - t_start
            s_a, t_a = hist[-4] if len(hist) >= 4 else (step0, t_start)
            per_step = (now - t_a) / max(1, step - s_a)
            projected = el + (total - step) * per_step
            if projected > budget_s * 1.05 or projected < budget_s * 0.92:
                new_total = max(step + 1, step + int((budget_s - el) / per_step))
                log(f"[{phase}] projected {projected / 60:.1f} min for a {budget_s / 60:.1f} min budget: "
                    f"replanned {total} -> {new_total} steps")
                total = new_total
                plan.append((step, total))
        if bar.total != total:  # planned, or replanned to the budget
            bar.total = total
            bar.refresh()
        bar.set_postfix_str(f"ce {ema:.3f}", refresh=False)
        bar.update()
        if now - last_log > 30 or (total and step == total):
            el = spent + now - t_start
            rate = tok_seen / (now - t_start)
            eta = (total - step) * (now - t_start) / max(1, tok_seen / inp.numel()) if total else float("nan")
            extra = f" kl {kl.item():.3f}" if teacher is not None else ""
            log(f"[{phase}] step {step}/{total} ce {ce.item():.3f} (ema {ema:.3f}){extra} "
                f"lr {opt.param_groups[0]['lr']:.2e} {rate:.0f} tok/s elapsed {el / 60:.1f}m ETA {eta / 60:.1f}m")
            last_log = now
        if now - last_ckpt > args.ckpt_minutes * 60 or (total and step == total):
            save_ckpt(ckpt_path, dict(phase=phase, model=model.state_dict(), opt=opt.state_dict(),
                                      step=step, total=total, spent=spent + now - t_start, plan=plan))
            last_ckpt = now
    bar.close()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=75.0, help="total training budget (both phases)")
    ap.add_argument("--draft-fraction", type=float, default=0.21, help="share of --minutes for the draft")
    ap.add_argument("--target-steps", type=int, default=None, help="fix the target's steps (reproduce)")
    ap.add_argument("--draft-steps", type=int, default=None, help="fix the draft's steps (reproduce)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--replay-plan", default=None,
                    help="train_summary.json of an earlier run: follow its recorded step plans exactly "
                         "(same LR schedule and step counts, no timing) to reproduce it")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--kl-alpha", type=float, default=0.9)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bar (it goes to stderr, and only when it is a terminal)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    ck = os.path.join(args.out, "ckpt")
    os.makedirs(ck, exist_ok=True)
    t0 = time.time()
    tok, ids, meta = prepare_data(args)
    if args.prepare_only:
        return
    budget = args.minutes * 60
    target = make_model(TARGET_SHAPE, tok, args.seed)
    draft = make_model(DRAFT_SHAPE, tok, args.seed + 1)
    log(f"target {n_params(target) / 1e6:.2f}M params, draft {n_params(draft) / 1e6:.2f}M params, "
        f"stream {meta['train_tokens']:,} tokens")
    tpath, dpath = os.path.join(ck, "target.pt"), os.path.join(ck, "draft.pt")
    plans = json.load(open(args.replay_plan)) if args.replay_plan else {}
    run_phase(args, "target", target, Batches(ids, args.batch, args.seed), args.target_lr, 100,
              budget * (1 - args.draft_fraction), args.target_steps, tpath,
              replay=plans.get("target_plan"))
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    run_phase(args, "draft", draft, Batches(ids, args.batch, args.seed + 7), args.draft_lr, 50,
              budget * args.draft_fraction, args.draft_steps, dpath, teacher=target,
              replay=plans.get("draft_plan"))
    final = os.path.join(args.out, "final")
    for name, m in (("target", target), ("draft", draft)):
        m.eval()
        m.config.use_cache = True
        m.to(torch.bfloat16).save_pretrained(os.path.join(final, name))
    shutil.copytree(os.path.join(args.out, "tokenizer"), os.path.join(final, "tokenizer"), dirs_exist_ok=True)
    shutil.copy(os.path.join(args.out, "heldout_files.txt"), os.path.join(final, "heldout_files.txt"))
    st_t = torch.load(tpath, map_location="cpu", weights_only=False)
    st_d = torch.load(dpath, map_location="cpu", weights_only=False)
    summary = dict(meta, target_params=n_params(target), draft_params=n_params(draft),
                   target_steps=st_t["total"], draft_steps=st_d["total"],
                   target_plan=st_t["plan"], draft_plan=st_d["plan"], batch=args.batch, seq=SEQ,
                   target_tokens=st_t["total"] * args.batch * SEQ, draft_tokens=st_d["total"] * args.batch * SEQ,
                   target_train_s=st_t["spent"], draft_train_s=st_d["spent"], argv=sys.argv[1:])
    json.dump(summary, open(os.path.join(final, "train_summary.json"), "w"), indent=1)
    log(f"done in {(time.time() - t0) / 60:.1f} min (this invocation); summary: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
