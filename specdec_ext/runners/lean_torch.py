"""The lean runner's pure-torch forward: what ``LeanLlamaRunner`` runs off the CPU, or on a CPU with
``SPECDEC_CPU_KERNELS=0`` (runners/lean.py runs the CPU kernels otherwise).

RMSNorm, default RoPE, GQA attention with ``scaled_dot_product_attention``, a SiLU-gated MLP and the LM
head over a ``LlamaWeights`` (ops/lean_forward.py; the model's own tensors, or copies cast once to the
compute dtype) and the runner's contiguous cache, which it receives at each call. Positions and the
attention mask of a ragged or tree forward come from ``layout.step_layout``, as in the paged runner;
when every row starts at the same position one shared [T, S] mask (or none) is used. When hooks are
registered on the model's LM head (the heads drafter reads its input through one) the LM head module
itself is called, so they see what they would see under the HF forward.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..ops.lean_forward import LlamaLayerWeights, LlamaWeights
from .head_hooks import head_hooked
from .layout import additive_mask, step_layout

__all__ = ["TorchForward"]


class TorchForward:
    """``LeanLlamaRunner._model``'s contract in torch over ``weights``, computing in ``dtype``; ``head``
    is the model's LM head module (called when something is hooked on it)."""

    def __init__(self, weights: LlamaWeights, dtype: torch.dtype, head: torch.nn.Module, max_batch_size: int,
                 taps: Optional[Sequence[int]] = None):
        self.weights, self.dtype, self.head = weights, dtype, head
        self.taps = taps  # layers whose inputs each call keeps in ``tapped`` (runners/taps.py)
        self.tapped: Optional[list] = None  # the last call's: one [B, T, d] per tapped layer
        self.device = weights.embed.device
        self.gqa = weights.kv_heads != weights.heads
        # The KV cache and the attention in fp32 for a half-precision model on the CPU: the cached
        # keys and values are the model-dtype k and v (exact in fp32), and attention accumulates in
        # fp32 as half-precision SDPA kernels do inside, but torch's CPU SDPA has a slow bf16 path
        # for a single query (360 us against 44 us in fp32 at 500 positions, 8 heads of 64, one
        # thread: a third of a decode step of the bundled target on the edit workload).
        half_on_cpu = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self.attn_dtype = torch.float32 if half_on_cpu else dtype  # the cache's dtype
        self._rows = torch.arange(max_batch_size, device=self.device)

    def resize(self, capacity: int) -> None:
        """RoPE tables of positions 0 .. capacity - 1 exactly as HF's rotary embedding computes them (fp32,
        then the model dtype); rotate_half's sign is folded into sin so that q_rot = q * cos + roll(q, D/2) * sin."""
        w = self.weights
        freqs = torch.arange(capacity, device=self.device, dtype=torch.float32)[:, None] * \
            w.inv_freq.to(self.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = w.head_dim // 2
        self._cos = (emb.cos() * w.rope_scaling).to(self.dtype)  # [capacity, D]
        sin = (emb.sin() * w.rope_scaling).to(self.dtype)
        sin[:, :half] = -sin[:, :half]
        self._sin = sin
        self._arange = torch.arange(capacity, device=self.device)

    def __call__(self, ids: torch.Tensor, start: Sequence[int], keep: Optional[torch.Tensor],
                 tree: Optional[tuple], counts: Optional[Sequence[int]], cache_rows: Optional[torch.Tensor],
                 cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """ids [B, T]; row b's token t stored at start[b] + t, the first counts[b] (default T) of them real.
        cache_rows [B] int64: the cache row of each batch row (start_rows); None: rows 0..B-1.
        Chain (tree None): at position start[b] + t, seeing positions <= start[b] + t. Tree (ancestors
        [B, T, T] bool, depth [B, T] int64; see trees.token_tree_inputs): at position start[b] + depth[b, t],
        seeing the prefix and its ancestors. cache: [k_cache, v_cache] [layers, Bmax, Hk, capacity, D],
        written at the stored slots; with ``taps``, ``tapped`` holds the inputs of those layers afterwards.
        keep: None (logits of every token, [B, T, V]) or column indices [B]
        ([B, V]). fp32 logits."""
        B, T = ids.shape
        S = max(start) + T
        step = _Step(self, B, T, S)
        step.place(start, tree, counts, cache_rows)
        x = F.embedding(ids, self.weights.embed)  # [B, T, d]
        inputs = {}
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.weights.layers, cache[0], cache[1])):
            inputs[i] = x
            x = step.layer(layer, x, k_cache, v_cache)
        self.tapped = None if self.taps is None else [inputs[i] for i in self.taps]
        if keep is not None:
            x = x[self._rows[:B], keep]  # [B, d]
        x = _rms(x, self.weights.norm, self.weights.norm_eps)
        head = self.head
        if (head._forward_pre_hooks or head._forward_hooks) and head_hooked(head):  # e.g. heads on the target
            return head(x.to(head.weight.dtype)).float()
        return F.linear(x, self.weights.head.weight, self.weights.head.bias).float()


