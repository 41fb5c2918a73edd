"""The EAGLE-3 draft head: one Llama-style decoder layer over the target's own hidden states.

    features   the target's hidden states at n layers (runners/taps.py; by default the inputs of layers
               2, L // 2, L - 3), concatenated: f [n * H_t] per token
    fc         f -> g [h] (no bias in SafeAILab/EAGLE and SpecForge; speculators may carry one)
    layer      residual = g (``norm_before_residual``: hidden_norm(g)); x = [input_layernorm(embed(token));
               hidden_norm(g)] [2h]; q, k, v = x W (2h -> heads); attention over its own KV cache with RoPE;
               out = residual + o(attn); out += mlp(post_attention_layernorm(out))
    head       draft logits = lm_head(norm(out)) over a reduced draft vocabulary of V_d tokens; draft id d
               is target id d + d2t[d]; t2d [V] marks the target ids that have one
    unroll     a draft step after the first feeds the layer's own output ``out`` (before the final norm)
               as the next g, with the token it drafted (as trained: the training-time test)

Alignment (as EAGLE's): the draft position t holds (g of the target's position t, the token at t + 1)
and predicts the token at t + 2; its rotary position is t. The attribute names are SafeAILab/EAGLE's
(``midlayer.self_attn.q_proj``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so their checkpoints
load by name (eagle/checkpoints.py; speculators' ``layers.0.`` is renamed).

The forward runs in fp32 (the model is small; a bf16 checkpoint is widened once).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..runners.taps import default_tap_layers
from .kernels import kernel_block, kernel_fuse, kernel_greedy_chain, kernel_head, kernels_apply

__all__ = ["EagleConfig", "Eagle3Model", "EagleKV", "NUM_FEATURES"]

NUM_FEATURES = 3  # EAGLE-3 fuses three of the target's hidden states
KERNEL_DTYPE = torch.bfloat16  # Eagle3Model.kernel_dtype's default


def _mlp_width(cfg) -> int:
    """The target's MLP width under its config's name for it (GPT-2's n_inner, None: 4 x its width; OPT's
    ffn_dim), where it has no ``intermediate_size``."""
    for name in ("intermediate_size", "n_inner", "ffn_dim"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return 4 * int(cfg.hidden_size)


@dataclass(frozen=True)
class EagleConfig:
    """The draft head's shape and the target it reads (see the module docstring)."""

    hidden_size: int  # h: the draft layer's width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the embedding's rows, t2d's length)
    draft_vocab_size: int  # V_d: the draft head's outputs
    target_hidden_size: int  # H_t: the width of each tapped state
    layer_ids: Optional[Tuple[int, ...]] = None  # the target's tapped layers (inputs of); None: the default
    target_num_layers: Optional[int] = None  # the target's decoder layers, when known
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # a HF rope_scaling dict (llama3, linear, ...), None: default RoPE
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False  # speculators' option: the residual is hidden_norm(g)
    fc_bias: bool = False
    attention_bias: bool = False
    target_name_or_path: str = ""

    @classmethod
    def for_target(cls, target, *, draft_vocab_size: Optional[int] = None, layer_ids=None,
                   **overrides) -> "EagleConfig":
        """A head shaped like ``target``'s layers (HF config): its width, heads and MLP; ``overrides``
        replace any field (e.g. a narrower ``intermediate_size``)."""
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        heads = int(cfg.num_attention_heads)
        layers = int(cfg.num_hidden_layers)
        vocab = int(target.get_output_embeddings().weight.shape[0])
        rope = getattr(cfg, "rope_parameters", None) or {}
        fields = dict(
            hidden_size=int(cfg.hidden_size), num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            intermediate_size=int(_mlp_width(cfg)), vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size or vocab),
            target_hidden_size=int(cfg.hidden_size),
            layer_ids=tuple(layer_ids) if layer_ids is not None else default_tap_layers(layers),
            target_num_layers=layers, rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0) or 10000.0)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
            target_name_or_path=str(getattr(cfg, "_name_or_path", "") or ""))
        fields.update(overrides)
        return cls(**fields)

    def llama_config(self):
        """The draft layer as a transformers LlamaConfig (for its RoPE tables)."""
        import transformers
        kw = dict(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                  intermediate_size=self.intermediate_size, vocab_size=self.vocab_size, num_hidden_layers=1,
                  rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                  rope_theta=self.rope_theta)
        if self.rope_scaling:
            kw["rope_scaling"] = dict(self.rope_scaling)
        return transformers.LlamaConfig(**kw)

    def replace(self, **changes) -> "EagleConfig":
        return dataclasses.replace(self, **changes)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(self.weight)
        return F.rms_norm(x.to(dtype), self.weight.shape, self.weight.to(dtype), self.eps)


