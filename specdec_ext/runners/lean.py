"""LeanLlamaRunner: a minimal forward for Llama-family models (the ``ModelRunner`` protocol): the CPU
kernels on a CPU, pure torch elsewhere.

Why: a 2-layer d=128 draft costs ~1.3 ms per one-token HF forward on one CPU thread, nearly all of it
module/Python overhead (hooks, the attention-interface dispatch, masks, our paged-cache gather), not
arithmetic. This runner runs the same math directly over the HF model's own weight tensors, read once
into a ``LlamaWeights`` (ops/lean_forward.py: the embedding, each layer's norms and projections by
name, the final norm, the head, the rotary frequencies) that both forwards read:

* on a CPU, the CPU kernels (``_kernel_forward`` below; runners/lean_cpu.py says why a runner does not
  use them and holds the numerics): one ``decoder_layers`` op call for the whole stack (six fused kernels
  per layer that read each weight once per pass near the memory bandwidth, an fp32 residual stream, the
  cache in the model's half precision, bit-for-bit batch invariance), then ``llama_head``; a greedy
  draft of k tokens is one ``greedy_chain`` call. The weights are the model's own tensors (the kernels
  widen bf16/fp16 weights themselves), the norms and biases fp32 copies.
* elsewhere, or with ``SPECDEC_CPU_KERNELS=0``, the pure-torch forward of runners/lean_torch.py, over
  the model's own tensors (``compute_dtype=torch.float32``: over fp32 copies made once per weight
  version, which the plan chooses for a bf16/fp16 draft on the CPU).

Cache: contiguous, preallocated per row, ``[layers, B, kv_heads, capacity, head_dim]`` (K and V),
in the compute dtype (the CPU kernels read a half-precision cache and accumulate in fp32), except for
a bf16/fp16 model on the torch path on a CPU: there the cache and the attention are fp32
(lean_torch.py). Row b's committed tokens are positions 0 .. lengths[b]-1; a ``forward`` writes its T
tokens TENTATIVELY at lengths[b] + t (padding columns too, harmlessly past the row's tokens);
``commit`` / ``truncate`` only move ``lengths`` (rollback is metadata only). The host holds the
lengths (source of truth); ``lengths`` returns them as a device tensor.

Supported: ``llama`` / ``mistral`` / ``qwen2`` model types with default RoPE, SiLU MLP, full attention
(a sliding window is accepted only when it covers max_seq_len). ``unsupported_reason(model)`` says why
not otherwise (the plan then picks the paged runner); ``lean_capabilities(model)`` what a runner over
it can do beyond the ``ModelRunner`` contract.

Hidden-state taps (``hidden_taps=(l_1, ...)``, runners/taps.py): the inputs of those layers are kept per
token beside the cache (``tapped_states``) and roll back with it. On the kernels the stack then runs as
one ``decoder_layers`` call per stretch of layers between taps (each layer computes what it computes in
one call: the residual stream is fp32 either way), and greedy chains are off (they would commit tokens
without their states).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..ops.lean_forward import (Linear, LlamaLayerWeights, LlamaWeights, cached_cast, cpu_isa, decoder_layers,
                                greedy_chain, llama_head, recheck_weights, rope_tables)
from .capabilities import RunnerCapabilities
from .checks import (check_extend_chunks, check_forward_inputs, check_row_counts, check_start_prompts, output_vocab_size,
                     tensor_parallel_size,
                     text_config)
from .head_hooks import head_hooked
from .lean_cpu import call_head_hooks, kernels_reason
from .lean_torch import TorchForward
from .rows import RowsInUse
from .taps import TapBuffer, check_tap_layers
from .trees import token_tree_inputs, tree_commit_plan

__all__ = ["LeanLlamaRunner", "unsupported_reason", "lean_capabilities", "SUPPORTED_MODEL_TYPES", "prefill_groups"]

PREFILL_PADDING_SLACK = 0.25  # a prefill forward of ragged prompts computes at most this fraction more tokens
#   than they hold (right padding to the longest) ...
PREFILL_GROUP_TOKENS = 512  # ... and at most this many tokens, unless one prompt is longer. Measured (bundled pair,
#   bf16, one thread, amxbf16): a forward's time per token is least from ~64 to ~1000 tokens (target 104-120 us,
#   draft 22-24) and rises past it (16 x 256 tokens: 172 and 30 us); 16 prompts of 150-460 tokens took 300 us per
#   token in one padded forward, 160 one by one


def prefill_groups(lengths: Sequence[int], slack: float = PREFILL_PADDING_SLACK,
                   tokens: int = PREFILL_GROUP_TOKENS) -> List[List[int]]:
    """The prompts (by index) prefilled together: longest first, a group takes the next prompt while its
    forward of (members) x (its longest) tokens stays within (1 + slack) x the tokens its members hold and
    within ``tokens``. Each group is one forward; the kernels are batch invariant, so a row's logits and
    cache do not depend on the group it lands in."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    held = 0
    for i in order:
        padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]] if groups else 0
        if groups and padded <= tokens and padded <= (1 + slack) * (held + lengths[i]):
            groups[-1].append(i)
            held += lengths[i]
        else:
            groups.append([i])
            held = lengths[i]
    return groups

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CAPACITY_SLACK = 16  # cache positions past max_seq_len for padding columns of a forward
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # a Llama layer's self_attn's
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # ... and its mlp's


