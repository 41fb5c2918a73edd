"""Hugging Face integration of the paged KV cache: a ``transformers.Cache`` over a PagedKVCache, and
the attention + mask functions registered as ``"specdec_paged"``.

How a forward runs (driven by :class:`specdec_ext.runners.paged.PagedModelRunner`):

* the runner sets, for the whole forward, a :class:`PagedStep` on the cache: the slot of every new
  token ``slot_mapping [B, T]`` (-1 = padding, not kept), the pages to read ``gather_pages [B, P]``
  and the additive float mask ``[B, 1, T, P * page_size]`` (0 = attend, dtype-min = masked) that
  encodes prefix + chain/tree visibility per row; it passes that mask as the model's
  ``attention_mask`` (transformers returns a 4D mask as-is), and explicit ``position_ids``;
* each attention layer calls ``cache.update(k, v, layer_idx)``: the new K/V go into the pages with
  ``ops.kv_write`` and the row's pages come back gathered, ``[B, H_kv, P * page_size, D]``, in one
  batched index per layer (no loop over rows);
* the registered attention function runs ``scaled_dot_product_attention`` with that float mask
  (GQA through ``enable_gqa``); a sliding-window layer (the model passes ``sliding_window=w``) gets
  the mask restricted to keys within w positions (``PagedStep.mask_for``, from the step's layout:
  a tree node's window counts along its path), as does a layer HF's own cache keeps a window for; attention logit softcapping (Gemma 2) and attention
  sinks (gpt-oss) run the attention written out (``eager_attention``: SDPA has neither);
* ALiBi models that build their bias from the attention mask (Bloom: ``build_alibi_tensor``) get it
  from the key positions of the step instead (``install_alibi``).

The page pool holds the largest key/value head count and head size any layer produces
(support.kv_layout, from a probe of the model); a layer with smaller keys or values is padded on
write and sliced back on read.

Outside a paged forward (``PagedStep`` not active) the registered functions fall back to the model's
own attention implementation and mask (remembered by ``keep_original_implementation``), so a model
switched to ``"specdec_paged"`` still runs plain HF forwards (e.g. HF's generate) as before.

transformers 5.17 / 5.18 call ``past_key_values.update(k, v, layer_idx, cache_kwargs)`` and take
``past_key_values=``; 5.2x call ``cache.update(k, v, layer_idx, kwargs=...)`` and take ``cache=``
(``past_key_values=`` still works with a warning): :func:`cache_argument_name` picks the right one.
"""
from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from .. import ops
from .kv_cache import PagedKVCache
from .layout import StepLayout, additive_mask
from .support import KVLayout

ATTN_IMPLEMENTATION = "specdec_paged"
FALLBACK_ATTRIBUTE = "_specdec_original_attn_implementation"  # on a switched model's configs


@dataclass
class PagedStep:
    """Per-forward inputs of the paged attention (all on the model's device)."""

    slot_mapping: torch.Tensor   # [B, T] int64: slot of each new token, -1 = padding (not kept)
    gather_pages: torch.Tensor   # [B, P] int64: pages to read per row (>= 0; unused ones masked)
    mask: torch.Tensor           # [B, 1, T, P * page_size] model dtype, additive (0 / dtype min)
    layout: StepLayout           # positions and visibility of the step (windows, ALiBi)
    windows: Tuple[Optional[int], ...]  # per layer: the sliding window HF's own cache keeps (None: all)
    layer: int = 0               # the layer in flight (set by PagedCache.update, read by the attention)
    windowed: Dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask (made on first use)

    def mask_for(self, window: Optional[int]) -> torch.Tensor:
        """The additive mask of a layer: the full one, or restricted to a sliding window of positions."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            self.windowed[window] = additive_mask(self.layout.window_visible(int(window)), self.mask.dtype)
        return self.windowed[window]


class _ActiveStep(threading.local):
    """The paged step in flight in this thread (set by PagedCache.activate); None outside a paged forward.
    Per thread: two threads running paged forwards at once (a server's engine beside a generate() call)
    each see their own step."""

    step: Optional[PagedStep] = None


_Active = _ActiveStep()


def paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """Attention over the gathered pages: query [B, Hq, T, D], key/value [B, Hkv, S, D], the step's
    additive mask [B, 1, T, S] (windowed for a sliding-window layer). Returns ([B, T, Hq, D], None)."""
    step = _Active.step
    if step is None:  # a plain HF forward: behave exactly as the model's own implementation
        return _original_attention(module)(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
    # the window the model passes, else the one HF's own cache would keep for this layer (a model
    # may apply its window only through its cache or its own mask, both of which are ours here)
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else step.windows[step.layer]
    mask = step.mask_for(window)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None or sinks is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = eager_attention(query, key, value, mask, scale, softcap=softcap, sinks=sinks)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def eager_attention(query, key, value, mask, scaling: float, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention written out, as HF's eager attention computes it, for what SDPA has no argument for:
    logit softcapping (scores -> softcap * tanh(scores / softcap), Gemma 2) and attention sinks (one
    learnt logit per head joins every softmax and takes its share of the mass, gpt-oss).
    query [B, Hq, T, D], key/value [B, Hkv, S, D], mask [B, 1, T, S], sinks [Hq] -> [B, Hq, T, Dv]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(query.dtype)
    return torch.matmul(probs, value)


def paged_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """Mask function of ``"specdec_paged"``: the runner's float mask during a paged forward (it
    normally arrives as the 4D ``attention_mask`` and is returned as-is before this is reached),
    the mask of the model's own implementation otherwise."""
    step = _Active.step
    if step is not None:
        return step.mask
    name = getattr(kwargs.get("config"), FALLBACK_ATTRIBUTE, "sdpa")
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    return mask_function(batch_size=batch_size, q_length=q_length, kv_length=kv_length, *args, **kwargs)


