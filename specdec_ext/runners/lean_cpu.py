"""The lean runner's forward on the CPU kernels (specdec_ext.ops.lean_forward, csrc/cpu): what
``LeanLlamaRunner`` runs on the CPU unless ``SPECDEC_CPU_KERNELS=0``.

Why: torch's CPU bf16 linear streams a small model's weights at about 8 GB/s, a third of this
class of machine's memory bandwidth, and a decoder layer costs some 30 torch calls of a few
microseconds each; here each weight is read once per pass for all its rows near the bandwidth
(BENCHMARKS.md, issue 18), a layer is six kernels (RMSNorm + q/k/v, rotary + cache write, attention
over the cache, o_proj + residual, RMSNorm + gate/up + SwiGLU, down_proj + residual) and the whole
stack one op call (``ops.decoder_layers``), then the final norm + head; a greedy draft of k tokens
is one op call too (``ops.greedy_chain``: the k - 1 one-token passes and their argmaxes).

Numerics: the residual stream, the projections' outputs and attention are fp32; the activations that
enter a projection are rounded to bf16 for a bf16 model computed in its own dtype (as HF's bf16 forward
rounds them; the products are exact, the sums fp32), left in fp32 otherwise (an fp32 model, a bf16 or
fp16 model computed in fp32: its weights are read as they are and widened exactly, no fp32 copy). The
cache holds the model-dtype keys and values (bf16 or fp16, fp32 when computing in fp32). Every kernel
gives a row the same result whatever else is in the pass, so a chain or tree verification pass
reproduces one-token passes bit for bit: greedy speculative decoding equals greedy plain decoding.
The head too when something is hooked on it (heads on the target read its input): the kernel computes
the logits and the hooks are called around them (``call_head_hooks``), never torch's head, whose
half-precision GEMM differs with the number of rows.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import ops as _ops  # noqa: F401  (registers the fake kernels beside the ops)

__all__ = ["kernels_reason", "CpuKernelForward", "WEIGHT_DTYPES", "call_head_hooks"]

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 512  # csrc/lean_forward.h


def kernels_reason(device: torch.device, weight_dtype: torch.dtype, compute_dtype: torch.dtype,
                   head_dim: int) -> Optional[str]:
    """None when the lean runner's forward runs on the CPU kernels; else why not (a short sentence)."""
    if device.type != "cpu":
        return f"the model is on {device.type}, the kernels are CPU only"
    if os.environ.get("SPECDEC_CPU_KERNELS", "1") == "0":
        return "SPECDEC_CPU_KERNELS=0"
    if weight_dtype not in WEIGHT_DTYPES:
        return f"weights in {weight_dtype}"
    if compute_dtype not in (torch.float32, weight_dtype):
        return f"compute dtype {compute_dtype} for {weight_dtype} weights"
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (the kernels take an even head_dim up to {MAX_HEAD_DIM})"
    return None


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # norms and biases in fp32 once, so that the op never converts them per call
    return None if t is None else t.detach().float().contiguous()


def _biases(*biases) -> List[Optional[torch.Tensor]]:
    return [] if all(b is None for b in biases) else [_f32(b) for b in biases]


def call_head_hooks(head: torch.nn.Module, h: torch.Tensor, logits: torch.Tensor) -> None:
    """Call the LM head's forward pre-hooks and forward hooks as ``head(h)`` would, around logits that the
    kernel computed: a hooked head must give an unhooked head's numbers, or a target with heads on it would
    not reproduce its own plain decoding (torch's half-precision GEMM differs with the number of rows). A
    hook that replaces the head's input or output is refused: the kernel has already computed the head.

    Shape: h [..., d] in the head's dtype, logits [..., V] fp32.
    """
    for hook_id, hook in list(head._forward_pre_hooks.items()):
        with_kwargs = hook_id in head._forward_pre_hooks_with_kwargs
        replaced = hook(head, (h,), {}) if with_kwargs else hook(head, (h,))
        if replaced is not None:
            raise RuntimeError(f"{hook!r}, a forward pre-hook on the LM head, returned a new input; the CPU "
                               "kernels compute the head themselves (SPECDEC_CPU_KERNELS=0 runs the torch forward, "
                               "which calls the head module)")
    for hook_id, hook in list(head._forward_hooks.items()):
        with_kwargs = hook_id in head._forward_hooks_with_kwargs
        replaced = hook(head, (h,), {}, logits) if with_kwargs else hook(head, (h,), logits)
        if replaced is not None:
            raise RuntimeError(f"{hook!r}, a forward hook on the LM head, returned a new output; the CPU kernels "
                               "compute the head themselves (SPECDEC_CPU_KERNELS=0 runs the torch forward, which "
                               "calls the head module)")


