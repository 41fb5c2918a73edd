"""The lean runner's CPU forward ops: fused_linear, rope_cache_write, cache_attention, decoder_layers,
greedy_chain, cpu_isa (typed wrappers and fake kernels), and the model they read: ``LlamaWeights``.

CPU only. The kernels (csrc/cpu/small_gemm.h, fused_linear.h, rope_cache.h, attention.h) read each
weight once per call for all the rows of a pass, accumulate in fp32 and give every row the same
result whatever else is in the pass (batch invariance: a verification pass reproduces a one-token
pass bit for bit). ``SPECDEC_CPU_ISA=amxbf16|avx512bf16|avx2|neon|portable`` forces an instruction-set path
(read at every call); ``cpu_isa()`` says which one a call takes now. The contract is csrc/lean_forward.h.

``LlamaWeights`` (with ``LlamaLayerWeights`` and ``Linear``) names a Llama-family model's tensors by
field; the lean runner builds it once from the HF model and both of its forwards read it (the torch
one in runners/lean_torch.py, the kernels through ``decoder_layers`` / ``greedy_chain`` / ``llama_head``).
Its ``flat()`` is the one place that writes the ops' order of the model's tensors (csrc/lean_forward.h);
the C++ side reads them back by name (``LlamaModelView``).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .fake_checks import check_operand_devices

EPILOGUES = ("store", "add", "swiglu")
# The ops of this module: registered for CPU only (a CUDA build has no kernel for them, by design;
# tools/cuda_compile_check.sh requires a CUDA kernel for every other op).
CPU_ONLY_OPS = ("cache_attention", "cpu_isa", "decoder_layers", "eagle_chain", "fused_linear", "greedy_chain",
                "rope_cache_write")

# Bound once: the runner calls these at every pass (an attribute walk through torch.ops costs a little each time).
_FUSED_LINEAR = torch.ops.specdec_ext.fused_linear.default
_DECODER_LAYERS = torch.ops.specdec_ext.decoder_layers.default
_GREEDY_CHAIN = torch.ops.specdec_ext.greedy_chain.default
_EAGLE_CHAIN = torch.ops.specdec_ext.eagle_chain.default


@dataclass(frozen=True, eq=False)
class Linear:
    """A projection ``y = x W^T + b``. Shape: weight [N, K], bias [N] or None."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None


@dataclass(frozen=True, eq=False)
class LlamaLayerWeights:
    """One Llama-family decoder layer: ``x += o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))``,
    ``x += down(silu(gate(n2(x))) * up(n2(x)))`` with n1, n2 the RMSNorms ``input_norm``, ``post_norm``.
    Shapes: input_norm, post_norm [d]; q [H*D, d]; k, v [Hk*D, d]; o [d, H*D]; gate, up [I, d]; down [d, I]."""

    input_norm: torch.Tensor
    input_norm_eps: float
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    post_norm: torch.Tensor
    post_norm_eps: float
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True, eq=False)
class LlamaWeights:
    """A Llama-family causal LM as its forward reads it: the embedding, the layers, the final RMSNorm,
    the LM head, default RoPE (``inv_freq`` [D/2] fp32, times ``rope_scaling``) and the attention heads.
    Shapes: embed [V_in, d]; norm [d]; head [V_out, d] (bias [V_out] or None); H = heads,
    Hk = kv_heads, D = head_dim. The tensors are the model's own or copies in the dtype its forward
    computes in; for the kernels, the norms and biases in fp32 (the ops convert others at every call)."""

    embed: torch.Tensor
    layers: Tuple[LlamaLayerWeights, ...]
    norm: torch.Tensor
    norm_eps: float
    head: Linear
    inv_freq: torch.Tensor
    rope_scaling: float
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        """The attention's score scale (head_dim ** -0.5, as HF's Llama attention)."""
        return self.head_dim ** -0.5

    def flat(self) -> Tuple[List[Optional[torch.Tensor]], List[float]]:
        """``decoder_layers`` / ``greedy_chain``'s ``weights`` and ``scalars`` (csrc/lean_forward.h), built
        on the first call and shared afterwards (do not change them):

        weights: embed; per layer input_norm, q.weight, q.bias, k.weight, k.bias, v.weight, v.bias,
        o.weight, o.bias, post_norm, gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias;
        then norm, head.weight, head.bias (biases may be None). scalars: per layer input_norm_eps,
        post_norm_eps; then norm_eps and ``scale``."""
        built = self.__dict__.get("_flat")
        if built is None:
            tensors: List[Optional[torch.Tensor]] = [self.embed]
            scalars: List[float] = []
            for w in self.layers:
                tensors += [w.input_norm, w.q.weight, w.q.bias, w.k.weight, w.k.bias, w.v.weight, w.v.bias,
                            w.o.weight, w.o.bias, w.post_norm, w.gate.weight, w.gate.bias, w.up.weight, w.up.bias,
                            w.down.weight, w.down.bias]
                scalars += [float(w.input_norm_eps), float(w.post_norm_eps)]
            tensors += [self.norm, self.head.weight, self.head.bias]
            scalars += [float(self.norm_eps), float(self.scale)]
            built = (tensors, scalars)
            object.__setattr__(self, "_flat", built)  # (frozen: the cache is not a field)
        return built


