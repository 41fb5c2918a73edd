"""LeanLlamaRunner: a minimal forward for Llama-family models (the ``ModelRunner`` protocol): the CPU
kernels on a CPU, pure torch elsewhere.

Why: a 2-layer d=128 draft costs ~1.3 ms per one-token HF forward on one CPU thread, nearly all of it
module/Python overhead (hooks, the attention-interface dispatch, masks, our paged-cache gather), not
arithmetic. This runner runs the same math directly over the HF model's own weight tensors (no
copies; optionally ``compute_dtype=torch.float32`` over fp32 copies made once per weight version,
which the plan chooses for a bf16/fp16 draft on the CPU): RMSNorm, default RoPE, GQA
attention with ``scaled_dot_product_attention``, a SiLU-gated MLP, the LM head; linear biases are
used when the modules have them (Qwen2's q/k/v, Llama's ``attention_bias`` / ``mlp_bias``). When
hooks are registered on the model's LM head (the heads drafter reads its input through one) the LM
head module itself is called, so they see what they would see under the HF forward.

Cache: contiguous, preallocated per row, ``[layers, B, kv_heads, capacity, head_dim]`` (K and V),
in the compute dtype (the CPU kernels read a half-precision cache and accumulate in fp32), except for
a bf16/fp16 model on the torch path on a CPU: there the cache and the attention are fp32 (the cached
k and v are the model-dtype values, exact in fp32; torch's CPU bf16 SDPA is slow for a single query). Row b's
committed tokens are positions 0 .. lengths[b]-1; a ``forward`` writes its T tokens TENTATIVELY at
lengths[b] + t (padding columns too, harmlessly past the row's tokens); ``commit`` / ``truncate`` only
move ``lengths`` (rollback is metadata only). The host holds the
lengths (source of truth); ``lengths`` returns them as a device tensor.

Positions and the attention mask of a ragged or tree forward come from ``layout.step_layout``, as in
the paged runner; when every row starts at the same position one shared [T, S] mask (or none) is used.

On the CPU the forward runs on the CPU kernels instead (runners/lean_cpu.py: six fused ops per layer
that read each weight once per pass near the memory bandwidth, an fp32 residual stream, the cache in
the model's half precision, bit-for-bit batch invariance); ``SPECDEC_CPU_KERNELS=0`` keeps the torch
forward below, and ``kernels_reason`` says why a runner does not use them.

Supported: ``llama`` / ``mistral`` / ``qwen2`` model types with default RoPE, SiLU MLP, full attention
(a sliding window is accepted only when it covers max_seq_len). ``unsupported_reason(model)`` says why
not otherwise (the plan then picks the paged runner).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from .checks import (check_forward_inputs, check_row_counts, check_start_prompts, output_vocab_size,
                     tensor_parallel_size,
                     text_config)
from .layout import additive_mask, step_layout
from .lean_cpu import CpuKernelForward, kernels_reason
from .rows import RowsInUse
from .trees import token_tree_inputs, tree_commit_plan

__all__ = ["LeanLlamaRunner", "unsupported_reason", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CAPACITY_SLACK = 16  # cache positions past max_seq_len for padding columns of a forward


def _rope_parameters(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        return params
    scaling = getattr(cfg, "rope_scaling", None)  # transformers 4.x
    out = dict(scaling) if isinstance(scaling, dict) else {}
    out.setdefault("rope_type", out.get("type", "default"))
    if getattr(cfg, "rope_theta", None) is not None:
        out.setdefault("rope_theta", cfg.rope_theta)
    return out


def unsupported_reason(model, max_seq_len: Optional[int] = None) -> Optional[str]:
    """None when LeanLlamaRunner reproduces ``model``'s forward; else why not (a short sentence)."""
    cfg = text_config(getattr(model, "config", None))
    if cfg is None:
        return "the model has no config"
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    rope = _rope_parameters(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        return f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    if rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) not in (None, 1.0):
        return "partial rotary embeddings"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention)"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        if max_seq_len is None or window < max_seq_len:
            return f"sliding_window={window} smaller than the cache ({max_seq_len})"
    if tensor_parallel_size(model) > 1:
        return "tensor-parallel weights (the HF modules run the collectives)"
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None or not hasattr(base, "layers") or not hasattr(base, "embed_tokens"):
        return "not a *ForCausalLM with .model.layers and .lm_head"
    if not hasattr(getattr(base, "rotary_emb", None), "inv_freq"):
        return "no rotary_emb.inv_freq buffer"
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names) or \
                not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i} does not have the Llama attention/MLP layout"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"layer {i} has q/k norms"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"{name} is set"
    if getattr(model, "training", False) and getattr(cfg, "attention_dropout", 0.0):
        return "training mode with attention dropout"
    return None


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def forward_description(model) -> str:
    """What the lean runner's forward of a supported ``model`` runs on, for the decode plan: "the CPU
    kernels" or "a pure-torch forward (why not the kernels)"."""
    weight = model.model.embed_tokens.weight
    # A runner computes in its weights' dtype or in fp32, both of which the kernels take.
    reason = kernels_reason(weight.device, weight.dtype, weight.dtype, _head_dim(text_config(model.config)))
    return "the CPU kernels (csrc/cpu)" if reason is None else f"a pure-torch forward (not the CPU kernels: {reason})"


