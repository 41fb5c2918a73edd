"""The EAGLE-3 head's chain passes on the project's CPU kernels (ops/lean_forward.py): batch-invariant and
each weight read once per pass.

A chain pass is a block of T tokens per row at cache slots start[b] .. start[b] + T - 1 (rotary positions
the same), seeing the row's earlier slots and the block causally: the drafter's feed of the target's
features and each chain draft step. On the kernels a row's result does not depend on what else is in the
pass (``fused_linear``, ``rope_cache_write``, ``cache_attention`` are row-wise and fixed-order), so a
seeded sample's drafts, and with them its tokens, do not depend on the batch, as for a draft model on the
lean runner (docs/architecture.md, "Randomness"). Elsewhere (off the CPU, a float64 copy, training) the
same pass runs in torch (``Eagle3Model.step`` with a causal visibility). The head's trees always run in
torch (a frontier node sees its ancestors only, which ``cache_attention``'s prefix-plus-block model does
not express).

    x = [input_layernorm(embed(token)); hidden_norm(g)]      torch, row-wise
    q, k, v = x W                                              fused_linear (one read of the three weights)
    rope, cache write                                          rope_cache_write
    attention over the row's slots < start + t + 1             cache_attention
    out = residual + o(attn)                                   fused_linear, "add"
    out += down(silu(gate(n2(out))) * up(n2(out)))             fused_linear "swiglu" with the norm, then "add"
    draft logits = lm_head(norm(out))                          fused_linear with the final norm

A greedy chain's steps (head, argmax, the d2t map, the next token's layer pass) run in one op call,
``eagle_chain`` (``kernel_greedy_chain``): the ~25 Python calls of a step around the matrices cost as much
as the matrices (measured: a chain of four 3.2 ms, its matrix products 1.2 ms).

The kernels read the matrices in ``head.kernel_dtype`` (bf16 by default: copies cached while the weights
are unchanged, ``cached_cast``), with fp32 activations and fp32 accumulation.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

__all__ = ["kernels_apply", "kernel_block", "kernel_greedy_chain", "kernel_head"]


def kernels_apply(head) -> bool:
    """Whether ``head``'s chain passes run on the CPU kernels: fp32 weights on the CPU, not training, and
    the kernels not switched off (``SPECDEC_CPU_KERNELS=0``)."""
    import os
    weight = head.fc.weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not head.training
            and os.environ.get("SPECDEC_CPU_KERNELS", "1") != "0")


def _rope(head, capacity: int) -> List[torch.Tensor]:
    """[cos, sin] [capacity, D/2] fp32 (the attention scaling folded in), cached per capacity."""
    cached = head.__dict__.get("_rope_tables")
    if cached is None or cached[0].shape[0] < capacity:
        freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * head.inv_freq.float().cpu()
        cached = [(freqs.cos() * head.rope_scale).contiguous(), (freqs.sin() * head.rope_scale).contiguous()]
        head.__dict__["_rope_tables"] = cached
    return cached


def _matrices(head, *linears) -> List[torch.Tensor]:
    """The linears' weights as the kernels read them: in ``head.kernel_dtype`` (module docstring)."""
    from ..ops.lean_forward import cached_cast

    return [cached_cast(linear.weight, head.kernel_dtype) for linear in linears]


def _biases(*linears) -> Optional[list]:
    biases = [linear.bias for linear in linears]
    return None if all(b is None for b in biases) else biases


def kernel_block(head, tokens: torch.Tensor, g: torch.Tensor, start: torch.Tensor, cache) -> torch.Tensor:
    """The chain pass (module docstring) on the kernels: tokens [B, T], features g [B, T, h], start [B]
    int64; keys and values written into ``cache`` (EagleKV) rows 0..B-1. Returns the outputs [B, T, h]."""
    from ..ops.lean_forward import cache_attention, fused_linear, rope_cache_write

    c, layer = head.config, head.midlayer
    attn = layer.self_attn
    B, T = tokens.shape
    M, H, Hk, D = B * T, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = g.reshape(M, c.hidden_size).float()
    normed = F.rms_norm(g, layer.hidden_norm.weight.shape, layer.hidden_norm.weight, layer.hidden_norm.eps)
    residual = (normed if c.norm_before_residual else g).clone().contiguous()
    embed = F.embedding(tokens.reshape(M), head.embed_tokens.weight)
    embed = F.rms_norm(embed, layer.input_layernorm.weight.shape, layer.input_layernorm.weight,
                       layer.input_layernorm.eps)
    x = torch.cat([embed, normed], dim=-1).contiguous()  # [M, 2h]
    q, k, v = torch.empty((M, H * D)), torch.empty((M, Hk * D)), torch.empty((M, Hk * D))
    fused_linear(x, _matrices(head, attn.q_proj, attn.k_proj, attn.v_proj), [q, k, v],
                 biases=_biases(attn.q_proj, attn.k_proj, attn.v_proj))
    positions = (start[:, None].cpu() + torch.arange(T)).reshape(M)
    rows = torch.arange(B).repeat_interleave(T)
    cos, sin = _rope(head, cache.capacity)
    q = rope_cache_write(q.view(M, H, D), k.view(M, Hk, D), v.view(M, Hk, D), cos, sin, positions, rows, positions,
                         cache.k, cache.v)
    a = cache_attention(q.view(B, T, H, D), cache.k, cache.v, start.cpu().to(torch.int64).contiguous(), D ** -0.5)
    fused_linear(a.view(M, H * D), _matrices(head, attn.o_proj), [residual], biases=_biases(attn.o_proj), epilogue="add")
    mlp = layer.mlp
    act = torch.empty((M, c.intermediate_size))
    norm = layer.post_attention_layernorm
    fused_linear(residual, _matrices(head, mlp.gate_proj, mlp.up_proj), [act], norm_weight=norm.weight,
                 norm_eps=norm.eps, epilogue="swiglu")
    fused_linear(act, _matrices(head, mlp.down_proj), [residual], epilogue="add")
    return residual.view(B, T, c.hidden_size)