def rope_tables(weights: LlamaWeights, capacity: int) -> List[torch.Tensor]:
    """The kernels' rotary tables of positions 0 .. capacity - 1, as HF's rotary embedding computes them
    (fp32, attention scaling folded in): [cos, sin], ``rope`` of ``decoder_layers`` / ``greedy_chain``.

    Shape: [capacity, D/2] each."""
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * weights.inv_freq.cpu()
    return [(freqs.cos() * weights.rope_scaling).contiguous(), (freqs.sin() * weights.rope_scaling).contiguous()]


_CASTS = WeakIdKeyDictionary()  # weight -> ((version, data_ptr, dtype), copy, sampled elements, recheck epoch)
_FINGERPRINT_SAMPLES = 64  # elements of a weight compared once per recheck epoch (the C++ copies' count too)
_recheck_epoch = 0


def recheck_weights() -> None:
    """A new recheck epoch (a lean runner's construction, once per generation): the next use of each cached
    weight copy (``cached_cast``, and the CPU kernels' packed copies, csrc/cpu/packed_weights.h) compares
    sampled elements of the weight with those it was copied from. A write that the version counter does not
    see (through ``.data``: a LoRA merge, a fine-tuning step, a rescale) then makes a fresh copy; it served
    the stale one for good. A write that changes none of the 64 sampled elements (one row of a matrix, a few
    elements) is not seen: ``refresh_weights``."""
    global _recheck_epoch
    _recheck_epoch += 1
    _C.recheck_packed_weights()


def refresh_weights() -> None:
    """Drop every cached weight copy (``cached_cast``'s and the CPU kernels' packed ones): each is made again
    from the weight at its next use. For a write that neither the version counter nor the sampled elements
    see."""
    _CASTS.clear()
    _C.forget_packed_weights()


def packed_weight_bytes() -> int:
    """The bytes the CPU kernels' packed weight copies hold (each weight the kernels read is packed once in its
    path's layout, csrc/cpu/packed_weights.h; the copies of a collected model's weights are dropped after the
    next garbage collection that frees something, or a full one)."""
    return int(_C.packed_weight_bytes())


def _sweep_after_collection(phase: str, info: dict) -> None:
    """A gc callback: after a collection that freed something, or a full one (``gc.collect()``), drop the CPU
    kernels' packed copies of weights that are gone. Else a collected model's copies (its weights' size again)
    stayed until another weight was packed (measured: 91 MB after an fp32 bundled pair was deleted)."""
    if phase == "stop" and (info.get("collected") or info.get("generation") == 2):
        _C.sweep_packed_weights()


if _sweep_after_collection not in gc.callbacks:  # (a reload of this module registers it once)
    gc.callbacks.append(_sweep_after_collection)


def _sampled(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _FINGERPRINT_SAMPLES)][:_FINGERPRINT_SAMPLES].clone()


