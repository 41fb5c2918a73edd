"""The lean runner's CPU forward ops: fused_linear, rope_cache_write, cache_attention, decoder_layers,
greedy_chain, cpu_isa (typed wrappers and fake kernels).

CPU only. The kernels (csrc/cpu/small_gemm.h, fused_linear.h, rope_cache.h, attention.h) read each
weight once per call for all the rows of a pass, accumulate in fp32 and give every row the same
result whatever else is in the pass (batch invariance: a verification pass reproduces a one-token
pass bit for bit). ``SPECDEC_CPU_ISA=avx512bf16|avx2|neon|portable`` forces an instruction-set path (read
at every call); ``cpu_isa()`` says which one a call takes now. The contract is csrc/lean_forward.h.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)

EPILOGUES = ("store", "add", "swiglu")
# The ops of this module: registered for CPU only (a CUDA build has no kernel for them, by design;
# tools/cuda_compile_check.sh requires a CUDA kernel for every other op).
CPU_ONLY_OPS = ("cache_attention", "cpu_isa", "decoder_layers", "fused_linear", "greedy_chain", "rope_cache_write")
LAYER_WEIGHTS = ("input_norm", "q", "k", "v", "o", "post_attention_norm", "gate", "up", "down")  # per layer, in order
LAYER_BIASES = ("q", "k", "v", "o", "gate", "up", "down")
LAYER_NORM_EPS = ("input_norm", "post_attention_norm")


def fused_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    epilogue: str = "store",
    bf16_activations: bool = False,
) -> Sequence[torch.Tensor]:
    """Projections of the rows ``x`` by one or more weights, each weight read once for all rows.

    ``A = RMSNorm(x) * norm_weight`` (when ``norm_weight`` is given, else ``A = x``), rounded to bf16
    when ``bf16_activations``; then per epilogue: ``"store"``: ``outs[i] = A W_i^T + b_i``;
    ``"add"``: ``outs[i] += A W_i^T + b_i``; ``"swiglu"`` (weights = (gate, up), one output):
    ``outs[0] = silu(A Wg^T + bg) * (A Wu^T + bu)``. Products accumulate in fp32.

    Parameters
    ----------
    x : torch.Tensor
        The rows of the pass, fp32 contiguous.
        Shape: [M, K]
    weights : sequence of torch.Tensor
        W_i, one dtype for all (fp32, bf16 or fp16), contiguous; two of one shape for "swiglu".
        Shape: [N_i, K]
    outs : sequence of torch.Tensor
        fp32 contiguous outputs, one per weight (one for "swiglu"); written or accumulated into.
        Shape: [M, N_i]
    biases : sequence of (torch.Tensor or None), optional
        One entry per weight (fp32, bf16 or fp16), or None for no biases.
        Shape: [N_i]
    norm_weight : torch.Tensor, optional
        RMSNorm scale (fp32, bf16 or fp16).
        Shape: [K]
    norm_eps : float
        RMSNorm epsilon.
    epilogue : str
        "store", "add" or "swiglu".
    bf16_activations : bool
        Round A to bf16 before the products (a bf16 model's activations; bf16 weights only).

    Returns
    -------
    sequence of torch.Tensor
        ``outs``.
        Shape: [M, N_i]
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"fused_linear: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    torch.ops.specdec_ext.fused_linear(x, norm_weight, float(norm_eps), list(weights),
                                       [] if biases is None else list(biases), epilogue, bool(bf16_activations),
                                       list(outs))
    return outs