def kernel_head(head, out: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, V_d] of outputs [N, h] on the kernels (the final norm fused into lm_head)."""
    from ..ops.lean_forward import fused_linear

    logits = torch.empty((out.shape[0], head.config.draft_vocab_size))
    fused_linear(out.float().contiguous(), _matrices(head, head.lm_head), [logits], norm_weight=head.norm.weight,
                 norm_eps=head.norm.eps)
    return logits


def kernel_fuse(head, states: torch.Tensor) -> torch.Tensor:
    """fc of the tapped states [..., n * H_t] -> [..., h] on the kernels."""
    from ..ops.lean_forward import fused_linear

    flat = states.reshape(-1, states.shape[-1]).float().contiguous()
    out = torch.empty((flat.shape[0], head.config.hidden_size))
    fused_linear(flat, _matrices(head, head.fc), [out], biases=_biases(head.fc))
    return out.view(tuple(states.shape[:-1]) + (head.config.hidden_size,))


def _chain_weights(head):
    """The head as ``eagle_chain`` reads it: a one-layer LlamaWeights (the layer's input_norm is the
    embedding's), rebuilt only when a matrix copy changes (``cached_cast`` returns the same tensors while
    the weights are unchanged)."""
    from ..ops.lean_forward import Linear, LlamaLayerWeights, LlamaWeights

    layer, attn, mlp = head.midlayer, head.midlayer.self_attn, head.midlayer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
               head.lm_head)
    matrices = _matrices(head, *linears)
    key = tuple(id(m) for m in matrices) + (id(head.embed_tokens.weight),)
    cached = head.__dict__.get("_chain_weights")
    if cached is not None and cached[0] == key:
        return cached[1]
    q, k, v, o, gate, up, down, lm_head = (Linear(m, None if lin.bias is None else lin.bias.float())
                                           for m, lin in zip(matrices, linears))
    c = head.config
    weights = LlamaWeights(
        embed=head.embed_tokens.weight.detach(),
        layers=(LlamaLayerWeights(layer.input_layernorm.weight.detach().float(), layer.input_layernorm.eps, q, k, v,
                                  o, layer.post_attention_layernorm.weight.detach().float(),
                                  layer.post_attention_layernorm.eps, gate, up, down),),
        norm=head.norm.weight.detach().float(), norm_eps=head.norm.eps, head=lm_head,
        inv_freq=head.inv_freq, rope_scaling=head.rope_scale, heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
    head.__dict__["_chain_weights"] = (key, weights, matrices)  # (the copies kept alive with their ids)
    return weights


def kernel_greedy_chain(head, tokens: torch.Tensor, steps: int, last: torch.Tensor, start: torch.Tensor,
                        cache, feed=None) -> torch.Tensor:
    """The greedy chain on the kernels in one ``eagle_chain`` call: tokens[:, :steps] (target ids) drafted
    from the layer outputs ``last`` [B, h] at slots start[b] .. (int64 [B]); the fed tokens' keys and values
    written into ``cache`` (EagleKV) rows 0..B-1. tokens [B, n] int64 contiguous. ``feed``: (tokens [B, W],
    features g [B, W, h], counts [B]), a feed pass first at slots start[b] ..; ``last`` [B] then holds each
    fed row's output at its last fed position, and its chain starts count positions later."""
    from ..ops.lean_forward import EagleLayerExtras, eagle_chain

    layer = head.midlayer
    cos, sin = _rope(head, cache.capacity)
    extras = EagleLayerExtras(layer.hidden_norm.weight.detach().float(), layer.hidden_norm.eps,
                              head.config.norm_before_residual, head.target_ids.contiguous())
    buffer = last if last.dtype == torch.float32 and last.is_contiguous() else last.float().contiguous()
    if feed is not None:
        feed = (feed[0].contiguous(), feed[1].float().contiguous(), feed[2].to(torch.int64).contiguous())
    eagle_chain(tokens, steps, buffer, _chain_weights(head), extras, [cos, sin], [cache.k[None], cache.v[None]],
                start.to(torch.int64).contiguous(), feed)
    if buffer is not last:
        last.copy_(buffer)
    return tokens