def cached_cast(weight: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``weight`` in ``dtype`` for the kernels (a contiguous copy where it differs), reused across callers
    while the weight is unchanged."""
    if weight is None:
        return None
    if weight.dtype == dtype and weight.is_contiguous():
        return weight.detach()
    key = (weight._version, weight.data_ptr(), dtype)
    hit = _CASTS.get(weight)
    if hit is not None and hit[0] == key:
        if hit[3] == _recheck_epoch:
            return hit[1]
        if torch.equal(_sampled(weight), hit[2]):
            _CASTS[weight] = (key, hit[1], hit[2], _recheck_epoch)
            return hit[1]
    copy = weight.detach().to(dtype).contiguous()
    _CASTS[weight] = (key, copy, _sampled(weight), _recheck_epoch)
    return copy


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
    weights: LlamaWeights,
    bf16_activations: bool,
    rope: Sequence[torch.Tensor],
    cache: Sequence[torch.Tensor],
    layout: Sequence[torch.Tensor],
    visible: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The L decoder layers of ``weights`` in one call: per layer, what ``fused_linear`` (RMSNorm + q, k, v),
    ``rope_cache_write``, ``cache_attention``, ``fused_linear`` (o + residual), ``fused_linear`` (RMSNorm +
    gate, up, SwiGLU) and ``fused_linear`` (down + residual) give, bit for bit, without a Python call per op.

    Parameters
    ----------
    x : torch.Tensor
        The residual stream of the B blocks of T tokens (M = B * T), fp32 contiguous; updated in place.
        Shape: [M, d]
    weights : LlamaWeights
        The model (its layers are read; projections of one dtype, norms and biases best in fp32).
    bf16_activations : bool
        As ``fused_linear``.
    rope : sequence of torch.Tensor
        [cos, sin], as ``rope_cache_write`` (``rope_tables``).
        Shape: [P, D/2]
    cache : sequence of torch.Tensor
        [k_cache, v_cache]: every layer's cache (fp32, bf16 or fp16), written in place.
        Shape: [L, Bc, Hk, capacity, D]
    layout : sequence of torch.Tensor
        [positions, cache_rows, cache_positions, start], int64: each token's rotary position, cache row
        and cache slot ([M]; the T tokens of a block share one cache row: batch row b reads cache row
        cache_rows[b * T]) and each block's first slot ([B], as ``cache_attention``).
        Shape: [M], [M], [M], [B]
    visible : torch.Tensor, optional
        A tree's visibility, as ``cache_attention`` (None: causal).
        Shape: [B, T, T]

    Returns
    -------
    torch.Tensor
        ``x``, after the layers.
        Shape: [M, d]
    """
    tensors, scalars = weights.flat()
    _DECODER_LAYERS(x, tensors, scalars, bf16_activations, rope, cache, layout, visible)
    return x


def llama_head(x: torch.Tensor, weights: LlamaWeights, bf16_activations: bool) -> torch.Tensor:
    """The final RMSNorm and the LM head of ``weights`` over the rows ``x`` (``fused_linear``), fp32 logits.

    Shape: x [N, d] fp32 contiguous -> [N, V_out]."""
    d = weights.head.weight.shape[-1]
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"llama_head: x must have shape [N, d] with d = {d} (the head's dimension 1), got "
                         f"{tuple(x.shape)}")
    logits = torch.empty((x.shape[0], weights.head.weight.shape[0]))
    bias = weights.head.bias
    _FUSED_LINEAR(x, weights.norm, weights.norm_eps, [weights.head.weight], [] if bias is None else [bias], "store",
                  bf16_activations, [logits])
    return logits


