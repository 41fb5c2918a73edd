"""EAGLE-3 checkpoints: load the published layouts, write the first one, refuse a head made for another target.

Two layouts, told apart by config.json:

* ``"eagle"``: SafeAILab/EAGLE and SpecForge (``architectures: ["LlamaForCausalLMEagle3"]``): a flat Llama
  config of the draft layer (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``intermediate_size``, ``rms_norm_eps``, ``rope_theta`` / ``rope_scaling``, ``vocab_size`` = the
  target's) plus ``draft_vocab_size`` and ``target_hidden_size`` when the target is wider; the tapped
  layers, when pinned, in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's key). Tensors
  (``model.safetensors`` or ``pytorch_model.bin``): ``fc.weight`` [h, 3 H_t], ``midlayer.hidden_norm`` /
  ``input_layernorm`` / ``post_attention_layernorm.weight`` [h], ``midlayer.self_attn.{q,k,v}_proj.weight``
  [heads * D, 2h], ``o_proj`` [h, heads * D], ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``
  [h], ``lm_head.weight`` [V_d, h], ``d2t`` [V_d] int64 (target id - draft id), ``t2d`` [V] bool;
  ``embed_tokens.weight`` [V, h] is often left out (the target's embedding is used: EAGLE-3 freezes it).
* ``"speculators"``: vLLM's speculators (``speculators_model_type: "eagle3"``, ``architectures:
  ["Eagle3Speculator"]``): the layer's config nested in ``transformer_layer_config``; top-level
  ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``; ``speculators_config.verifier.name_or_path``. The same tensors
  with ``layers.0.`` for ``midlayer.`` (vLLM renames ``midlayer.`` to ``layers.0.`` when it loads the
  first layout), ``embed_tokens.weight`` included, ``fc.bias`` possibly.

A third weights file, this project's own compact storage (``save_eagle(..., int8=True)``; the bundled
head ships so): ``model.int8.safetensors``, each 2-D weight but the embedding as int8 with one fp32
scale per output row (``<name>.int8_scale``: the row's absolute maximum / 127), dequantized to fp32 at
load. A drafter may be any function (the output is the target's distribution whatever it proposes), so
rounding the head changes acceptance only, by what BENCHMARKS.md measures.

Layer ids are the inputs of those target layers (runners/taps.py); absent, the default (2, L // 2, L - 3)
of the target the head is bound to. The norm placement is the config's ``norm_before_residual``
(default False: the residual is the fused feature itself, SafeAILab/EAGLE's layer).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Tuple

import torch

from ..runners.checks import output_vocab_size, text_config
from ..runners.taps import default_tap_layers
from .model import Eagle3Model, EagleConfig

__all__ = ["load_eagle", "save_eagle", "check_target", "bind_target", "EagleMismatchError", "LAYOUTS",
           "quantize_rows", "dequantize_rows"]

LAYOUTS = ("eagle", "speculators")
CONFIG = "config.json"
INT8_WEIGHTS = "model.int8.safetensors"
WEIGHTS = ("model.safetensors", "pytorch_model.bin", INT8_WEIGHTS)
INT8_SCALE = ".int8_scale"  # suffix of a row-scale tensor in INT8_WEIGHTS
INT8_MAX = 127
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EMBED = "embed_tokens.weight"


class EagleMismatchError(ValueError):
    """The EAGLE head was not made for this target (hidden size, vocabulary or layers differ)."""


# ------------------------------------------------------------------------------------------ configs
def _layer_fields(layer: dict) -> dict:
    """EagleConfig fields of a Llama-style layer config dict (either layout)."""
    heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    rope = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return dict(hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                intermediate_size=int(layer["intermediate_size"]),
                vocab_size=int(layer["vocab_size"]), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                rope_theta=float(layer.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=dict(scaling) if scaling else None,
                max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
                attention_bias=bool(layer.get("attention_bias", False)))


def _layer_ids(config: dict) -> Optional[Tuple[int, ...]]:
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def config_from_dict(config: dict, fc_bias: bool = False) -> Tuple[str, EagleConfig]:
    """(layout, EagleConfig) of a checkpoint's config.json."""
    speculators = config.get("speculators_model_type") == "eagle3" or SPECULATORS_ARCHITECTURE in config.get(
        "architectures", [])
    layer = config["transformer_layer_config"] if speculators else config
    fields = _layer_fields(layer)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", "")
    fields.update(draft_vocab_size=int(config.get("draft_vocab_size") or fields["vocab_size"]),
                  target_hidden_size=int(config.get("target_hidden_size") or fields["hidden_size"]),
                  layer_ids=_layer_ids(config), norm_before_residual=bool(config.get("norm_before_residual", False)),
                  fc_bias=fc_bias, target_num_layers=config.get("target_num_hidden_layers"),
                  target_name_or_path=str(config.get("target_name_or_path") or verifier or ""))
    return ("speculators" if speculators else "eagle"), EagleConfig(**fields)