def rope_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    cache_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of q (in place) and k, and the write of k and v into a contiguous cache.

    HF's default RoPE over the halves x1, x2 of each head: ``x1' = x1 c - x2 s``,
    ``x2' = x2 c + x1 s`` with ``c = cos[positions[m]]``, ``s = sin[positions[m]]``, in fp32; then
    ``k_cache[cache_rows[m], :, cache_positions[m]] = k'[m]`` and likewise v (rounded to the cache's dtype).

    Parameters
    ----------
    q : torch.Tensor
        Queries, fp32 with contiguous heads; rotated in place.
        Shape: [M, H, D]
    k, v : torch.Tensor
        Keys and values, fp32 with contiguous heads (k is not modified).
        Shape: [M, Hk, D]
    cos, sin : torch.Tensor
        fp32 tables of rotary positions 0 .. P-1 (attention scaling folded in).
        Shape: [P, D/2]
    positions : torch.Tensor
        Rotary position of each row, int64 in [0, P).
        Shape: [M]
    cache_rows, cache_positions : torch.Tensor
        Cache row and slot of each row, int64.
        Shape: [M]
    k_cache, v_cache : torch.Tensor
        One layer's cache (fp32, bf16 or fp16), written in place.
        Shape: [Bc, Hk, capacity, D]

    Returns
    -------
    torch.Tensor
        ``q``, rotated.
        Shape: [M, H, D]
    """
    torch.ops.specdec_ext.rope_cache_write(q, k, v, cos, sin, positions, cache_rows, cache_positions, k_cache,
                                           v_cache)
    return q


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    *,
    visible: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a block of T queries per row over the row's cache.

    Row b's block sits at cache slots ``start[b] .. start[b] + T - 1``; query (b, t) attends to the
    prefix (slots < start[b]) and the block tokens j with ``j <= t`` (``visible`` None: a chain) or
    ``visible[b, t, j]`` (a tree): ``softmax(scale * q K^T) V`` in fp32, keys in slot order.
    Head h reads kv head ``h // (H // Hk)``; row b reads cache row b.

    Parameters
    ----------
    q : torch.Tensor
        Queries (rotated), fp32 contiguous.
        Shape: [B, T, H, D]
    k_cache, v_cache : torch.Tensor
        One layer's cache (fp32, bf16 or fp16), Bc >= B.
        Shape: [Bc, Hk, capacity, D]
    start : torch.Tensor
        First slot of each row's block, int64; start[b] + T <= capacity.
        Shape: [B]
    scale : float
        Score scale (head_dim ** -0.5 for Llama).
    visible : torch.Tensor, optional
        Which block tokens each query sees, bool (None: causal).
        Shape: [B, T, T]
    out : torch.Tensor, optional
        fp32 contiguous output (allocated when None).
        Shape: [B, T, H, D]

    Returns
    -------
    torch.Tensor
        The attention output, fp32.
        Shape: [B, T, H, D]
    """
    if out is None:
        out = torch.empty_like(q)
    torch.ops.specdec_ext.cache_attention(q, k_cache, v_cache, start, visible, float(scale), out)
    return out


def decoder_layers(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    norm_eps: Sequence[float],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    cache_positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    *,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    visible: Optional[torch.Tensor] = None,
    bf16_activations: bool = False,
) -> torch.Tensor:
    """L Llama-family decoder layers in one call: per layer, what ``fused_linear`` (RMSNorm + q, k, v),
    ``rope_cache_write``, ``cache_attention``, ``fused_linear`` (o + residual), ``fused_linear``
    (RMSNorm + gate, up, SwiGLU) and ``fused_linear`` (down + residual) give, bit for bit, without a
    Python call per op.

    Parameters
    ----------
    x : torch.Tensor
        The residual stream of the B blocks of T tokens (M = B * T), fp32 contiguous; updated in place.
        Shape: [M, d]
    weights : sequence of torch.Tensor
        ``LAYER_WEIGHTS`` per layer: input norm, q, k, v, o, post-attention norm, gate, up, down.
        Shape: [d], [H*D, d], [Hk*D, d], [Hk*D, d], [d, H*D], [d], [I, d], [I, d], [d, I]
    norm_eps : sequence of float
        ``LAYER_NORM_EPS`` per layer: the input and post-attention norms' epsilons.
    k_cache, v_cache : torch.Tensor
        Every layer's cache (fp32, bf16 or fp16), written in place.
        Shape: [L, Bc, Hk, capacity, D]
    start : torch.Tensor
        First slot of each block, int64, as ``cache_attention``.
        Shape: [B]
    positions, cache_positions : torch.Tensor
        Rotary position and cache slot of each token, int64.
        Shape: [M]
    cache_rows : torch.Tensor
        Cache row of each token, int64; the T tokens of a block share one (batch row b reads cache row
        cache_rows[b * T]).
        Shape: [M]
    cos, sin : torch.Tensor
        As ``rope_cache_write``.
        Shape: [P, D/2]
    scale : float
        Attention score scale.
    biases : sequence of (torch.Tensor or None), optional
        ``LAYER_BIASES`` per layer (q, k, v, o, gate, up, down), or None for a model without biases.
        Shape: [N_i]
    visible : torch.Tensor, optional
        A tree's visibility, as ``cache_attention`` (None: causal).
        Shape: [B, T, T]
    bf16_activations : bool
        As ``fused_linear``.

    Returns
    -------
    torch.Tensor
        ``x``, after the layers.
        Shape: [M, d]
    """
    torch.ops.specdec_ext.decoder_layers(x, list(weights), [] if biases is None else list(biases),
                                         [float(e) for e in norm_eps], bool(bf16_activations), cos, sin, positions,
                                         cache_rows, cache_positions, k_cache, v_cache, start, visible, float(scale))
    return x