def greedy_chain(
    tokens: torch.Tensor,
    steps: int,
    weights: LlamaWeights,
    bf16_activations: bool,
    rope: Sequence[torch.Tensor],
    cache: Sequence[torch.Tensor],
    rows: Sequence[torch.Tensor],
    vocab_limit: Optional[int] = None,
    check_logits: bool = False,
) -> torch.Tensor:
    """A greedy draft chain in one call: for i = 1 .. steps - 1, the one-token pass of tokens[:, i - 1]
    (embedding, ``decoder_layers``, ``llama_head``) at slot start[b] + i - 1, and tokens[:, i] = its
    logits' argmax, bit for bit what those calls and ``torch.argmax`` give one step at a time. The fed
    tokens' keys and values are in the caches afterwards.

    With a feed (``rows`` of four), a first pass feeds each row's block of committed tokens (the draft's
    unseen ones) and gives tokens[:, 0] (the argmax at the row's last real column); the chain then starts
    at slot start[b] + feed_counts[b]: bit for bit a ``decoder_layers`` pass over the block, the head and
    ``torch.argmax``, then the chain.

    Parameters
    ----------
    tokens : torch.Tensor
        int64, contiguous; column 0 given (each row's first draft token; with a feed: written), columns
        1 .. steps - 1 written.
        Shape: [B, n]
    steps : int
        Tokens per row in the chain, 1 <= steps <= n (steps - 1 passes).
    weights, bf16_activations, rope, cache
        As ``decoder_layers`` (the embedding, the layers, the final norm and the head are read).
        Shape: as ``decoder_layers``
    rows : sequence of torch.Tensor
        [cache_rows, start] or [cache_rows, start, feed, feed_counts], int64: each row's cache row and
        first free slot (its committed length; start[b] + W <= capacity and start[b] + feed_counts[b] +
        steps - 1 <= capacity, W and feed_counts 0 without a feed); feed: tokens fed in one pass before
        the chain, at slots start[b] .. start[b] + W - 1 (a row's columns from feed_counts[b] on are
        padding: written past its tokens, then overwritten), contiguous; feed_counts in [1, W]: each
        row's real columns.
        Shape: [B], [B], [B, W], [B]
    vocab_limit : int, optional
        The argmax reads logits [:vocab_limit] (default V_out): the target's vocabulary when it is smaller.
    check_logits : bool
        A target's greedy decoding: logits with a NaN or +inf, or all -inf, raise ``ValueError`` naming
        the row (``chain_verify``'s check) instead of giving an argmax (a NaN's index, as torch.argmax).

    Returns
    -------
    torch.Tensor
        ``tokens``.
        Shape: [B, n]
    """
    tensors, scalars = weights.flat()
    limit = weights.head.weight.shape[0] if vocab_limit is None else vocab_limit
    _GREEDY_CHAIN(tokens, steps, tensors, scalars, bf16_activations, rope, cache, rows, limit, check_logits)
    return tokens


@dataclass(frozen=True, eq=False)
class EagleLayerExtras:
    """What an EAGLE-3 layer adds to a Llama layer (``eagle_chain``): the features' RMSNorm, where the
    residual stream starts, and the target id of each draft id. Shapes: hidden_norm [d]; target_ids [V_d]
    int64."""

    hidden_norm: torch.Tensor
    hidden_norm_eps: float
    norm_before_residual: bool  # the residual stream is hidden_norm(features), not the features
    target_ids: torch.Tensor