def config_to_dict(config: EagleConfig, layout: str) -> dict:
    """config.json of ``layout`` for ``config``."""
    layer = dict(architectures=[EAGLE_ARCHITECTURE], model_type="llama", hidden_act="silu", num_hidden_layers=1,
                 hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                 num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                 intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                 rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                 max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
                 attention_bias=config.attention_bias)
    if config.rope_scaling:
        layer["rope_scaling"] = dict(config.rope_scaling)
    eagle = dict(draft_vocab_size=config.draft_vocab_size, target_hidden_size=config.target_hidden_size,
                 norm_before_residual=config.norm_before_residual)
    if config.target_num_layers is not None:
        eagle["target_num_hidden_layers"] = config.target_num_layers
    ids = None if config.layer_ids is None else list(config.layer_ids)
    if layout == "eagle":
        out = dict(layer, **eagle, target_name_or_path=config.target_name_or_path)
        if ids is not None:
            out["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=ids, use_aux_hidden_state=True)
        return out
    layer.pop("architectures")
    return dict(architectures=[SPECULATORS_ARCHITECTURE], speculators_model_type="eagle3",
                transformer_layer_config=layer, eagle_aux_hidden_state_layer_ids=ids, **eagle,
                speculators_config=dict(algorithm="eagle3", default_proposal_method="greedy",
                                        verifier=dict(name_or_path=config.target_name_or_path)))


# ------------------------------------------------------------------------------------------ tensors
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # HF's sharded layout (large heads)


def _read_weights(path: str) -> dict:
    for index_name in SHARD_INDEXES:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            return _read_shards(path, index)
    for name in WEIGHTS:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(file)
                return dequantize_rows(state) if name == INT8_WEIGHTS else state
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"load_eagle: {path} holds none of {WEIGHTS} nor a shard index {SHARD_INDEXES} (an "
                            f"EAGLE-3 checkpoint directory holds {CONFIG} and its weights)")