def rope_parameters(cfg) -> dict:
    """The model's RoPE parameters (rope_type, rope_theta, scaling), from transformers 5's rope_parameters or 4.x's fields."""
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
    rope = rope_parameters(cfg)
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
    dtype = getattr(getattr(base.embed_tokens, "weight", None), "dtype", None)  # (every matrix's: _matrix_layout_reason)
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = ((attn, ATTENTION_PROJECTIONS), (mlp, MLP_PROJECTIONS))
        if any(owner is None or not all(hasattr(owner, n) for n in names) for owner, names in parts):
            return f"layer {i} does not have the Llama attention/MLP layout"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"layer {i} has q/k norms"
        for owner, names in parts:
            for name in names:
                projection = owner._modules.get(name) or getattr(owner, name)  # (_modules: no __getattr__ per matrix)
                if not _plain_module(projection, torch.nn.Linear):
                    return (f"layer {i}'s {name} is a {type(projection).__qualname__}, not a torch.nn.Linear (an "
                            f"adapter such as LoRA, or a quantized layer): the lean forward reads the weight alone")
                layout = _matrix_layout_reason(projection._parameters["weight"], dtype)
                if layout is not None:
                    return f"layer {i}'s {name} {layout}"
    if not _plain_module(base.embed_tokens, torch.nn.Embedding) or not _plain_module(head, torch.nn.Linear):
        return "the embedding or the LM head is not a plain torch.nn.Embedding / torch.nn.Linear"
    for name, matrix in (("embed_tokens", base.embed_tokens.weight), ("lm_head", head.weight)):
        layout = _matrix_layout_reason(matrix, dtype)
        if layout is not None:
            return f"{name} {layout}"
    if head.weight.shape[0] > base.embed_tokens.weight.shape[0]:  # (its chains feed back what the head picks)
        return (f"the LM head scores {head.weight.shape[0]} tokens, more than the embedding's "
                f"{base.embed_tokens.weight.shape[0]} rows: a token past them could not be fed back")
    modules = _module_reason(model, model_type)
    if modules is not None:
        return f"{modules} (the lean forward computes the stock {model_type} modules from their weights)"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"{name} is set"
    if getattr(model, "training", False) and getattr(cfg, "attention_dropout", 0.0):
        return "training mode with attention dropout"
    return None