def keep_original_implementation(model) -> None:
    """Remember the attention implementation the model had before it is switched to "specdec_paged",
    on each of its configs: outside a paged forward the switched model still runs exactly as before
    (eager for softcapping or sinks, where sdpa would refuse)."""
    from .checks import text_config

    for config in {id(c): c for c in (model.config, text_config(model.config))}.values():
        current = getattr(config, "_attn_implementation", None) or "sdpa"
        if current != ATTN_IMPLEMENTATION and not hasattr(config, FALLBACK_ATTRIBUTE):
            setattr(config, FALLBACK_ATTRIBUTE, current)


def _original_attention(module):
    """The attention function of the model's own implementation (module docstring: outside a paged forward)."""
    name = getattr(getattr(module, "config", None), FALLBACK_ATTRIBUTE, "sdpa")
    if name == "eager":  # each modeling file defines its own eager attention
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager
    if name in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[name]
    return sdpa_attention_forward


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name.

    transformers 5 needs both registrations: with only the attention function, mask creation for a
    custom name would be skipped and a multi-token cached forward would silently attend everywhere.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
    return ATTN_IMPLEMENTATION


register()


def cache_argument_name(model) -> str:
    """``"cache"`` for transformers 5.2x models, ``"past_key_values"`` for 5.17 / 5.18."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _fit(states: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, h, d] zero-padded to [B, T, heads, head_dim] (a layer smaller than the page pool)."""
    h, d = states.shape[2], states.shape[3]
    if h == heads and d == head_dim:
        return states
    return F.pad(states, (0, head_dim - d, 0, heads - h))


def install_alibi(model) -> None:
    """Bloom builds its ALiBi bias from a 2D attention mask (``build_alibi_tensor``), which a paged step
    does not have: during a paged forward the bias comes from the step's key positions instead (the
    same bias for a chain; a tree node's keys at their path's positions). Idempotent."""
    base = getattr(model, "base_model", model)
    original = getattr(base, "build_alibi_tensor", None)
    if original is None or getattr(original, "_specdec_paged", False):
        return
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    def build_alibi_tensor(attention_mask, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        step = _Active.step
        if step is None:
            return original(attention_mask, num_heads, dtype)
        positions = step.layout.key_positions  # [B, S]
        slopes = _get_alibi_slopes(num_heads, positions.device)  # [H]
        alibi = slopes[None, :, None] * positions[:, None, :].to(slopes.dtype)  # [B, H, S]
        return alibi.reshape(-1, 1, positions.shape[1]).to(dtype)

    build_alibi_tensor._specdec_paged = True
    base.build_alibi_tensor = build_alibi_tensor


class PagedCache(Cache):
    """A ``transformers.Cache`` whose storage is a :class:`PagedKVCache`.

    ``update`` writes the new K/V of the current :class:`PagedStep` into the pages and returns
    every row's pages gathered into a padded ``[B, H_kv, S, D]`` tensor (S = P * page_size); the
    float mask of the step hides what a row must not see (other rows' pages never appear: each row
    gathers only its own).
    """

    is_compileable = False

    def __init__(self, kv: PagedKVCache, layout: KVLayout):
        super().__init__(layers=[])
        self.kv = kv
        self.layout = layout
        self.step: Optional[PagedStep] = None

    def activate(self, step: Optional[PagedStep]) -> None:
        """Set (or clear, with None) the step of the forward in flight."""
        self.step = step
        _Active.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs):
        """key/value_states [B, H_kv, T, D] -> gathered (keys, values) [B, H_kv, S, D] (the layer's own
        head counts and sizes; the pool's are the largest of any layer)."""
        step = self.step
        if step is None:
            raise RuntimeError("PagedCache.update called outside a PagedModelRunner forward")
        step.layer = layer_idx
        layer = self.kv.pool[layer_idx]  # [2, num_pages, page_size, H, D]
        H, D = self.kv.num_kv_heads, self.kv.head_dim
        ops.kv_write(_fit(key_states.transpose(1, 2), H, D), _fit(value_states.transpose(1, 2), H, D),
                     step.slot_mapping, layer)
        batch, pages = step.gather_pages.shape
        # One batched gather of every row's pages (index_select: ~3x faster than advanced indexing
        # on the CPU): [2, B * P, page_size * H * D] -> [2, B, S, H, D].
        kv = layer.view(2, layer.shape[1], -1).index_select(1, step.gather_pages.view(-1))
        kv = kv.view(2, batch, pages * self.kv.page_size, H, D)
        kv = kv.transpose(2, 3)  # [2, B, H, S, D]
        hk, dk, hv, dv = self.layout.layers[layer_idx]
        return kv[0, :, :hk, :, :dk], kv[1, :, :hv, :, :dv]

    # --- the queries transformers may make of a cache -------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = self.kv.host_lengths()
        return max(lengths) if lengths else 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0):
        if self.step is not None:
            return self.step.mask.shape[-1], 0
        return self.get_seq_length() + int(query_length if not isinstance(query_length, torch.Tensor)
                                           else query_length.shape[0]), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.kv.max_len

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.kv.max_len

    @property
    def is_sliding(self):
        return [False] * self.kv.num_layers

    @property
    def is_linear(self):
        return [False] * self.kv.num_layers

    @property
    def is_dummy(self):
        return [False] * self.kv.num_layers

    def __len__(self) -> int:
        return self.kv.num_layers

    def reset(self) -> None:
        self.kv.free_all()

    def __repr__(self) -> str:
        return (f"PagedCache(layers={self.kv.num_layers}, pages={self.kv.num_pages}x{self.kv.page_size}, "
                f"free={self.kv.num_free_pages})")