def _read_shards(path: str, index: str) -> dict:
    """The tensors of a sharded checkpoint: its index's weight_map names each tensor's shard file."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"load_eagle: {index} is not a shard index with a weight_map ({error})") from None
    state = {}
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"load_eagle: {index} names the shard {shard}, which {path} does not hold")
        if shard.endswith(".safetensors"):
            from safetensors.torch import load_file
            state.update(load_file(file))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def quantize_rows(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """weight [n, m] float -> (int8 [n, m], fp32 scale [n]): row i is scale[i] * q[i] to within scale[i] / 2."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [n]
    return torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_rows(state: dict) -> dict:
    """An INT8_WEIGHTS state dict -> fp32 weights (each int8 tensor with a ``.int8_scale`` beside it)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(INT8_SCALE):
            continue
        scale = state.get(name + INT8_SCALE)
        out[name] = tensor.float() * scale.float()[:, None] if scale is not None else tensor
    return out


def _to_model_names(state: dict) -> dict:
    """Either layout's tensor names -> Eagle3Model's (``layers.0.`` -> ``midlayer.``, a ``model.`` prefix dropped)."""
    out = {}
    for name, tensor in state.items():
        name = name[len("model."):] if name.startswith("model.") and name != "model." else name
        out[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = tensor
    return out


def load_eagle(path: str, target=None, *, device=None) -> Eagle3Model:
    """Load an EAGLE-3 head written in either layout (module docstring), fp32, eval mode, no gradients.
    With ``target`` (a HF model): checked against it first (``check_target``: EagleMismatchError naming
    both values) and bound to it (default layer ids, its embedding when the checkpoint has none)."""
    config_path = os.path.join(path, CONFIG)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"load_eagle: {config_path} is missing")
    with open(config_path) as f:
        raw = json.load(f)
    state = _to_model_names(_read_weights(path))
    _, config = config_from_dict(raw, fc_bias="fc.bias" in state)
    if target is not None:
        config = bind_target(config, target)
    head = Eagle3Model(config)
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    full_vocab = config.draft_vocab_size == config.vocab_size  # no d2t / t2d needed: the identity (set by default)
    missing = [m for m in missing if m != EMBED and not (full_vocab and m in ("d2t", "t2d"))]
    if missing or unexpected:
        raise ValueError(f"load_eagle: {path}: tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    _check_draft_vocab(head, path)
    if EMBED not in state:
        if target is None:
            raise ValueError(f"load_eagle: {path} has no {EMBED}: pass target= (EAGLE-3 uses the target's embedding)")
        embedding = target.get_input_embeddings().weight
        if embedding.shape[-1] != config.hidden_size:
            raise ValueError(f"load_eagle: {path} has no {EMBED}, and the target's embedding is {embedding.shape[-1]} "
                             f"wide where the head's hidden_size is {config.hidden_size}: a head narrower than its "
                             f"target needs its own {EMBED}")
        if hasattr(embedding, "full_tensor"):  # a tensor-parallel target's DTensor: the whole table (replicated)
            embedding = embedding.full_tensor()
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embedding.float())
    head.to(device=device if device is not None else _device_of(target))
    return head.eval().requires_grad_(False)


def _check_draft_vocab(head: Eagle3Model, path: str) -> None:
    """d2t maps every draft id to a distinct target id inside the vocabulary, and t2d marks exactly those: a d2t
    written as absolute ids, or one that disagrees with t2d, drafted ids the head was not trained on (or failed
    mid-decode, naming neither the checkpoint nor d2t)."""
    ids = head.target_ids
    vocab = head.t2d.numel()
    bad = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
    if bad.numel():
        first = int(bad[0])
        raise ValueError(f"load_eagle: {path}: d2t maps draft id {first} to target id {int(ids[first])}, outside the "
                         f"vocabulary [0, {vocab}) (d2t holds offsets, target id - draft id, not the target ids)")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"load_eagle: {path}: d2t maps two draft ids to one target id")
    marked = torch.zeros_like(head.t2d)
    marked[ids] = True
    if not torch.equal(marked, head.t2d.bool()):
        raise ValueError(f"load_eagle: {path}: t2d marks {int(head.t2d.sum())} target ids, not the {ids.numel()} "
                         "that d2t maps the draft ids to: the two disagree")


def save_eagle(head: Eagle3Model, path: str, *, layout: str = "eagle", dtype: torch.dtype = torch.float32,
               embed: bool = True, int8: bool = False) -> None:
    """Write ``head`` as ``layout`` ("eagle": SafeAILab/EAGLE and SpecForge's; "speculators": vLLM's) in
    ``path`` (config.json, model.safetensors, tensors cast to ``dtype``; ``embed=False`` leaves the
    embedding out, as SafeAILab's releases do; ``int8=True`` writes INT8_WEIGHTS instead, the 2-D
    weights int8 with a scale per row: this project's compact storage, module docstring)."""
    from safetensors.torch import save_file
    if layout not in LAYOUTS:
        raise ValueError(f"save_eagle: layout must be one of {LAYOUTS}, got {layout!r}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config_to_dict(head.config, layout), f, indent=2, sort_keys=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name == EMBED and not embed:
            continue
        if layout == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        tensor = tensor.detach()
        if int8 and tensor.is_floating_point() and tensor.dim() == 2 and name != EMBED:
            state[name], state[name + INT8_SCALE] = (t.contiguous().cpu() for t in quantize_rows(tensor))
            continue
        state[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous().cpu()
    for stale in WEIGHTS:  # one weights file per directory: _read_weights takes the first it finds
        if os.path.isfile(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    save_file(state, os.path.join(path, INT8_WEIGHTS if int8 else WEIGHTS[0]))


# ------------------------------------------------------------------------------------------ the target
def _target_shape(target) -> Tuple[int, int, int]:
    """(hidden size, output vocabulary, decoder layers) of a HF target."""
    cfg = text_config(target.config)
    return int(cfg.hidden_size), output_vocab_size(target), int(cfg.num_hidden_layers)


def check_target(config: EagleConfig, target) -> None:
    """Raise EagleMismatchError, naming both values, unless a head of ``config`` reads ``target``: its
    hidden states' width, its vocabulary, its layer count (when the head records it) and the tapped layers."""
    hidden, vocab, layers = _target_shape(target)
    if config.target_hidden_size != hidden:
        raise EagleMismatchError(f"the EAGLE head reads target hidden states of size {config.target_hidden_size}, "
                                 f"this target's are {hidden}: the head was trained for another target")
    if config.vocab_size != vocab:
        raise EagleMismatchError(f"the EAGLE head maps to a target vocabulary of {config.vocab_size} tokens, this "
                                 f"target's LM head scores {vocab}: the head was trained for another target")
    if config.target_num_layers is not None and int(config.target_num_layers) != layers:
        raise EagleMismatchError(f"the EAGLE head was trained on a target of {config.target_num_layers} layers, this "
                                 f"target has {layers}")
    check_layer_ids(config.layer_ids, target)


def check_layer_ids(layer_ids, target) -> None:
    """EagleMismatchError unless every one of ``layer_ids`` (None: the defaults) is a layer of ``target``."""
    layers = _target_shape(target)[2]
    if layer_ids is not None and any(not 0 <= i < layers for i in layer_ids):
        raise EagleMismatchError(f"the EAGLE head reads the target's layers {list(layer_ids)}, this target has "
                                 f"{layers} layers (ids are the inputs of layers 0 .. {layers - 1})")


def bind_target(config: EagleConfig, target) -> EagleConfig:
    """``config`` checked against ``target`` and completed: its layer ids (default (2, L // 2, L - 3)) and
    layer count."""
    check_target(config, target)
    layers = _target_shape(target)[2]
    ids = config.layer_ids if config.layer_ids is not None else default_tap_layers(layers)
    return config.replace(layer_ids=tuple(ids), target_num_layers=layers)


def _device_of(target):
    return next(target.parameters()).device if target is not None else "cpu"
