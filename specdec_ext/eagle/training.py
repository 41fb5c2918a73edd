"""Train an EAGLE-3 head by self-distillation on a CPU (issue 27, item 4): ``train_eagle``.

1. data      each text's first ``prompt_tokens`` tokens, continued by the target itself (HF generate,
             greedy, or sampled at ``temperature``) to ``prompt_tokens + new_tokens`` tokens: the head
             learns the target's own distribution on the target's own outputs.
2. vocab     the ``draft_vocab_size`` most frequent target tokens of the sequences (ties: lower id), sorted
             by id: d2t / t2d (EAGLE-3's choice of a reduced draft vocabulary). The sequences and the
             draft vocabulary are cached in ``out_dir/data.pt``; each step's batch gets its tapped hidden
             states (the inputs of the head's layers, as runners/taps.py taps them) and the target's
             logits over the draft vocabulary from one target forward (``target_views``), so the data
             grows with the token count alone (8192 sequences of 96 tokens would be 11 GB of features
             and logits kept in fp32; their forward costs about a third of a training step).
3. steps     the training-time test unrolled over ``ttt_steps`` draft steps (EAGLE-3): step 0 is the
             head over the target's features (position t: g_t with token t + 1, causal); step j feeds
             anchor t the output of step j - 1 at t with token t + 1 + j at position t + j, seeing the
             true keys 0 .. t and its own unrolled keys (the diagonal), exactly what drafting from
             anchor t does. The loss of step j at anchor t is the cross-entropy of the head's draft
             distribution against the target's distribution of token t + 2 + j renormalised over the
             draft vocabulary, weighted by ``decay ** j``. AdamW, gradients clipped; the embedding is
             the target's, frozen. The learning rate warms up linearly over ``warmup_steps`` and then
             follows a cosine down to ``min_lr_ratio`` x ``lr`` at the run's last step (``steps`` of the
             call: resuming with more steps stretches the rest of the curve).
4. saves     every ``save_every`` steps and at the end: the head in the "eagle" layout (eagle/checkpoints.py)
             and ``trainer.pt`` (step, optimizer, losses); a later call with the same ``out_dir`` resumes.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .checkpoints import bind_target, load_eagle, save_eagle
from .model import Eagle3Model, EagleConfig

__all__ = ["TrainConfig", "TrainResult", "train_eagle", "ttt_losses", "choose_draft_vocab", "target_views",
           "learning_rate"]

TRAINER_STATE = "trainer.pt"
SAVING = ".saving"  # a checkpoint being written, inside the run's directory (_save)
DATA = "data.pt"
DATA_CHUNK = 16  # sequences per target call when making the data


@dataclass(frozen=True)
class TrainConfig:
    """train_eagle's knobs (module docstring)."""

    draft_vocab_size: Optional[int] = None  # None: the target's whole vocabulary
    prompt_tokens: int = 16  # tokens of each text kept as the prompt
    new_tokens: int = 48  # the target's continuation
    temperature: float = 0.0  # of the continuation (0: greedy)
    ttt_steps: int = 3  # draft steps unrolled in training
    decay: float = 0.8  # weight of unrolled step j: decay ** j
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50  # linear warm-up of the learning rate
    min_lr_ratio: float = 0.1  # the cosine's floor at the last step, a fraction of lr
    weight_decay: float = 0.0
    clip: float = 0.5
    save_every: int = 50
    seed: int = 0
    layer_ids: Optional[Tuple[int, ...]] = None  # the target's layers whose inputs are fused (None: (2, L // 2, L - 3))
    intermediate_size: Optional[int] = None  # the head's MLP (None: the target's)


@dataclass
class TrainResult:
    head: Eagle3Model
    losses: List[float] = field(default_factory=list)  # per step, from the first step ever (resumes included)
    start_step: int = 0  # the step this call started from (> 0: resumed)
    path: str = ""
    seconds: float = 0.0  # training time over the whole run (resumes included; data making not counted)