def greedy_chain(
    tokens: torch.Tensor,
    steps: int,
    embed: torch.Tensor,
    weights: Sequence[torch.Tensor],
    norm_eps: Sequence[float],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    cache_rows: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    norm_weight: torch.Tensor,
    final_norm_eps: float,
    head_weight: torch.Tensor,
    *,
    head_bias: Optional[torch.Tensor] = None,
    vocab_limit: Optional[int] = None,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    bf16_activations: bool = False,
    check_logits: bool = False,
    feed: Optional[torch.Tensor] = None,
    feed_counts: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A greedy draft chain in one call: for i = 1 .. steps - 1, the one-token pass of tokens[:, i - 1]
    (embedding, ``decoder_layers``, final RMSNorm + head by ``fused_linear``) at slot start[b] + i - 1,
    and tokens[:, i] = its logits' argmax, bit for bit what those calls and ``torch.argmax`` give one
    step at a time. The fed tokens' keys and values are in the caches afterwards.

    With ``feed``, a first pass feeds each row's block of committed tokens (the draft's unseen ones) and
    gives tokens[:, 0] (the argmax at the row's last real column); the chain then starts at slot
    start[b] + feed_counts[b]: bit for bit a ``decoder_layers`` pass over the block, the head and
    ``torch.argmax``, then the chain.

    Parameters
    ----------
    tokens : torch.Tensor
        int64, contiguous; column 0 given (each row's first draft token; with ``feed``: written), columns
        1 .. steps - 1 written.
        Shape: [B, n]
    steps : int
        Tokens per row in the chain, 1 <= steps <= n (steps - 1 passes).
    embed : torch.Tensor
        The input embedding (fp32, bf16 or fp16).
        Shape: [V_in, d]
    weights, norm_eps, biases, bf16_activations, cos, sin, scale, k_cache, v_cache
        As ``decoder_layers``.
        Shape: as ``decoder_layers``
    start : torch.Tensor
        int64: each row's first free slot (its committed length); start[b] + W <= capacity and
        start[b] + feed_counts[b] + steps - 1 <= capacity (W, feed_counts = 0 without a feed).
        Shape: [B]
    cache_rows : torch.Tensor
        int64: each row's cache row.
        Shape: [B]
    norm_weight : torch.Tensor
        The final RMSNorm's weight.
        Shape: [d]
    final_norm_eps : float
        Its epsilon.
    head_weight : torch.Tensor
        The LM head.
        Shape: [V_out, d]
    head_bias : torch.Tensor, optional
        Shape: [V_out]
    vocab_limit : int, optional
        The argmax reads logits [:vocab_limit] (default V_out): the target's vocabulary when it is smaller.
    check_logits : bool
        A target's greedy decoding: logits with a NaN or +inf, or all -inf, raise ``ValueError`` naming
        the row (``chain_verify``'s check) instead of giving an argmax (a NaN's index, as torch.argmax).
    feed : torch.Tensor, optional
        int64, contiguous: tokens fed in one pass before the chain, at slots start[b] .. start[b] + W - 1
        (a row's columns from feed_counts[b] on are padding: written past its tokens, then overwritten).
        Shape: [B, W]
    feed_counts : torch.Tensor, optional
        int64 in [1, W], with ``feed``: each row's real columns.
        Shape: [B]

    Returns
    -------
    torch.Tensor
        ``tokens``.
        Shape: [B, n]
    """
    limit = head_weight.shape[0] if vocab_limit is None else int(vocab_limit)
    torch.ops.specdec_ext.greedy_chain(tokens, int(steps), embed, list(weights), [] if biases is None else list(biases),
                                       [float(e) for e in norm_eps], bool(bf16_activations), cos, sin, cache_rows,
                                       k_cache, v_cache, start, float(scale), norm_weight, float(final_norm_eps),
                                       head_weight, head_bias, limit, bool(check_logits), feed, feed_counts)
    return tokens


def cpu_isa() -> str:
    """The instruction-set path the CPU forward kernels take now: ``"avx512bf16"``, ``"avx2"``,
    ``"neon"`` or ``"portable"`` (``SPECDEC_CPU_ISA`` when set, else the best this CPU runs)."""
    return torch.ops.specdec_ext.cpu_isa()


# Fake kernels: the ops write their outputs in place and return nothing.
@torch.library.register_fake("specdec_ext::fused_linear")
def _fused_linear_fake(x, norm_weight, norm_eps, weights, biases, epilogue, bf16_activations, outs):
    return None


@torch.library.register_fake("specdec_ext::rope_cache_write")
def _rope_cache_write_fake(q, k, v, cos, sin, positions, cache_rows, cache_positions, k_cache, v_cache):
    return None


@torch.library.register_fake("specdec_ext::cache_attention")
def _cache_attention_fake(q, k_cache, v_cache, start, visible, scale, out):
    return None


@torch.library.register_fake("specdec_ext::decoder_layers")
def _decoder_layers_fake(x, weights, biases, norm_eps, bf16_activations, cos, sin, positions, cache_rows,
                         cache_positions, k_cache, v_cache, start, visible, scale):
    return None


@torch.library.register_fake("specdec_ext::greedy_chain")
def _greedy_chain_fake(tokens, steps, embed, weights, biases, norm_eps, bf16_activations, cos, sin, cache_rows,
                       k_cache, v_cache, start, scale, norm_weight, final_norm_eps, head_weight, head_bias,
                       vocab_limit, check_logits=False, feed=None, feed_counts=None):
    return None