def _matrix_layout_reason(weight: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
    """Why the lean forward cannot read the matrix ``weight`` as it is (the kernels stream each one contiguous,
    all in the embedding's ``dtype``), or None; the caller names the matrix before it."""
    if not weight.is_contiguous():
        return "weight is not contiguous (a view: a transposed or sliced tensor)"
    if weight.dtype != dtype:
        return f"weight is {weight.dtype} where the embedding is {dtype}: model.to(one dtype) first"
    return None


def _plain_module(module, kind: type) -> bool:
    """Whether ``module`` computes what ``kind`` does from its weight (and bias): a subclass that overrides
    forward (a quantized or adapted layer) does not."""
    return isinstance(module, kind) and type(module).forward is kind.forward


HF_OUTPUT_CAPTURING = "transformers.utils.output_capturing"  # the module of transformers 5's capturing hooks


STOCK_FORWARD_MODULES = ("torch.nn.modules.", "transformers.activations")  # besides the model type's own file
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"])
COMPILED_WRAPPER = "OptimizedModule"  # torch.compile's module: runs its _orig_mod's forward, compiled
_STOCK_FORWARD: Dict[Tuple[type, str], bool] = {}  # (module class, the model type's module prefix) -> stock forward


def _module_reason(model, model_type: str) -> Optional[str]:
    """Why the lean forward, which computes the stock ``model_type`` modules from their weights, would not
    compute what ``model``'s modules do, or None: a forward hook or pre-hook on a module (a global one, "every
    module"; the LM head's left out: it is called as a module, head_hooks.py), a subclass overriding forward, a
    forward patched on the instance, a module swapped for another kind (an activation other than SiLU, a norm
    that is not the model's RMSNorm)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "a forward hook on every module (torch.nn.modules.module.register_module_forward_hook)"
    own = f"transformers.models.{model_type}."
    head = getattr(model, "lm_head", None)
    name = lambda m: next(n for n, each in model.named_modules() if each is m) or "the model"  # noqa: E731
    stack = [model]  # (the modules by their _modules dicts: named_modules() took 3x as long, per plan and runner)
    while stack:
        m = stack.pop()
        stack.extend(child for child in m._modules.values() if child is not None)
        if (m._forward_hooks or m._forward_pre_hooks) and m is not head and not all(
                map(_observes_only, [*m._forward_hooks.values(), *m._forward_pre_hooks.values()])):
            return f"a forward hook on {name(m)}"
        kind = type(m)
        if kind.__name__ == COMPILED_WRAPPER:  # (its forward, set on the instance, runs _orig_mod's: walked)
            continue
        stock = _STOCK_FORWARD.get((kind, own))
        if stock is None:
            source = getattr(kind.forward, "__module__", None) or ""
            stock = _STOCK_FORWARD[(kind, own)] = source.startswith(own) or source.startswith(STOCK_FORWARD_MODULES)
        if "forward" in m.__dict__:
            return f"{name(m)}'s forward is patched on the instance"
        if not stock:
            return (f"{name(m)} runs its own forward ({kind.__qualname__}.forward, from "
                    f"{getattr(kind.forward, '__module__', None) or 'an unknown module'})")
    base = model.model
    norms = [("model.norm", base._modules.get("norm"))]
    for i, layer in enumerate(base.layers):
        parts = layer._modules
        norms += [(f"layer {i}'s input_layernorm", parts.get("input_layernorm")),
                  (f"layer {i}'s post_attention_layernorm", parts.get("post_attention_layernorm"))]
        act = parts["mlp"]._modules.get("act_fn")
        if type(act).__name__ not in SILU_ACTIVATIONS:
            return f"layer {i}'s mlp.act_fn is a {type(act).__qualname__}, not SiLU"
    for where, norm in norms:
        if not type(norm).__name__.endswith("RMSNorm") or norm._parameters.get("weight") is None:
            return f"{where} is a {type(norm).__qualname__}, not the model's RMSNorm"
    return None


def _observes_only(hook) -> bool:
    """A hook that changes nothing the model computes: the package's own (taps, the bench's pass counter:
    ``specdec_internal``) and transformers' output capturing (installed for good by a first call with
    output_hidden_states=True, and idle outside such a call)."""
    return bool(getattr(hook, "specdec_internal", False)) or getattr(hook, "__module__", "") == HF_OUTPUT_CAPTURING


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _kernels_reason(model, compute_dtype: Optional[torch.dtype]) -> Optional[str]:
    """kernels_reason for a runner over ``model`` computing in ``compute_dtype`` (None: its weights' dtype)."""
    weight = model.model.embed_tokens.weight
    return kernels_reason(weight.device, weight.dtype, compute_dtype or weight.dtype,
                          _head_dim(text_config(model.config)))


def forward_description(model) -> str:
    """What the lean runner's forward of a supported ``model`` runs on, for the decode plan: "the CPU
    kernels" and their instruction-set path now, or "a pure-torch forward (why not the kernels)"."""
    # A runner computes in its weights' dtype or in fp32, both of which the kernels take.
    reason = _kernels_reason(model, None)
    if reason is not None:
        return f"a pure-torch forward (not the CPU kernels: {reason})"
    try:
        path = f"the {cpu_isa()} path"
    except RuntimeError as error:  # SPECDEC_CPU_ISA names no path this CPU runs: the ops will refuse too
        path = str(error)
    return f"the CPU kernels (csrc/cpu, {path})"


def _hooked(head) -> bool:
    """``head_hooks.head_hooked``, asked only where something is hooked (every pass asks; most heads never are)."""
    return bool(head._forward_pre_hooks or head._forward_hooks) and head_hooked(head)


def lean_capabilities(model, compute_dtype: Optional[torch.dtype] = None, hidden_taps: bool = False
                      ) -> RunnerCapabilities:
    """What a ``LeanLlamaRunner(model, compute_dtype=compute_dtype)`` could do beyond the ``ModelRunner``
    contract, before it is built (its ``capabilities`` then): greedy chains in one call where its forward
    runs on the CPU kernels, nothing is hooked on the model's LM head now and no hidden states are
    tapped; ``hidden_taps``: built with taps."""
    chains = _kernels_reason(model, compute_dtype) is None and not _hooked(model.lm_head) and not hidden_taps
    return RunnerCapabilities(greedy_chain=chains, chunked_prefill=True, hidden_taps=hidden_taps)


def _llama_weights(model, cfg, cast: Callable, small: Callable) -> LlamaWeights:
    """``model``'s tensors by name: the projections, embedding and head through ``cast``, the norms and
    biases through ``small``."""
    base = model.model
    lin = lambda m: Linear(cast(m.weight), small(m.bias))  # noqa: E731
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(LlamaLayerWeights(
            input_norm=small(layer.input_layernorm.weight), input_norm_eps=_eps(layer.input_layernorm, cfg),
            q=lin(attn.q_proj), k=lin(attn.k_proj), v=lin(attn.v_proj), o=lin(attn.o_proj),
            post_norm=small(layer.post_attention_layernorm.weight),
            post_norm_eps=_eps(layer.post_attention_layernorm, cfg),
            gate=lin(mlp.gate_proj), up=lin(mlp.up_proj), down=lin(mlp.down_proj)))
    embed = cast(base.embed_tokens.weight)
    rotary = base.rotary_emb
    heads = int(cfg.num_attention_heads)
    return LlamaWeights(
        embed=embed, layers=tuple(layers), norm=small(base.norm.weight), norm_eps=_eps(base.norm, cfg),
        head=lin(model.lm_head), inv_freq=rotary.inv_freq.detach().to(device=embed.device, dtype=torch.float32),
        rope_scaling=float(getattr(rotary, "attention_scaling", 1.0) or 1.0), heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=_head_dim(cfg))


class LeanLlamaRunner:
    """Llama-family causal LM over a contiguous per-row KV cache (see the module docstring)."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, compute_dtype: Optional[torch.dtype] = None,
                 hidden_taps: Optional[Sequence[int]] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        reason = unsupported_reason(model, max_seq_len)
        if reason is not None:
            raise NotImplementedError(f"LeanLlamaRunner: {reason}")
        self.model = model
        self.max_batch_size, self.max_seq_len = int(max_batch_size), int(max_seq_len)
        recheck_weights()  # (the copies of weights written through .data since the last generation: made again)
        weight_dtype = model.model.embed_tokens.weight.dtype
        # compute_dtype None: the model's own weight tensors (no copies). Otherwise, on the torch path,
        # the weights are cast once (a copy: torch's half-precision GEMVs are slow on a CPU); the CPU
        # kernels read them as they are, and their norms and biases in fp32 (converted once here, not per call).
        self.dtype = compute_dtype or weight_dtype
        self.kernels_reason = _kernels_reason(model, self.dtype)
        on_kernels = self.kernels_reason is None
        if on_kernels:
            cast, small = (lambda w: w), _f32
        elif self.dtype == weight_dtype:
            cast = small = (lambda w: w)
        else:
            cast = small = (lambda w: cached_cast(w, self.dtype))
        self.weights = _llama_weights(model, text_config(model.config), cast, small)
        self.hidden_taps = check_tap_layers(hidden_taps, len(self.weights.layers))  # runners/taps.py
        self._segments = _tap_segments(self.weights, self.hidden_taps)
        self._taps: Optional[TapBuffer] = None
        self.device = self.weights.embed.device
        self.vocab_size: int = output_vocab_size(model)
        # bf16 activations for a bf16 model computed in bf16 (VDPBF16PS where the CPU has it)
        self.bf16_activations = on_kernels and self.dtype == weight_dtype == torch.bfloat16
        self._torch = None if on_kernels else TorchForward(self.weights, self.dtype, model.lm_head,
                                                           self.max_batch_size, self.hidden_taps)
        self._cache_dtype = self.dtype if on_kernels else self._torch.attn_dtype
        self._batch = 0
        self._len: List[int] = []         # committed tokens per row (host: the source of truth)
        self._tentative: List[int] = []   # tokens written by the last forward, per row
        self._tree = False                # whether the last forward was a tree
        self._in_use = RowsInUse(self.max_batch_size)  # continuous batching: start_rows / free_rows
        self._rows = torch.arange(self.max_batch_size, dtype=torch.int64)  # the kernels' cache rows 0 .. B-1
        self.k_cache: Optional[torch.Tensor] = None
        self._alloc(self.max_seq_len + CAPACITY_SLACK)

    # ------------------------------------------------------------------ storage
    def _alloc(self, capacity: int) -> None:
        w = self.weights
        shape = (len(w.layers), self.max_batch_size, w.kv_heads, capacity, w.head_dim)
        k = torch.zeros(shape, dtype=self._cache_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self._cache_dtype, device=self.device)
        if self.k_cache is not None:
            n = self.k_cache.shape[3]
            k[:, :, :, :n] = self.k_cache
            v[:, :, :, :n] = self.v_cache
        self.k_cache, self.v_cache = k, v
        self._cache = [k, v]  # the ops' cache list
        if self.hidden_taps is not None and self._taps is None:
            self._taps = TapBuffer(self.hidden_taps, w.embed.shape[1], self.max_batch_size, capacity, self.device)
        elif self._taps is not None:
            self._taps.grow(capacity)
        self.capacity = capacity
        self._arange = torch.arange(capacity, device=self.device)
        if self._torch is None:
            self._rope = rope_tables(w, capacity)  # the kernels' [cos, sin]
        else:
            self._torch.resize(capacity)

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row, int64 on the model's device. Shape: [B]."""
        return torch.tensor(self._len, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ the model
    def _model(self, ids: torch.Tensor, start: List[int], keep: Optional[torch.Tensor],
               tree: Optional[tuple] = None, counts: Optional[Sequence[int]] = None,
               cache_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [B, T]; row b's token t stored at start[b] + t, the first counts[b] (default T) of them real.
        cache_rows [B] int64: the cache row of each batch row (start_rows); None: rows 0..B-1.
        Chain (tree None): at position start[b] + t, seeing positions <= start[b] + t. Tree (ancestors
        [B, T, T] bool, depth [B, T] int64; see trees.token_tree_inputs): at position start[b] + depth[b, t],
        seeing the prefix and its ancestors. keep: None (logits of every token, [B, T, V]) or column
        indices [B] ([B, V]). fp32 logits."""
        S = max(start) + ids.shape[1]
        if S > self.capacity:
            self._alloc(S + CAPACITY_SLACK)
        if self._torch is not None:
            logits = self._torch(ids, start, keep, tree, counts, cache_rows, self._cache)
            if self._taps is not None:
                self._write_taps(self._torch.tapped, start, ids.shape, cache_rows)
            return logits
        return self._kernel_forward(ids, start, keep, tree, cache_rows)

    def _write_taps(self, tapped: Sequence[torch.Tensor], start: Sequence[int], shape, cache_rows) -> None:
        """The tapped states of a forward's B x T tokens at their cache rows and storage slots (start[b] + t)."""
        B, T = shape
        rows = (self._rows[:B] if cache_rows is None else cache_rows.to("cpu", torch.int64)).repeat_interleave(T)
        slots = (torch.tensor(start, dtype=torch.int64)[:, None] + torch.arange(T, dtype=torch.int64)).reshape(-1)
        self._taps.write(rows, slots, tapped)

    def _kernel_layers(self, x: torch.Tensor, layout: List[torch.Tensor], visible: Optional[torch.Tensor]
                       ) -> Optional[List[torch.Tensor]]:
        """``decoder_layers`` over the whole stack, or per stretch between tapped layers; the tapped
        states [M, d] in ``hidden_taps`` order (None without taps)."""
        if self.hidden_taps is None:
            decoder_layers(x, self.weights, self.bf16_activations, self._rope, self._cache, layout, visible)
            return None
        captured = {}
        for begin, end, weights in self._segments:
            if end > begin:
                cache = [c[begin:end] for c in self._cache]  # (a slice of the leading dim: contiguous)
                decoder_layers(x, weights, self.bf16_activations, self._rope, cache, layout, visible)
            if end < len(self.weights.layers):
                captured[end] = x.clone()  # the input of layer `end`
        return [captured[layer] for layer in self.hidden_taps]

    def _kernel_forward(self, ids: torch.Tensor, start: Sequence[int], keep: Optional[torch.Tensor],
                        tree: Optional[tuple], cache_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """``_model`` on the CPU kernels (padding columns need no count: they are written past the rows'
        tokens). The head's hooks, when it has some, are called around the kernel's logits
        (lean_cpu.call_head_hooks), never torch's head, whose half-precision GEMM differs with the rows."""
        B, T = ids.shape
        M = B * T
        begin = torch.tensor(start, dtype=torch.int64)
        one = T == 1  # a one-token pass (a draft or plain step): each row's slot is its start
        slots = begin if one else (begin[:, None] + torch.arange(T, dtype=torch.int64)).reshape(M)
        if tree is None:
            positions, visible = slots, None
        else:
            ancestors, depth = tree
            positions = (begin[:, None] + depth.to(torch.int64)).reshape(M)
            visible = ancestors.contiguous()
        rows = self._rows[:B] if cache_rows is None else cache_rows.to("cpu", torch.int64)
        w = self.weights
        x = F.embedding(ids.reshape(M), w.embed).float()  # [M, d], the residual stream
        tapped = self._kernel_layers(x, [positions, rows if one else rows.repeat_interleave(T), slots, begin], visible)
        if tapped is not None:
            self._write_taps(tapped, start, (B, T), cache_rows)
        if keep is not None:
            x = x.view(B, T, -1)[self._rows[:B], keep]  # [B, d]
        logits = llama_head(x, w, self.bf16_activations)  # [M or B, V]
        shaped = (lambda t: t) if keep is not None else (lambda t: t.view(B, T, -1))
        head = self.model.lm_head
        if _hooked(head):  # heads on the target read its input
            h = F.rms_norm(x, w.norm.shape, w.norm, w.norm_eps).to(head.weight.dtype)
            call_head_hooks(head, shaped(h), shaped(logits))
        return shaped(logits)

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

    def extend_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Chunked prefill: append ``chunks`` to the caches of ``rows`` (in use; between steps, nothing
        tentative), the other rows untouched; returns the logits at each chunk's last token, fp32 [n, V].
        A prompt prefilled as start_rows(its first chunk) then extend_rows(the next ones) leaves the cache
        and the last logits that start_rows(the whole prompt) does. lengths[rows[i]] += len(chunks[i])."""
        rows = self._in_use.check_used("extend_rows", rows, len(chunks))
        begin = [self._len[row] for row in rows]
        check_extend_chunks(chunks, begin, self.max_seq_len)
        ids = torch.zeros((len(chunks), max(len(c) for c in chunks)), dtype=torch.int64)
        for i, chunk in enumerate(chunks):
            ids[i, : len(chunk)] = torch.as_tensor(list(chunk), dtype=torch.int64)
        last = torch.tensor([len(c) - 1 for c in chunks], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            logits = self._model(ids.to(self.device), begin, last,
                                 cache_rows=torch.tensor(rows, dtype=torch.int64, device=self.device))
        for row, chunk in zip(rows, chunks):
            self._len[row] += len(chunk)
        return logits

    def fork_rows(self, source: int, rows: Sequence[int]) -> None:
        """Continuous batching (between steps): free ``rows`` take row ``source``'s committed tokens without
        a forward: its keys and values (and tapped states) are copied into their cache rows (each slot owns
        its positions here, so nothing can be shared); the logits at the last token are the source's."""
        source = int(source)
        if source not in self._in_use:
            raise ValueError(f"fork_rows: source row {source} is not in use (start_rows it first)")
        rows = self._in_use.check_free("fork_rows", rows, len(rows))
        length = self._len[source]  # (a row in use lies inside the width)
        for cache in (self.k_cache, self.v_cache):  # [layers, Bmax, Hk, cap, D]
            cache[:, rows, :, :length] = cache[:, source: source + 1, :, :length]
        if self._taps is not None:
            self._taps.states[rows, :length] = self._taps.states[source, :length]
        self._in_use.add(rows)
        self._resize(self._in_use.width)
        for row in rows:
            self._len[row] = length

    def hold_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching: free ``rows`` count as in use with empty caches, without a forward (the
        batch spans them; each is a free row inside the width until free_rows)."""
        rows = self._in_use.check_free("hold_rows", rows, len(rows))
        self._in_use.add(rows)
        self._resize(self._in_use.width)

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
        (None: 0..n-1): one forward per group of prompts of similar lengths (``prefill_groups``), or one
        forward where the head is hooked (heads on the target read the whole batch's states at once)."""
        head = self.model.lm_head
        groups = prefill_groups([len(p) for p in prompts])
        if len(groups) == 1 or _hooked(head):
            return self._prefill_block(prompts, cache_rows)
        rows = torch.arange(len(prompts), dtype=torch.int64, device=self.device) if cache_rows is None else cache_rows
        logits = None
        for group in groups:
            index = torch.tensor(group, dtype=torch.int64, device=self.device)
            block = self._prefill_block([prompts[i] for i in group], rows[index])  # [len(group), V]
            if logits is None:
                logits = block.new_empty((len(prompts), block.shape[-1]))
            logits[index] = block
        return logits

    def _prefill_block(self, prompts: Sequence[Sequence[int]], cache_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """``_prefill`` in one forward [n, T_max]."""
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
        return self._torch is None and not _hooked(self.model.lm_head) and self._taps is None

    @property
    def capabilities(self) -> RunnerCapabilities:
        """What this runner does beyond the ``ModelRunner`` contract (``lean_capabilities`` before it exists)."""
        return RunnerCapabilities(greedy_chain=self.chains_greedy, chunked_prefill=True,
                                  hidden_taps=self._taps is not None)

    def tapped_states(self, positions: torch.Tensor) -> torch.Tensor:
        """The tapped hidden states (runners/taps.py) of row b's committed tokens at ``positions[b]``
        (< lengths[b]; others are unspecified): positions [B, W] int64 -> [B, W, n * d] fp32."""
        if self._taps is None:
            raise ValueError("tapped_states: this runner was built without hidden_taps")
        return self._taps.gather(self._rows[: positions.shape[0]], positions)

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
        rows = [self._rows[:self._batch], torch.tensor(self._len, dtype=torch.int64)]
        if feed is not None:
            counts = self._feed_counts(feed, feed_counts)
            fed = [f + c for f, c in zip(fed, counts)]
            rows += [feed.to("cpu", torch.int64).contiguous(), torch.tensor(counts, dtype=torch.int64)]
        for b, length in enumerate(self._len):
            if length + fed[b] > self.max_seq_len:
                raise ValueError(f"row {b} would hold {length + fed[b]} tokens, more than max_seq_len={self.max_seq_len}")
        limit = self.vocab_size if vocab_limit is None else vocab_limit
        with torch.no_grad():
            greedy_chain(tokens, steps, self.weights, self.bf16_activations, self._rope, self._cache, rows, limit,
                         check_logits)
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
                if self._taps is not None:
                    self._taps.move(b, src, dst)
        self._len = [length for _, length in plan]
        self._tentative = [0] * self._batch
        self._tree = False

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to shorter committed lengths (never grows). new_lengths [B] int."""
        self._len = check_row_counts("truncate", "new_lengths", new_lengths, self._len, self._batch)
        self._tentative = [0] * self._batch


def _tap_segments(weights: LlamaWeights, taps: Optional[Tuple[int, ...]]) -> List[Tuple[int, int, LlamaWeights]]:
    """The stretches of layers [begin, end) between tapped layers and the last one, each with its own
    ``LlamaWeights`` (the same tensors): after a stretch, x is the input of layer ``end``. Empty without taps."""
    if taps is None:
        return []
    bounds = [0] + sorted(set(taps)) + [len(weights.layers)]
    return [(begin, end, dataclasses.replace(weights, layers=weights.layers[begin:end]))
            for begin, end in zip(bounds, bounds[1:])]


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A norm or bias for the kernels: fp32, once (the ops would convert it at every call otherwise)."""
    return None if t is None else t.detach().float().contiguous()


def _eps(norm, cfg) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return float(eps if eps is not None else cfg.rms_norm_eps)