# ------------------------------------------------------------------------------------------ data
@torch.no_grad()
def _continue(target, prompts: List[List[int]], config: TrainConfig) -> torch.Tensor:
    """The target's own continuations of the (equal-length) prompts: [N, prompt_tokens + new_tokens]."""
    device = next(target.parameters()).device
    ids = torch.tensor(prompts, device=device)
    torch.manual_seed(config.seed)
    sampled = config.temperature > 0
    kw = dict(do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=config.new_tokens,
                          min_new_tokens=config.new_tokens, pad_token_id=0, **kw)
    return out.cpu()


@torch.no_grad()
def self_distillation_data(target, tokenizer, texts: Sequence[str], config: TrainConfig) -> dict:
    """The target's own continuations of ``texts`` (those with at least ``prompt_tokens`` tokens) and the draft
    vocabulary chosen from them: {"tokens": [N, n] int64, "draft_ids": [V_d] int64}."""
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) >= config.prompt_tokens:
            prompts.append(list(ids[: config.prompt_tokens]))
    if not prompts:
        raise ValueError(f"train_eagle: no text has {config.prompt_tokens} tokens (prompt_tokens)")
    tokens = torch.cat([_continue(target, prompts[i:i + DATA_CHUNK], config)
                        for i in range(0, len(prompts), DATA_CHUNK)])
    vocab = int(target.get_output_embeddings().weight.shape[0])
    return {"tokens": tokens, "draft_ids": choose_draft_vocab(tokens, vocab, config.draft_vocab_size or vocab)}


@torch.no_grad()
def target_views(target, tokens: torch.Tensor, layer_ids, draft_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the head trains on for ``tokens`` [B, n]: the tapped layers' inputs [B, n, 3 H] fp32 and the
    target's logits over the draft vocabulary [B, n, V_d] fp32 (draft-id order), from one target forward."""
    device = next(target.parameters()).device
    out = target(input_ids=tokens.to(device), output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i].float() for i in layer_ids], dim=-1).cpu()
    return features, out.logits[..., draft_ids.to(device)].float().cpu()