class _Attention(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        width = 2 * c.hidden_size
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)


class _MLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.down_proj, F.silu(_linear(self.gate_proj, x)) * _linear(self.up_proj, x))


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on ``x`` in the weight's dtype, the result in the compute dtype (``_compute_dtype``): a head in
    bf16 or fp16 computes its norms, attention and residuals in fp32, as fc and lm_head do (a bf16 head failed
    with "expected m1 and m2 to have the same dtype")."""
    return layer(x.to(layer.weight.dtype)).to(_compute_dtype(layer.weight))


class _DecoderLayer(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class EagleKV:
    """The draft layer's own KV cache: k, v [rows, Hk, capacity, D] fp32; rollback is the caller's lengths."""

    def __init__(self, config: EagleConfig, rows: int, capacity: int, device):
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row ``row``'s slots ``src`` -> ``dst`` (a tree's accepted path next to the prefix)."""
        self.k[row, :, dst] = self.k[row, :, src]
        self.v[row, :, dst] = self.v[row, :, src]


class Eagle3Model(nn.Module):
    """The EAGLE-3 draft head (module docstring); buffers ``d2t`` [V_d] int64 and ``t2d`` [V] bool."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        c = config
        features = len(c.layer_ids) if c.layer_ids is not None else NUM_FEATURES
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(features * c.target_hidden_size, c.hidden_size, bias=c.fc_bias)
        self.midlayer = _DecoderLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(c.draft_vocab_size))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        rotary = LlamaRotaryEmbedding(c.llama_config())
        self.register_buffer("inv_freq", rotary.inv_freq.float().clone(), persistent=False)
        self.rope_scale = float(rotary.attention_scaling)
        # the dtype the CPU kernels read the head's matrices in (eagle/kernels.py): a chain step reads each
        # once, so bf16 halves its bytes, as the bf16 target's passes; any head keeps generation lossless.
        # fp32 computes what the torch path does (the tests' exact comparisons pin it).
        self.kernel_dtype = KERNEL_DTYPE

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id d predicts target id target_ids[d] (distinct ids): d2t = target_ids - d, t2d marks them."""
        ids = target_ids.to(torch.int64).reshape(-1)
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"set_draft_vocab: need {self.config.draft_vocab_size} distinct target ids, "
                             f"got {ids.numel()} ({ids.unique().numel()} distinct)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"set_draft_vocab: target ids must lie in [0, {self.config.vocab_size})")
        with torch.no_grad():
            self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """The target id of each draft id. Shape: [V_d] int64."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] -> [..., V] over target ids, -inf where no draft id maps."""
        out = draft_logits.new_full(draft_logits.shape[:-1] + (self.config.vocab_size,), float("-inf"))
        out[..., self.target_ids] = draft_logits
        return out

    # ------------------------------------------------------------------ the layer, in parts
    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """The target's tapped states [..., n * H_t] -> g [..., h] (fc; on the CPU kernels where they apply)."""
        if kernels_apply(self):
            return kernel_fuse(self, states)
        return self.fc(states.to(self.fc.weight.dtype)).to(_compute_dtype(self.fc.weight))

    def rope(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] of rotary positions [B, T] (HF's default / scaled RoPE)."""
        freqs = positions[..., None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).unsqueeze(1), (emb.sin() * self.rope_scale).unsqueeze(1)

    def project(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        """q [B, H, T, D], k, v [B, Hk, T, D] (rotated) and the residual [B, T, h] of tokens [B, T] with
        their features g [B, T, h] at rotary positions [B, T]."""
        c, layer = self.config, self.midlayer
        B, T = tokens.shape
        normed = layer.hidden_norm(g)
        residual = normed if c.norm_before_residual else g.to(normed.dtype)
        x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), normed], dim=-1)
        attn = layer.self_attn
        q = _linear(attn.q_proj, x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = _linear(attn.k_proj, x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = _linear(attn.v_proj, x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, T, h] from the attention [B, H, T, D] and the residual."""
        B, H, T, D = attn.shape
        layer = self.midlayer
        out = residual + _linear(layer.self_attn.o_proj, attn.transpose(1, 2).reshape(B, T, H * D))
        return out + layer.mlp(layer.post_attention_layernorm(out))

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] of the layer's outputs [..., h] (final norm, lm_head; on the CPU kernels
        where they apply)."""
        if kernels_apply(self):
            flat = kernel_head(self, out.reshape(-1, out.shape[-1]))
            return flat.view(tuple(out.shape[:-1]) + (flat.shape[-1],))
        return self.lm_head(self.norm(out).to(self.lm_head.weight.dtype)).to(_compute_dtype(self.lm_head.weight))

    def block(self, tokens: torch.Tensor, g: torch.Tensor, start: torch.Tensor, cache: EagleKV,
              span: Optional[int] = None) -> torch.Tensor:
        """A chain pass: tokens [B, T] with features g [B, T, h] at slots and rotary positions start[b] + t
        ([B] int64), each seeing the row's earlier slots and the block causally. On the CPU kernels where
        they apply (eagle/kernels.py: batch-invariant), else ``step`` over the first ``span`` cache slots
        (None: as far as the block reaches, read on the host; a CUDA graph passes the capacity). Returns
        the outputs [B, T, h]."""
        if kernels_apply(self):
            return kernel_block(self, tokens, g, start, cache)
        positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
        S = int(positions.max()) + 1 if span is None else span
        visible = torch.arange(S, device=tokens.device)[None, None, :] <= positions[:, :, None]
        return self.step(tokens, g, positions, cache, positions, visible)

    # ------------------------------------------------------------------ over a cache
    def greedy_chain(self, tokens: torch.Tensor, steps: int, last: torch.Tensor, start: torch.Tensor, cache: EagleKV,
                     span: Optional[int] = None) -> torch.Tensor:
        """A greedy draft chain: tokens[:, i] (target ids) = the argmax of the head over the layer's output,
        starting from ``last`` [B, h] (the output at each row's last fed position); each token but the last
        is fed with that output at slot start[b] + i ([B] int64), as trained. On the CPU kernels in one call
        where they apply (``eagle_chain``), else ``head`` and ``block`` step by step (``span`` as ``block``'s).
        tokens [B, n] int64 (n >= steps), written; returns it."""
        if kernels_apply(self):
            return kernel_greedy_chain(self, tokens, steps, last, start, cache)
        out = last
        for i in range(steps):
            token = self.target_ids[self.head(out).argmax(-1)]  # [B]
            tokens[:, i].copy_(token)
            if i + 1 < steps:  # the drafted token with the layer's own output, at slot start + i
                out = self.block(token[:, None], out[:, None], start + i, cache, span=span)[:, 0]
        return tokens

    def step(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache: EagleKV,
             slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One pass over T tokens per row against ``cache``: tokens [B, T], features g [B, T, h], rotary
        positions [B, T]; their keys and values written at ``slots`` [B, T] of cache rows 0..B-1; each sees
        the cache slots ``visible`` [B, T, S] marks (S <= capacity). Returns the layer's outputs [B, T, h]."""
        q, k, v, residual = self.project(tokens, g, positions)
        B, S = tokens.shape[0], visible.shape[-1]
        rows = torch.arange(B, device=tokens.device)[:, None]  # [B, 1]
        cache.k[rows, :, slots] = k.transpose(1, 2)
        cache.v[rows, :, slots] = v.transpose(1, 2)
        c = self.config
        attn = F.scaled_dot_product_attention(q, cache.k[:B, :, :S], cache.v[:B, :, :S], attn_mask=visible[:, None],
                                              scale=c.head_dim ** -0.5,
                                              enable_gqa=c.num_key_value_heads != c.num_attention_heads)
        return self.finish(attn, residual)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for a float64 copy (the tests' reference)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