class LeanLlamaRunner:
    """Llama-family causal LM over a contiguous per-row KV cache (see the module docstring)."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, compute_dtype: Optional[torch.dtype] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        reason = unsupported_reason(model, max_seq_len)
        if reason is not None:
            raise NotImplementedError(f"LeanLlamaRunner: {reason}")
        self.model = model
        self.max_batch_size, self.max_seq_len = int(max_batch_size), int(max_seq_len)
        cfg = text_config(model.config)
        base = model.model
        weight_dtype = base.embed_tokens.weight.dtype
        # compute_dtype None: the model's own weight tensors (no copies). Otherwise, on the torch path,
        # the weights are cast once (a copy: torch's half-precision GEMVs are slow on a CPU); the CPU
        # kernels read them as they are.
        self.dtype = compute_dtype or weight_dtype
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = _head_dim(cfg)
        self.gqa = self.kv_heads != self.num_heads
        self.scale = self.head_dim ** -0.5
        # On the CPU the forward runs on the kernels of lean_cpu.py (why not otherwise: kernels_reason),
        # which read bf16/fp16 weights as they are even when computing in fp32: no fp32 copy then.
        self.kernels_reason = kernels_reason(base.embed_tokens.weight.device, weight_dtype, self.dtype,
                                             self.head_dim)
        on_kernels = self.kernels_reason is None
        same = self.dtype == weight_dtype or on_kernels
        cast = (lambda w: w) if same else (lambda w: _cast(w, self.dtype))
        self.embed = cast(base.embed_tokens.weight)
        self.device = self.embed.device
        # The KV cache and the attention in fp32 for a half-precision model on the CPU: the cached
        # keys and values are the model-dtype k and v (exact in fp32), and attention accumulates in
        # fp32 as half-precision SDPA kernels do inside, but torch's CPU SDPA has a slow bf16 path
        # for a single query (360 us against 44 us in fp32 at 500 positions, 8 heads of 64, one
        # thread: a third of a decode step of the bundled target on the edit workload). The kernels'
        # attention reads a half-precision cache itself (half the bytes of fp32) and accumulates in fp32.
        half_on_cpu = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
        self.attn_dtype = torch.float32 if half_on_cpu and not on_kernels else self.dtype
        self.vocab_size: int = output_vocab_size(model)
        lin = lambda m: (cast(m.weight), cast(m.bias))
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                cast(layer.input_layernorm.weight), _eps(layer.input_layernorm, cfg),
                lin(attn.q_proj), lin(attn.k_proj), lin(attn.v_proj), lin(attn.o_proj),
                cast(layer.post_attention_layernorm.weight), _eps(layer.post_attention_layernorm, cfg),
                lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj)))
        self.norm_weight, self.norm_eps = cast(base.norm.weight), _eps(base.norm, cfg)
        self.head_weight, self.head_bias = cast(model.lm_head.weight), cast(model.lm_head.bias)
        rotary = base.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().to(device=self.device, dtype=torch.float32)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        self._batch = 0
        self._len: List[int] = []         # committed tokens per row (host: the source of truth)
        self._tentative: List[int] = []   # tokens written by the last forward, per row
        self._tree = False                # whether the last forward was a tree
        self._in_use = RowsInUse(self.max_batch_size)  # continuous batching: start_rows / free_rows
        self._rows = torch.arange(self.max_batch_size, device=self.device)
        self._kernels: Optional[CpuKernelForward] = None
        self._alloc(self.max_seq_len + CAPACITY_SLACK)
        if on_kernels:
            self._kernels = CpuKernelForward(self)

    # ------------------------------------------------------------------ storage
    def _alloc(self, capacity: int) -> None:
        shape = (len(self.layers), self.max_batch_size, self.kv_heads, capacity, self.head_dim)
        old = getattr(self, "k_cache", None)
        k = torch.zeros(shape, dtype=self.attn_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.attn_dtype, device=self.device)
        if old is not None:
            n = old.shape[3]
            k[:, :, :, :n] = self.k_cache
            v[:, :, :, :n] = self.v_cache
        self.k_cache, self.v_cache = k, v
        self.capacity = capacity
        # RoPE tables exactly as HF's rotary embedding computes them (fp32, then the model dtype);
        # rotate_half's sign is folded into sin so that q_rot = q * cos + roll(q, D/2) * sin.
        freqs = torch.arange(capacity, device=self.device, dtype=torch.float32)[:, None] * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        self._cos = (emb.cos() * self._rope_scaling).to(self.dtype)  # [capacity, D]
        sin = (emb.sin() * self._rope_scaling).to(self.dtype)
        sin[:, :half] = -sin[:, :half]
        self._sin = sin
        self._arange = torch.arange(capacity, device=self.device)
        if self._kernels is not None:
            self._kernels.tables(capacity)

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row, int64 on the model's device. Shape: [B]."""
        return torch.tensor(self._len, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ the model
    def _rms(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        h = x.float()  # HF: normalise in fp32, cast back, then scale in the model dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def _model(self, ids: torch.Tensor, start: List[int], keep: Optional[torch.Tensor],
               tree: Optional[tuple] = None, counts: Optional[Sequence[int]] = None,
               cache_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [B, T]; row b's token t stored at start[b] + t, the first counts[b] (default T) of them real.
        cache_rows [B] int64: the cache row of each batch row (start_rows); None: rows 0..B-1.
        Chain (tree None): at position start[b] + t, seeing positions <= start[b] + t. Tree (ancestors
        [B, T, T] bool, depth [B, T] int64; see trees.token_tree_inputs): at position start[b] + depth[b, t],
        seeing the prefix and its ancestors. keep: None (logits of every token, [B, T, V]) or column
        indices [B] ([B, V]). fp32 logits."""
        B, T = ids.shape
        H, Hk, D = self.num_heads, self.kv_heads, self.head_dim
        S = max(start) + T
        if S > self.capacity:
            self._alloc(S + CAPACITY_SLACK)
        if self._kernels is not None:
            return self._kernels(ids, start, keep, tree, counts, cache_rows)
        uniform = tree is None and all(s == start[0] for s in start)
        # a slice keeps the cache a view; an index (rows joining a running batch) gathers a copy
        rows_of_cache = slice(0, B) if cache_rows is None else cache_rows
        if uniform:  # every row at the same position: one shared [T, S] mask (or none)
            s0 = start[0]
            cos, sin = self._cos[s0:S], self._sin[s0:S]  # [T, D]
            if T == 1:
                mask, causal = None, False
            elif s0 == 0:
                mask, causal = None, True  # square causal (top-left == bottom-right alignment)
            else:
                visible = self._arange[None, :S] <= self._arange[s0:S, None]  # [T, S]
                mask = additive_mask(visible[None], self.attn_dtype)[0, 0]
                causal = False
        else:
            lengths = torch.tensor(start, dtype=torch.int64, device=self.device)
            num_tokens = torch.tensor(counts if counts is not None else [T] * B, dtype=torch.int64, device=self.device)
            layout = step_layout(lengths, num_tokens, T, S, self._arange, tree=tree)
            store, pos = layout.storage, layout.positions  # [B, T]
            cos, sin = self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)  # [B, 1, T, D]
            mask, causal = additive_mask(layout.visible, self.attn_dtype), False
            rows = (self._rows[:B] if cache_rows is None else cache_rows)[:, None]  # [B, 1]
        half = D // 2
        x = F.embedding(ids, self.embed)  # [B, T, d]
        for l, (w_in, eps_in, (wq, bq), (wk, bk), (wv, bv), (wo, bo), w_post, eps_post,
                (wg, bg), (wu, bu), (wd, bd)) in enumerate(self.layers):
            h = self._rms(x, w_in, eps_in)
            q = F.linear(h, wq, bq).view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
            k = F.linear(h, wk, bk).view(B, T, Hk, D)
            v = F.linear(h, wv, bv).view(B, T, Hk, D)
            q = q * cos + q.roll(half, -1) * sin
            k = k.transpose(1, 2)  # [B, Hk, T, D]
            k = k * cos + k.roll(half, -1) * sin
            kc, vc = self.k_cache[l], self.v_cache[l]  # [Bmax, Hk, cap, D]
            if uniform:
                kc[rows_of_cache, :, s0:S] = k.to(kc.dtype)
                vc[rows_of_cache, :, s0:S] = v.transpose(1, 2).to(vc.dtype)
            else:
                kc[rows, :, store] = k.transpose(1, 2).to(kc.dtype)
                vc[rows, :, store] = v.to(vc.dtype)
            a = F.scaled_dot_product_attention(q.to(kc.dtype), kc[rows_of_cache, :, :S], vc[rows_of_cache, :, :S],
                                               attn_mask=mask,
                                               is_causal=causal, scale=self.scale,
                                               enable_gqa=self.gqa).to(self.dtype)  # [B, H, T, D]
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), wo, bo)
            h = self._rms(x, w_post, eps_post)
            x = x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)
        if keep is not None:
            x = x[self._rows[:B], keep]  # [B, d]
        x = self._rms(x, self.norm_weight, self.norm_eps)
        head = self.model.lm_head
        if head._forward_pre_hooks or head._forward_hooks:  # e.g. heads on the target read its input
            return head(x.to(head.weight.dtype)).float()
        return F.linear(x, self.head_weight, self.head_bias).float()

    # ------------------------------------------------------------------ API
    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Free every row and prefill B ragged prompts; returns the logits at each prompt's last
        position, fp32 [B, V]. Afterwards lengths[b] = len(prompts[b])."""
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        B = len(prompts)
        logits = self._prefill(prompts, None)
        self._batch = B
        self._len = [len(p) for p in prompts]
        self._tentative = [0] * B
        self._in_use.reset(B)
        return logits

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Continuous batching: prefill free ``rows`` with ``prompts`` while the other rows keep their
        caches; returns the logits at each prompt's last position, fp32 [n, V]. The batch then spans
        up to the highest row in use (runners/rows.py); lengths[rows[i]] = len(prompts[i])."""
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        rows = self._in_use.check_free("start_rows", rows, len(prompts))
        logits = self._prefill(prompts, torch.tensor(rows, dtype=torch.int64, device=self.device))
        self._in_use.add(rows)
        self._resize(self._in_use.width)
        for row, prompt in zip(rows, prompts):
            self._len[row] = len(prompt)
        return logits

    def free_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching: release ``rows`` (length 0); the batch shrinks to the highest row still in use."""
        for row in self._in_use.remove("free_rows", rows):
            self._len[row] = 0
        self._resize(self._in_use.width)

    def _resize(self, width: int) -> None:
        """The host lists to ``width`` rows (new rows empty); between steps, so nothing is tentative."""
        self._len = (self._len + [0] * width)[:width]
        self._tentative = [0] * width
        self._batch = width

    def _prefill(self, prompts: Sequence[Sequence[int]], cache_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits at each prompt's last position [n, V], the prompts' K/V in cache rows ``cache_rows``
        (None: 0..n-1)."""
        B = len(prompts)
        T = max(len(p) for p in prompts)
        # Right-padded: every row starts at position 0 (a plain causal mask); padding columns write
        # K/V past the row's tokens, which its lengths never cover.
        ids = torch.zeros((B, T), dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        last = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self._model(ids.to(self.device), [0] * B, last, cache_rows=cache_rows)

    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append T tokens per row tentatively and return their logits, fp32 [B, T, V].

        input_ids [B, T] int64; num_tokens [B] (default T): row b's tokens past num_tokens[b] are
        padding (not kept, garbage logits). Token t sits at position lengths[b] + t and sees the
        prefix and tokens 0..t. Tree: tree_parents [B, T-1] int32 (csrc/tree.h layout: node i is token
        i+1, -1 = child of token 0); token 0 (the last committed token, depth 0) and each node see the
        prefix, token 0 and their ancestors, at position lengths[b] + depth.
        """
        B, T, counts = check_forward_inputs(input_ids, num_tokens, tree_parents, self._batch)
        lengths = self._len
        for b in range(B):
            if lengths[b] + counts[b] > self.max_seq_len:
                raise ValueError(f"row {b} would hold {lengths[b] + counts[b]} tokens, more than "
                                 f"max_seq_len={self.max_seq_len}")
        tree = None if tree_parents is None else token_tree_inputs(tree_parents.to(self.device), counts, T)
        with torch.no_grad():
            logits = self._model(input_ids.to(self.device), lengths, None, tree, counts)
        self._tentative = [int(c) for c in counts]
        self._tree = tree is not None
        return logits

    @property
    def chains_greedy(self) -> bool:
        """Whether ``greedy_chain`` runs here (the CPU kernels, and nothing hooked on the head)."""
        return self._kernels is not None and not self._kernels.head_hooked()

    def greedy_chain(self, tokens: torch.Tensor, steps: int, vocab_limit: Optional[int] = None,
                     check_logits: bool = False, feed: Optional[torch.Tensor] = None,
                     feed_counts: Optional[torch.Tensor] = None) -> None:
        """A greedy draft in one op call (ops.greedy_chain): tokens [B, n] int64 with tokens[:, 0] given;
        for i = 1 .. steps - 1, feeds tokens[:, i - 1] and writes tokens[:, i] = the argmax of its logits
        [:vocab_limit], committing what it feeds (lengths[b] += steps - 1): bit for bit what ``forward``
        of one token, ``argmax`` and ``commit`` give one step at a time. Only where ``chains_greedy``.
        ``check_logits`` (a target's greedy decoding): invalid logits (a NaN or +inf, or all -inf) raise
        ValueError, as ``chain_verify`` does; the lengths then stay as they were.
        ``feed`` [B, W] int64 with ``feed_counts`` [B] (default W): first ``forward(feed, feed_counts)``,
        its commit, and tokens[:, 0] = the argmax at each row's last fed token, in the same call
        (lengths[b] += feed_counts[b] + steps - 1)."""
        if not self.chains_greedy:
            raise ValueError("greedy_chain: needs the CPU kernels and a head without hooks (see chains_greedy)")
        if self._batch == 0:
            raise ValueError("greedy_chain: call start() first")
        if tokens.dim() != 2 or tokens.shape[0] != self._batch:
            raise ValueError(f"greedy_chain: tokens must be [B, n] with B = {self._batch}, got {list(tokens.shape)}")
        fed = [max(steps - 1, 0)] * self._batch
        if feed is not None:
            counts = self._feed_counts(feed, feed_counts)
            fed = [f + c for f, c in zip(fed, counts)]
            feed_counts = torch.tensor(counts, dtype=torch.int64)
        for b, length in enumerate(self._len):
            if length + fed[b] > self.max_seq_len:
                raise ValueError(f"row {b} would hold {length + fed[b]} tokens, more than max_seq_len={self.max_seq_len}")
        limit = self.vocab_size if vocab_limit is None else vocab_limit
        with torch.no_grad():
            self._kernels.greedy_chain(tokens, steps, self._len, limit, check_logits, feed, feed_counts)
        self._len = [length + f for length, f in zip(self._len, fed)]
        self._tentative = [0] * self._batch
        self._tree = False

    def _feed_counts(self, feed: torch.Tensor, feed_counts: Optional[torch.Tensor]) -> List[int]:
        """greedy_chain's feed [B, W] and feed_counts [B] (default W), checked; the counts on the host."""
        if feed.dim() != 2 or feed.shape[0] != self._batch or feed.shape[1] == 0:
            raise ValueError(f"greedy_chain: feed must be [B, W] with B = {self._batch} and W >= 1, got "
                             f"{list(feed.shape)}")
        W = feed.shape[1]
        counts = [W] * self._batch if feed_counts is None else [int(c) for c in feed_counts.reshape(-1).tolist()]
        if len(counts) != self._batch:
            raise ValueError(f"greedy_chain: feed_counts has {len(counts)} rows, the runner holds {self._batch}")
        for b, c in enumerate(counts):
            if not 1 <= c <= W:
                raise ValueError(f"greedy_chain: feed_counts[{b}] = {c} is outside [1, W] = [1, {W}]")
        return counts

    def commit(self, num_kept: torch.Tensor) -> None:
        """Row b keeps its first num_kept[b] tentative tokens (lengths[b] += num_kept[b])."""
        kept = check_row_counts("commit", "num_kept", num_kept, self._tentative, self._batch)
        self._len = [n + k for n, k in zip(self._len, kept)]
        self._tentative = [0] * self._batch

    def commit_tree(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree forward: keep token 0 and the accepted nodes path[b, :num_accepted[b]], moved to
        consecutive positions (lengths[b] += 1 + num_accepted[b]). path [B, N] int, num_accepted [B]."""
        if not self._tree:
            raise ValueError("commit_tree: the last forward was not a tree forward")
        plan = tree_commit_plan(path, num_accepted, self._len, self._tentative)
        for b, (moves, _) in enumerate(plan):
            if moves:
                src = torch.tensor(moves, dtype=torch.int64, device=self.device)
                dst = self._arange[self._len[b] + 1: self._len[b] + 1 + len(moves)]
                for cache in (self.k_cache, self.v_cache):  # [layers, Bmax, Hk, cap, D]
                    cache[:, b, :, dst] = cache[:, b, :, src]  # (the gather copies before the write)
        self._len = [length for _, length in plan]
        self._tentative = [0] * self._batch
        self._tree = False

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to shorter committed lengths (never grows). new_lengths [B] int."""
        self._len = check_row_counts("truncate", "new_lengths", new_lengths, self._len, self._batch)
        self._tentative = [0] * self._batch


_CASTS = WeakIdKeyDictionary()  # weight -> (version, dtype, copy)


def _cast(weight: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``weight`` in ``dtype``, reused across runners while the weight is unchanged."""
    if weight is None:
        return None
    key = (weight._version, weight.data_ptr(), dtype)
    hit = _CASTS.get(weight)
    if hit is not None and hit[0] == key:
        return hit[1]
    copy = weight.detach().to(dtype)
    _CASTS[weight] = (key, copy)
    return copy


def _eps(norm, cfg) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return float(eps if eps is not None else cfg.rms_norm_eps)