def choose_draft_vocab(tokens: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent ids of ``tokens`` (ties and unseen ids: the lower id first),
    sorted by id. Shape: [V_d] int64."""
    counts = torch.bincount(tokens.reshape(-1), minlength=vocab_size).double()
    score = counts - torch.arange(vocab_size, dtype=torch.float64) / (vocab_size + 1)  # lower id wins ties
    return score.topk(draft_vocab_size).indices.sort().values


# ------------------------------------------------------------------------------------------ the training-time test
def _attend(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, extra: List[Tuple[torch.Tensor, torch.Tensor]],
            scale: float) -> torch.Tensor:
    """Anchor t's query q [B, H, P, D] over the true keys 0 .. t (k0, v0 [B, H, P, D]) and the unrolled
    keys of the same anchor (``extra``: (k_i, v_i) [B, H, P, D] each). Returns [B, H, P, D]."""
    P = q.shape[2]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k0) * scale
    scores = scores.masked_fill(~torch.ones(P, P, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    diagonal = [(q * k).sum(-1, keepdim=True) * scale for k, _ in extra]  # [B, H, P, 1] each
    weights = torch.softmax(torch.cat([scores] + diagonal, dim=-1), dim=-1)
    out = torch.einsum("bhts,bhsd->bhtd", weights[..., :P], v0)
    for i, (_, v) in enumerate(extra):
        out = out + weights[..., P + i: P + i + 1] * v
    return out


def ttt_losses(head: Eagle3Model, tokens: torch.Tensor, features: torch.Tensor, teacher: torch.Tensor,
               steps: int) -> List[torch.Tensor]:
    """The training-time test's loss of each unrolled step (module docstring) over a batch of sequences:
    tokens [B, n], the target's features [B, n, 3 H] and its logits over the draft vocabulary [B, n, V_d]
    (draft-id order). Returns up to ``steps`` scalars."""
    B, n = tokens.shape
    P = n - 1  # anchors t = 0 .. n - 2 (token t + 1 exists)
    c = head.config
    groups = c.num_attention_heads // c.num_key_value_heads
    g = head.fuse(features[:, :P])
    anchors = torch.arange(P, device=tokens.device)
    k0 = v0 = None
    extra: List[Tuple[torch.Tensor, torch.Tensor]] = []
    losses = []
    for j in range(steps):
        valid = anchors + 2 + j <= n - 1  # token t + 2 + j exists
        if not bool(valid.any()):
            break
        feed = tokens.gather(1, (anchors + 1 + j).clamp(max=n - 1)[None].expand(B, -1))  # [B, P]
        q, k, v, residual = head.project(feed, g, (anchors + j)[None].expand(B, -1))
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if j == 0:
            k0, v0 = k, v
        else:
            extra.append((k, v))
        out = head.finish(_attend(q, k0, v0, extra, c.head_dim ** -0.5), residual)  # [B, P, h]
        draft = torch.log_softmax(head.head(out), dim=-1)  # [B, P, V_d]
        index = (anchors + 1 + j).clamp(max=n - 1)[None, :, None].expand(B, -1, teacher.shape[-1])
        p = torch.softmax(teacher.gather(1, index).float(), dim=-1)  # the target's, over the draft vocabulary
        loss = -(p * draft).sum(-1)  # [B, P]
        losses.append(loss[:, valid].mean())
        g = out
    return losses


# ------------------------------------------------------------------------------------------ the loop
def _new_head(target, data: dict, config: TrainConfig) -> Eagle3Model:
    vocab = int(target.get_output_embeddings().weight.shape[0])
    overrides = {} if config.intermediate_size is None else dict(intermediate_size=config.intermediate_size)
    eagle_config = bind_target(EagleConfig.for_target(target, draft_vocab_size=config.draft_vocab_size or vocab,
                                                      layer_ids=config.layer_ids, **overrides), target)
    torch.manual_seed(config.seed)
    head = Eagle3Model(eagle_config)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
    head.set_draft_vocab(data["draft_ids"])
    return head


# The options the saved data were made with (data.pt's "options", with a digest of the texts)
DATA_OPTIONS = ("draft_vocab_size", "prompt_tokens", "new_tokens", "temperature", "seed")


def _data_options(config: TrainConfig, texts: Sequence[str]) -> dict:
    options = {name: getattr(config, name) for name in DATA_OPTIONS}
    options["texts"] = hashlib.sha256("\0".join(texts).encode("utf-8", "surrogatepass")).hexdigest()
    return options


def _prepare(target, tokenizer, texts, out_dir: str, config: TrainConfig):
    """(head, optimizer, data, losses, start step, seconds trained, the run's config): resumed from ``out_dir``
    when it holds a run, whose saved data and head fix the options FIXED_BY_THE_RUN (the config returned has
    them). Data saved by a run that never saved a step are made again where they were made for other options
    or texts (they were reused silently)."""
    os.makedirs(out_dir, exist_ok=True)
    state_path, data_path = os.path.join(out_dir, TRAINER_STATE), os.path.join(out_dir, DATA)
    resumed = os.path.isfile(state_path)
    data = torch.load(data_path, weights_only=True) if os.path.isfile(data_path) else None
    if data is not None and not resumed and data.get("options") != _data_options(config, texts):
        data = None
    if data is None:
        data = self_distillation_data(target, tokenizer, texts, config)
        data["options"] = _data_options(config, texts)
        torch.save(data, data_path)
    state = torch.load(state_path, weights_only=False) if resumed else None
    if resumed:
        saved = state.get("config", {})
        _warn_fixed_by_the_run(saved, config, out_dir)
        config = replace(config, **{name: tuple(saved[name]) if isinstance(saved[name], list) else saved[name]
                                    for name in FIXED_BY_THE_RUN if name in saved})
    head = load_eagle(out_dir, target) if resumed else _new_head(target, data, config)
    head.train().requires_grad_(True)
    head.embed_tokens.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    losses, start, seconds = [], 0, 0.0
    if resumed:
        optimizer.load_state_dict(state["optimizer"])
        losses, start, seconds = list(state["losses"]), int(state["step"]), float(state.get("seconds", 0.0))
    return head, optimizer, data, losses, start, seconds, config


# What a run's saved data and head fix: a resumed run keeps them whatever the call asks
FIXED_BY_THE_RUN = ("draft_vocab_size", "prompt_tokens", "new_tokens", "temperature", "seed", "layer_ids",
                    "intermediate_size")


def _warn_fixed_by_the_run(saved: dict, config: TrainConfig, out_dir: str) -> None:
    """A warning naming the options a resumed run ignores (its data and head were made with the saved ones);
    the texts too are the saved data's."""
    asked = asdict(config)
    ignored = [f"{name}={asked[name]!r} (the run's: {saved[name]!r})" for name in FIXED_BY_THE_RUN
               if name in saved and _plain(saved[name]) != _plain(asked[name])]
    if ignored:
        warnings.warn(f"resuming the run in {out_dir}: its data and head were made with other options, so these are "
                      f"ignored: {', '.join(ignored)}; the texts are the saved data's too. A new out_dir trains "
                      f"afresh.", stacklevel=3)


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def learning_rate(step: int, steps: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a run of ``steps`` (module docstring, 3)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(steps - 1 - config.warmup_steps, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def _save(head: Eagle3Model, optimizer, losses: List[float], step: int, seconds: float, out_dir: str,
          config: TrainConfig) -> None:
    """A checkpoint, written beside the last one (``SAVING``) and then moved over it file by file (each move
    atomic): a run stopped while saving resumes from the last whole checkpoint (save_eagle removed the old
    weights before it wrote the new, so a stop in between left no head at all)."""
    saving = os.path.join(out_dir, SAVING)
    shutil.rmtree(saving, ignore_errors=True)
    save_eagle(head, saving, layout="eagle", embed=False)
    torch.save({"optimizer": optimizer.state_dict(), "losses": losses, "step": step, "seconds": seconds,
                "config": asdict(config)}, os.path.join(saving, TRAINER_STATE))
    for name in sorted(os.listdir(saving), key=lambda n: n == TRAINER_STATE):  # (the trainer's state last)
        os.replace(os.path.join(saving, name), os.path.join(out_dir, name))
    os.rmdir(saving)


def train_eagle(target, tokenizer, texts: Sequence[str], out_dir: str, steps: int,
                config: TrainConfig = TrainConfig(),
                on_step: Optional[Callable[[int, float], None]] = None) -> TrainResult:
    """Train (or resume training) an EAGLE-3 head for ``target`` up to ``steps`` optimizer steps on the
    target's own continuations of ``texts`` (module docstring); the head is saved in ``out_dir``.
    ``tokenizer``: anything with ``encode(text) -> ids``; ``on_step(step, loss)`` after each step (a progress
    bar; ``step`` counts from 1 over the whole run). Returns the head (eval mode) and the losses."""
    head, optimizer, data, losses, start, seconds, config = _prepare(target, tokenizer, texts, out_dir, config)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed + start)
    N = data["tokens"].shape[0]
    weights = [config.decay ** j for j in range(config.ttt_steps)]
    for step in range(start, steps):
        batch = torch.randint(N, (min(config.batch_size, N),), generator=generator)
        tokens = data["tokens"][batch]
        features, teacher = target_views(target, tokens, head.config.layer_ids, data["draft_ids"])
        step_losses = ttt_losses(head, tokens, features, teacher, config.ttt_steps)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, config)
        loss = sum(w * l for w, l in zip(weights, step_losses)) / sum(weights[: len(step_losses)])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], config.clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"train_eagle: the loss is {losses[-1]} at step {step}")
        if on_step is not None:
            on_step(step + 1, losses[-1])
        if (step + 1) % config.save_every == 0 or step + 1 == steps:
            _save(head, optimizer, losses, step + 1, seconds + time.perf_counter() - started, out_dir, config)
    head.eval().requires_grad_(False)
    return TrainResult(head, losses, start, out_dir, seconds + time.perf_counter() - started)
