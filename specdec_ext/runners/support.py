"""Which HF models the paged runner can run, and the shape of their key/value cache.

The cache is sized from what the model actually produces, not from its config (a multi-query Falcon
caches one key head whatever ``num_key_value_heads`` says; MLA models such as DeepSeek-V3 cache a
latent key and a smaller value; some models mix layer shapes): ``kv_layout(model)`` runs one
two-token forward with HF's own cache, once per model, and reads every layer's key and value shapes.
It also reads which layers HF's cache keeps a sliding window for (a model may apply its window only
through that cache, or only through its own mask: the paged attention then applies it from here).
The same probe refuses, before any work, a model whose cache is not keys and values (recurrent or
linear-attention layers, a cache class of its own). ``unsupported_reason(model)`` also names the
architectures and features the paged attention does not implement (found by
python_tests/test_architectures.py, which runs every decoder architecture of transformers).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .checks import text_config

PROBE_TOKENS = 2

# Architectures whose forward the paged runner cannot drive, with the missing feature.
UNSUPPORTED_MODEL_TYPES = {
    "gpt_neox_japanese": "GPT-NeoX-Japanese reshapes the cached keys with .view, which needs contiguous cache tensors",
    "doge": "Doge's dynamic mask attention computes its own mask from the values",
    "moshi": ("Moshi's sliding window lives only in HF's cache eviction, not in its mask, so a pass over several "
              "tokens sees more than the window in HF itself: no one rule to reproduce"),
}


# ALiBi models have no absolute positions (so no position_ids); their bias comes from the cache's key
# positions: Bloom's through hf_paged.install_alibi (trees too), MPT's from the cache slot index, which
# is right for a chain only (its 3-D position bias has no batch dimension to carry a tree's depths).
ALIBI_MODEL_TYPES = ("bloom", "mpt")
SLOT_ALIBI_MODEL_TYPES = ("mpt",)


class UnsupportedModelError(ValueError):
    """The model cannot run over the paged KV cache (the message names the architecture and why)."""


@dataclass(frozen=True)
class KVLayout:
    """Per layer (key heads, key head dim, value heads, value head dim), as the model produces them, and
    the sliding window HF's own cache keeps for the layer (None: every position)."""

    layers: Tuple[Tuple[int, int, int, int], ...]
    windows: Tuple[Optional[int], ...]
    dtype: torch.dtype  # the keys' and values' (the page pool's; not always the first parameter's: a model
    #                     whose embedding was cast alone computes its layers in another dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def heads(self) -> int:
        """Heads of the page pool: the most any key or value of any layer has."""
        return max(max(hk, hv) for hk, _, hv, _ in self.layers)

    @property
    def head_dim(self) -> int:
        """Head size of the page pool: the largest of any key or value of any layer."""
        return max(max(dk, dv) for _, dk, _, dv in self.layers)


_LAYOUTS = WeakIdKeyDictionary()  # model -> KVLayout or the reason it has none


def model_type(model) -> str:
    return str(getattr(text_config(model.config), "model_type", None) or getattr(model.config, "model_type", "?"))


def unsupported_reason(model, tree: bool = False, cache_len: Optional[int] = None) -> Optional[str]:
    """None when the paged runner can run ``model`` (with tree forwards when ``tree``, rows of up to
    ``cache_len`` positions: None, any); else why not, naming the architecture."""
    name = model_type(model)
    if name in UNSUPPORTED_MODEL_TYPES:
        return f"{name}: {UNSUPPORTED_MODEL_TYPES[name]}"
    if tree and name in SLOT_ALIBI_MODEL_TYPES:
        return f"{name}: its ALiBi bias follows cache slots, not a tree node's depth (draft chains, not trees)"
    if not _takes_position_ids(model) and name not in ALIBI_MODEL_TYPES:
        return (f"{name}: its forward takes no position_ids (it computes positions from the cache length, which "
                "a ragged batch of rows cannot give it)")
    cfg = text_config(model.config)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(cfg, "layer_types", None) or ()) and (cache_len is None or cache_len > chunk):
        return (f"{name}: chunked attention (attention_chunk_size={chunk}) over rows of "
                f"{'any length' if cache_len is None else f'{cache_len} positions'}: a layer sees its own chunk only, "
                f"which HF's cache keeps as a sliding window (the same within one chunk)")
    if getattr(cfg, "alibi", False) and name == "falcon":
        return f"{name}: Falcon with ALiBi (alibi=True) builds its bias from a 2D attention mask"
    layout = _probe(model)
    return layout if isinstance(layout, str) else None


def _takes_position_ids(model) -> bool:
    """Whether ``model.forward`` takes position_ids: by name, or through ``**kwargs`` of a wrapper (a subclass's
    or an instance's pass-through forward) over a class forward that names it."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper runs the module's own forward
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return False
    return any("position_ids" in inspect.signature(cls.__dict__["forward"]).parameters
               for cls in type(model).__mro__ if callable(cls.__dict__.get("forward")))


def kv_layout(model, cache_len: Optional[int] = None) -> KVLayout:
    """The cache shapes of ``model`` (module docstring) for rows of up to ``cache_len`` positions; raises
    UnsupportedModelError naming why not."""
    reason = unsupported_reason(model, cache_len=cache_len)
    if reason is not None:
        raise UnsupportedModelError(f"the paged runner cannot run {reason}")
    return _probe(model)


def _probe(model):
    """KVLayout, or the reason (a str) the model's cache is not keys and values; cached per model."""
    hit = _LAYOUTS.get(model)
    if hit is not None:
        return hit
    name = model_type(model)
    device = next(model.parameters()).device
    ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        result = _layout_of(name, getattr(out, "past_key_values", None))
    except Exception as error:  # the model's own forward failed: say so rather than fail inside ours
        result = f"{name}: a plain two-token forward with HF's cache failed ({type(error).__name__}: {error})"
    _LAYOUTS[model] = result
    return result


def _layout_of(name: str, cache):
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if cache is None:
        return f"{name}: the model returns no cache"
    if type(cache) is not DynamicCache:
        return f"{name}: the model keeps a cache of its own ({type(cache).__name__})"
    layers, windows, dtypes = [], [], set()
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or not isinstance(keys, torch.Tensor)
                or not isinstance(values, torch.Tensor) or keys.dim() != 4):
            return (f"{name}: layer {i} keeps {type(layer).__name__} state (recurrent, convolution or compressed "
                    "attention), not plain keys and values")
        if keys.shape[2] != PROBE_TOKENS or values.shape[2] != PROBE_TOKENS:
            return f"{name}: layer {i} caches {keys.shape[2]} positions for {PROBE_TOKENS} tokens"
        layers.append((keys.shape[1], keys.shape[3], values.shape[1], values.shape[3]))
        windows.append(getattr(layer, "sliding_window", None))
        dtypes |= {keys.dtype, values.dtype}
    if not layers:
        return f"{name}: the model caches nothing"
    if len(dtypes) > 1:
        return f"{name}: its layers cache keys and values in several dtypes ({', '.join(sorted(map(str, dtypes)))})"
    return KVLayout(tuple(layers), tuple(windows), dtypes.pop())