class _Step:
    """One forward's positions, mask and cache slots, then its layers."""

    def __init__(self, forward: TorchForward, B: int, T: int, S: int):
        self.f, self.B, self.T, self.S = forward, B, T, S

    def place(self, start: Sequence[int], tree: Optional[tuple], counts: Optional[Sequence[int]],
              cache_rows: Optional[torch.Tensor]) -> None:
        f, B, T, S = self.f, self.B, self.T, self.S
        self.uniform = tree is None and all(s == start[0] for s in start)
        # a slice keeps the cache a view; an index (rows joining a running batch) gathers a copy
        self.rows_of_cache = slice(0, B) if cache_rows is None else cache_rows
        if self.uniform:  # every row at the same position: one shared [T, S] mask (or none)
            s0 = self.s0 = start[0]
            self.cos, self.sin = f._cos[s0:S], f._sin[s0:S]  # [T, D]
            if T == 1:
                self.mask, self.causal = None, False
            elif s0 == 0:
                self.mask, self.causal = None, True  # square causal (top-left == bottom-right alignment)
            else:
                visible = f._arange[None, :S] <= f._arange[s0:S, None]  # [T, S]
                self.mask, self.causal = additive_mask(visible[None], f.attn_dtype)[0, 0], False
            return
        lengths = torch.tensor(start, dtype=torch.int64, device=f.device)
        num_tokens = torch.tensor(counts if counts is not None else [T] * B, dtype=torch.int64, device=f.device)
        layout = step_layout(lengths, num_tokens, T, S, f._arange, tree=tree)
        self.store, pos = layout.storage, layout.positions  # [B, T]
        self.cos, self.sin = f._cos[pos].unsqueeze(1), f._sin[pos].unsqueeze(1)  # [B, 1, T, D]
        self.mask, self.causal = additive_mask(layout.visible, f.attn_dtype), False
        self.rows = (f._rows[:B] if cache_rows is None else cache_rows)[:, None]  # [B, 1]

    def layer(self, w: LlamaLayerWeights, x: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] after the layer ``w``, its k and v written into kc, vc [Bmax, Hk, cap, D]."""
        f, B, T, S = self.f, self.B, self.T, self.S
        H, Hk, D = f.weights.heads, f.weights.kv_heads, f.weights.head_dim
        half = D // 2
        h = _rms(x, w.input_norm, w.input_norm_eps)
        q = F.linear(h, w.q.weight, w.q.bias).view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = F.linear(h, w.k.weight, w.k.bias).view(B, T, Hk, D)
        v = F.linear(h, w.v.weight, w.v.bias).view(B, T, Hk, D)
        cos, sin = self.cos, self.sin
        q = q * cos + q.roll(half, -1) * sin
        k = k.transpose(1, 2)  # [B, Hk, T, D]
        k = k * cos + k.roll(half, -1) * sin
        rows_of_cache = self.rows_of_cache
        if self.uniform:
            kc[rows_of_cache, :, self.s0:S] = k.to(kc.dtype)
            vc[rows_of_cache, :, self.s0:S] = v.transpose(1, 2).to(vc.dtype)
        else:
            kc[self.rows, :, self.store] = k.transpose(1, 2).to(kc.dtype)
            vc[self.rows, :, self.store] = v.to(vc.dtype)
        a = F.scaled_dot_product_attention(q.to(kc.dtype), kc[rows_of_cache, :, :S], vc[rows_of_cache, :, :S],
                                           attn_mask=self.mask, is_causal=self.causal, scale=f.weights.scale,
                                           enable_gqa=f.gqa).to(f.dtype)  # [B, H, T, D]
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), w.o.weight, w.o.bias)
        h = _rms(x, w.post_norm, w.post_norm_eps)
        return x + F.linear(F.silu(F.linear(h, w.gate.weight, w.gate.bias)) * F.linear(h, w.up.weight, w.up.bias),
                            w.down.weight, w.down.bias)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()  # HF: normalise in fp32, cast back, then scale in the model dtype
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
