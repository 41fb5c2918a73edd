"""When the lean runner's forward runs on the CPU kernels (specdec_ext.ops.lean_forward, csrc/cpu), and
how the kernels' forward calls a hooked LM head's hooks: what ``LeanLlamaRunner`` reads at construction
(``kernels_reason``) and, only when something is hooked on the head, per pass (``call_head_hooks``). The
kernels' forward itself is ``LeanLlamaRunner._kernel_forward`` / ``greedy_chain`` (runners/lean.py) over
the runner's ``LlamaWeights`` and cache, unless ``SPECDEC_CPU_KERNELS=0``.

Why: torch's CPU bf16 linear streams a small model's weights at about 8 GB/s, a third of this
class of machine's memory bandwidth, and a decoder layer costs some 30 torch calls of a few
microseconds each; there each weight is read once per pass for all its rows near the bandwidth
(BENCHMARKS.md, issue 18), a layer is six kernels (RMSNorm + q/k/v, rotary + cache write, attention
over the cache, o_proj + residual, RMSNorm + gate/up + SwiGLU, down_proj + residual) and the whole
stack one op call (``ops.decoder_layers``), then the final norm + head (``ops.llama_head``); a greedy
draft of k tokens is one op call too (``ops.greedy_chain``: the k - 1 one-token passes and their argmaxes).

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
from typing import Optional

import torch

from .head_hooks import foreign_capture

__all__ = ["kernels_reason", "WEIGHT_DTYPES", "call_head_hooks"]

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


def call_head_hooks(head: torch.nn.Module, h: torch.Tensor, logits: torch.Tensor) -> None:
    """Call the LM head's forward pre-hooks and forward hooks as ``head(h)`` would, around logits that the
    kernel computed: a hooked head must give an unhooked head's numbers, or a target with heads on it would
    not reproduce its own plain decoding (torch's half-precision GEMM differs with the number of rows). A
    hook that replaces the head's input or output is refused: the kernel has already computed the head.

    Shape: h [..., d] in the head's dtype, logits [..., V] fp32.
    """
    for hook_id, hook in list(head._forward_pre_hooks.items()):
        if foreign_capture(hook):  # (another thread's heads: runners/head_hooks.py)
            continue
        with_kwargs = hook_id in head._forward_pre_hooks_with_kwargs
        replaced = hook(head, (h,), {}) if with_kwargs else hook(head, (h,))
        if replaced is not None:
            raise RuntimeError(f"{hook!r}, a forward pre-hook on the LM head, returned a new input; the CPU "
                               "kernels compute the head themselves (SPECDEC_CPU_KERNELS=0 runs the torch forward, "
                               "which calls the head module)")
    for hook_id, hook in list(head._forward_hooks.items()):
        with_kwargs = hook_id in head._forward_hooks_with_kwargs
        replaced = hook(head, (h,), {}, logits) if with_kwargs else hook(head, (h,), logits)
        if replaced is not None and replaced is not logits:  # (the output, changed in place or replaced)
            if not isinstance(replaced, torch.Tensor) or replaced.shape != logits.shape:
                raise RuntimeError(f"{hook!r}, a forward hook on the LM head, returned "
                                   f"{getattr(replaced, 'shape', type(replaced).__name__)} for logits of shape "
                                   f"{tuple(logits.shape)}")
            logits.copy_(replaced)