def eagle_chain(
    tokens: torch.Tensor,
    steps: int,
    last: torch.Tensor,
    weights: LlamaWeights,
    extras: EagleLayerExtras,
    rope: Sequence[torch.Tensor],
    cache: Sequence[torch.Tensor],
    start: torch.Tensor,
    feed: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """EAGLE-3's greedy draft chain in one call (specdec_ext/eagle): for i = 0 .. steps - 1, the head (the
    final norm and lm_head of ``weights``) of the layer output gives tokens[:, i] = target_ids[argmax]; before
    the next step, the layer pass of that token at slot (and rotary position) start[b] + i: q, k, v of
    [input_norm(embed(token)); hidden_norm(out)], the residual stream hidden_norm(out) when
    ``extras.norm_before_residual`` else out, then the Llama layer's attention, o, SwiGLU MLP. What
    eagle/kernels.py's ``kernel_head`` / ``kernel_block`` and ``torch.argmax`` give one step at a time, up to
    the RMSNorms' rounding (computed here in one fp32 loop per row, there by torch). The fed tokens' keys
    and values are in the cache afterwards.

    Parameters
    ----------
    tokens : torch.Tensor
        int64, contiguous; columns 0 .. steps - 1 written.
        Shape: [B, n]
    steps : int
        Draft tokens per row, 1 <= steps <= n (steps - 1 layer passes).
    last : torch.Tensor
        The layer's output at each row's last fed position, fp32 contiguous; written by a ``feed``.
        Shape: [B, d]
    weights : LlamaWeights
        One layer: its q, k, v read 2d ([embedding; features]) and its input_norm normalises the embedding
        half; embed (the token embedding, fp32 / bf16 / fp16), norm and head (lm_head over the draft
        vocabulary) as ``greedy_chain``'s.
        Shape: q [H*D, 2d], head [V_d, d]
    extras : EagleLayerExtras
        The features' RMSNorm, ``norm_before_residual`` and the draft vocabulary's target ids.
        Shape: hidden_norm [d], target_ids [V_d]
    rope : sequence of torch.Tensor
        [cos, sin], as ``rope_cache_write``.
        Shape: [P, D/2]
    cache : sequence of torch.Tensor
        [k_cache, v_cache] of the layer, written in place (start[b] + steps - 1 <= min(capacity, P)).
        Shape: [1, Bc, Hk, capacity, D]
    start : torch.Tensor
        int64: each row's first slot (its fed length); row b uses cache row b.
        Shape: [B]
    feed : sequence of torch.Tensor, optional
        [tokens (int64), features (fp32), counts (int64)]: first a layer pass over each row's block of W
        tokens with their features (the fc of the target's tapped states) at slots start[b] ..
        start[b] + W - 1 (columns past a row's count are padding, written past its tokens); ``last[b]`` is
        then that pass's output at column counts[b] - 1 (kept where the count is 0) and the chain starts at
        start[b] + counts[b] (start[b] + W <= min(capacity, P)).
        Shape: [B, W], [B, W, d], [B]

    Returns
    -------
    torch.Tensor
        ``tokens``.
        Shape: [B, n]
    """
    tensors, scalars = weights.flat()
    _EAGLE_CHAIN(tokens, steps, last, tensors, scalars, [extras.hidden_norm, extras.target_ids],
                 [float(extras.hidden_norm_eps), float(bool(extras.norm_before_residual))], rope, cache, start,
                 [] if feed is None else list(feed))
    return tokens


def cpu_isa() -> str:
    """The instruction-set path the CPU forward kernels take now: ``"amxbf16"`` (avx512bf16 with the bf16
    projections from memory on Intel AMX tiles), ``"avx512bf16"``, ``"avx2"``, ``"neon"`` or ``"portable"``
    (``SPECDEC_CPU_ISA`` when set, else the best this CPU runs)."""
    return torch.ops.specdec_ext.cpu_isa()


# Fake kernels: the ops write their outputs in place and return nothing; they repeat the ops' device check, which
# is the one a mixed-device call reaches when one argument is a meta tensor (it did nothing, silently).
@torch.library.register_fake("specdec_ext::fused_linear")
def _fused_linear_fake(*operands):  # (x, norm_weight, norm_eps, weights, biases, epilogue, bf16_activations, outs)
    check_operand_devices("fused_linear", operands)


@torch.library.register_fake("specdec_ext::rope_cache_write")
def _rope_cache_write_fake(*operands):  # (q, k, v, cos, sin, positions, cache_rows, cache_positions, k_cache, v_cache)
    check_operand_devices("rope_cache_write", operands)


@torch.library.register_fake("specdec_ext::cache_attention")
def _cache_attention_fake(*operands):  # (q, k_cache, v_cache, start, visible, scale, out)
    check_operand_devices("cache_attention", operands)


@torch.library.register_fake("specdec_ext::decoder_layers")
def _decoder_layers_fake(*operands):  # (x, weights, scalars, bf16_activations, rope, cache, layout, visible)
    check_operand_devices("decoder_layers", operands)


@torch.library.register_fake("specdec_ext::greedy_chain")
def _greedy_chain_fake(*operands):  # (tokens, steps, weights, scalars, bf16_activations, rope, cache, rows, ...)
    check_operand_devices("greedy_chain", operands)


@torch.library.register_fake("specdec_ext::eagle_chain")
def _eagle_chain_fake(*operands):  # (tokens, steps, last, weights, scalars, eagle, eagle_scalars, rope, cache, start, feed)
    check_operand_devices("eagle_chain", operands)
