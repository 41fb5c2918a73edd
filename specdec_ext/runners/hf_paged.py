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
  (GQA through ``enable_gqa``).

Outside a paged forward (``PagedStep`` not active) the registered functions fall back to HF's own
``sdpa`` attention and mask, so a model switched to ``"specdec_paged"`` still runs plain HF forwards
(e.g. with a DynamicCache) correctly.

transformers 5.17 / 5.18 call ``past_key_values.update(k, v, layer_idx, cache_kwargs)`` and take
``past_key_values=``; 5.2x call ``cache.update(k, v, layer_idx, kwargs=...)`` and take ``cache=``
(``past_key_values=`` still works with a warning): :func:`cache_argument_name` picks the right one.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops
from .kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "specdec_paged"


@dataclass
class PagedStep:
    """Per-forward inputs of the paged attention (all on the model's device)."""

    slot_mapping: torch.Tensor   # [B, T] int64: slot of each new token, -1 = padding (not kept)
    gather_pages: torch.Tensor   # [B, P] int64: pages to read per row (>= 0; unused ones masked)
    mask: torch.Tensor           # [B, 1, T, P * page_size] model dtype, additive (0 / dtype min)


class _Active:
    """The paged step in flight (set by PagedCache.activate); None outside a paged forward."""

    step: Optional[PagedStep] = None


def paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """Attention over the gathered pages: query [B, Hq, T, D], key/value [B, Hkv, S, D],
    attention_mask [B, 1, T, S] additive float. Returns ([B, T, Hq, D], None)."""
    if _Active.step is None:  # a plain HF forward: behave exactly as the sdpa implementation
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("specdec_paged attention does not support attention logit softcapping")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[-2] > window:
        raise NotImplementedError(
            f"specdec_paged attention does not implement sliding windows ({window}) shorter than "
            f"the keys ({key.shape[-2]})")
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def paged_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """Mask function of ``"specdec_paged"``: the runner's float mask during a paged forward (it
    normally arrives as the 4D ``attention_mask`` and is returned as-is before this is reached),
    HF's sdpa mask otherwise."""
    step = _Active.step
    if step is not None:
        return step.mask
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, *args, **kwargs)


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


class PagedCache(Cache):
    """A ``transformers.Cache`` whose storage is a :class:`PagedKVCache`.

    ``update`` writes the new K/V of the current :class:`PagedStep` into the pages and returns
    every row's pages gathered into a padded ``[B, H_kv, S, D]`` tensor (S = P * page_size); the
    float mask of the step hides what a row must not see (other rows' pages never appear: each row
    gathers only its own).
    """

    is_compileable = False

    def __init__(self, kv: PagedKVCache):
        super().__init__(layers=[])
        self.kv = kv
        self.step: Optional[PagedStep] = None

    def activate(self, step: Optional[PagedStep]) -> None:
        """Set (or clear, with None) the step of the forward in flight."""
        self.step = step
        _Active.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs):
        """key/value_states [B, H_kv, T, D] -> gathered (keys, values) [B, H_kv, S, D]."""
        step = self.step
        if step is None:
            raise RuntimeError("PagedCache.update called outside a PagedModelRunner forward")
        layer = self.kv.pool[layer_idx]  # [2, num_pages, page_size, H, D]
        ops.kv_write(key_states.transpose(1, 2), value_states.transpose(1, 2), step.slot_mapping, layer)
        batch, pages = step.gather_pages.shape
        # One batched gather of every row's pages (index_select: ~3x faster than advanced indexing
        # on the CPU): [2, B * P, page_size * H * D] -> [2, B, S, H, D].
        kv = layer.view(2, layer.shape[1], -1).index_select(1, step.gather_pages.view(-1))
        kv = kv.view(2, batch, pages * self.kv.page_size, self.kv.num_kv_heads, self.kv.head_dim)
        kv = kv.transpose(2, 3)  # [2, B, H, S, D]
        return kv[0], kv[1]

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