class CpuKernelForward:
    """The forward of a ``LeanLlamaRunner`` on the CPU kernels; reads the runner's weights and cache."""

    def __init__(self, runner):
        self.runner = runner
        # bf16 activations for a bf16 model computed in bf16 (VDPBF16PS where the CPU has it)
        self.bf16 = runner.dtype == torch.bfloat16 and runner.embed.dtype == torch.bfloat16
        # decoder_layers' flat lists (ops.LAYER_WEIGHTS / LAYER_BIASES / LAYER_NORM_EPS per layer)
        self.weights: List[torch.Tensor] = []
        biases: List[Optional[torch.Tensor]] = []
        self.norm_eps: List[float] = []
        for (w_in, eps_in, (wq, bq), (wk, bk), (wv, bv), (wo, bo), w_post, eps_post, (wg, bg), (wu, bu),
             (wd, bd)) in runner.layers:
            self.weights += [_f32(w_in), wq, wk, wv, wo, _f32(w_post), wg, wu, wd]
            biases += [bq, bk, bv, bo, bg, bu, bd]
            self.norm_eps += [eps_in, eps_post]
        self.biases = _biases(*biases)
        self.norm_weight = _f32(runner.norm_weight)
        self.head_bias = _biases(runner.head_bias)
        self._layers = torch.ops.specdec_ext.decoder_layers.default  # bound once
        self._linear = torch.ops.specdec_ext.fused_linear.default
        self.tables(runner.capacity)

    def tables(self, capacity: int) -> None:
        """fp32 rotary tables [capacity, D/2] as HF's rotary embedding computes them (fp32)."""
        r = self.runner
        freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * r._inv_freq.cpu()
        self.cos = (freqs.cos() * r._rope_scaling).contiguous()
        self.sin = (freqs.sin() * r._rope_scaling).contiguous()

    def __call__(self, ids: torch.Tensor, start: Sequence[int], keep: Optional[torch.Tensor],
                 tree: Optional[tuple], counts: Optional[Sequence[int]],
                 cache_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LeanLlamaRunner._model's contract: ids [B, T] at slots start[b] + t (positions start[b] + t, or
        start[b] + depth for a tree, seeing the ancestors) of cache rows cache_rows [B] (None: 0..B-1,
        else rows joining a running batch); fp32 logits [B, T, V] or [B, V] at keep."""
        r = self.runner
        B, T = ids.shape
        M = B * T
        begin = torch.tensor(start, dtype=torch.int64)
        slots = (begin[:, None] + torch.arange(T, dtype=torch.int64)).reshape(M)
        if tree is None:
            positions, visible = slots, None
        else:
            ancestors, depth = tree
            positions = (begin[:, None] + depth.to(torch.int64)).reshape(M)
            visible = ancestors.contiguous()
        cache_row = torch.arange(B, dtype=torch.int64) if cache_rows is None else cache_rows.to("cpu", torch.int64)
        x = F.embedding(ids.reshape(M), r.embed).float()  # [M, d], the residual stream
        self._layers(x, self.weights, self.biases, self.norm_eps, self.bf16, self.cos, self.sin, positions,
                     cache_row.repeat_interleave(T), slots, r.k_cache, r.v_cache, begin, visible, r.scale)
        if keep is not None:
            x = x.view(B, T, -1)[torch.arange(B), keep]  # [B, d]
        logits = torch.empty((x.shape[0], r.head_weight.shape[0]))  # [M or B, V]
        self._linear(x, self.norm_weight, r.norm_eps, [r.head_weight], self.head_bias, "store", self.bf16, [logits])
        shaped = (lambda t: t) if keep is not None else (lambda t: t.view(B, T, -1))
        if self.head_hooked():
            head = r.model.lm_head
            h = F.rms_norm(x, self.norm_weight.shape, self.norm_weight, r.norm_eps).to(head.weight.dtype)
            call_head_hooks(head, shaped(h), shaped(logits))
        return shaped(logits)

    def head_hooked(self) -> bool:
        """Whether something reads the head's input (e.g. heads on the target): its hooks are then called."""
        head = self.runner.model.lm_head
        return bool(head._forward_pre_hooks or head._forward_hooks)

    def greedy_chain(self, tokens: torch.Tensor, steps: int, start: Sequence[int], vocab_limit: int,
                     check_logits: bool = False, feed: Optional[torch.Tensor] = None,
                     feed_counts: Optional[torch.Tensor] = None) -> None:
        """ops.greedy_chain over this runner's weights and cache rows 0..B-1: tokens [B, n] int64 (column 0
        given, or the argmax after feed [B, W] at slots start[b] ..), fed at slots start[b] (+ feed_counts[b])
        .. start[b] (+ feed_counts[b]) + steps - 2."""
        r = self.runner
        B = tokens.shape[0]
        torch.ops.specdec_ext.greedy_chain(
            tokens, steps, r.embed, self.weights, self.biases, self.norm_eps, self.bf16, self.cos, self.sin,
            torch.arange(B, dtype=torch.int64), r.k_cache, r.v_cache, torch.tensor(start, dtype=torch.int64), r.scale,
            self.norm_weight, r.norm_eps, r.head_weight, self.head_bias[0] if self.head_bias else None, vocab_limit,
            check_logits, None if feed is None else feed.to("cpu", torch.int64).contiguous(), feed_counts)
