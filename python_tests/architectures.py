"""Tiny random models of every decoder architecture in transformers' causal-LM mapping, for
test_architectures.py and tools/architectures_table.py (no tests here).

``tiny_config(model_type)`` shrinks the config class's defaults (hidden size 64, 2 layers, 4 heads / 2
KV heads, a 128-token vocabulary, windows of 8 positions) so each model builds in milliseconds;
``SKIPPED`` names the model types that cannot be built or run that way, with the reason.
"""
from __future__ import annotations

import warnings
from typing import Dict, List

import torch

from test_generate_utils import noisy_copy  # noqa: F401 (test_architectures.py imports it from here)

VOCAB = 128
WINDOW = 8  # sliding windows shorter than the test contexts (prompts of 13-20 tokens + 20 new)
SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "model_dim": 64, "n_embed": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "d_ff": 128,
    "inner_hidden_size": 128, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 16,
    "vocab_size": VOCAB, "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512, "max_seq_len": 512,
    "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "sliding_window": WINDOW, "attention_window_size": WINDOW,
    "rotary_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "n_group": 1, "topk_group": 1, "index_head_dim": 16, "index_n_heads": 2, "moe_topk": 2,
    "zero_expert_num": 2, "expert_ffn_hidden_size": 32,
    "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
}
SIZED_WHEN_NONE = ("sliding_window", "head_dim", "v_head_dim", "num_experts_per_tok", "num_key_value_heads")

# Model types that are not decoder-only language models over a key/value cache, or that cannot be
# built tiny from their config class: the reason is the test's skip message and the README's.
SKIPPED: Dict[str, str] = {
    "blt": "byte latent transformer: a patcher model in front of the decoder (the tiny build hangs)",
    "musicgen": "an audio decoder conditioned on a text encoder (two text configs)",
    "musicgen_melody": "an audio decoder conditioned on a text encoder (two text configs)",
    "reformer": "a reversible LSH-attention model that needs is_decoder=True (no causal-LM use)",
    "gemma3n": "the vision/audio model does not build tiny (timm is not installed)",
    "gemma3n_text": "shares key/value caches across layers (its layer types do not build tiny)",
    "gemma4_assistant": "a drafter head for Gemma 4 (not a language model of its own)",
    "gemma4_unified_assistant": "a drafter head for Gemma 4 (not a language model of its own)",
    "cohere_compass_text": "its rotary parameters per layer type do not build from the config defaults (KeyError)",
    "dbrx": "its nested attention config does not build from the defaults (no rope_theta)",
    "dots1": "its MoE routing buffers do not build from the shrunk defaults",
    "lfm2_moe": "its layer types (convolution / attention) are None in the config defaults",
    "zamba": "its shared transformer blocks do not tie when shrunk to 2 layers",
    "qwen4_exp": "its sparse-attention indexer has no token budget in the config defaults",
    "qwen4_exp_text": "its sparse-attention indexer has no token budget in the config defaults",
}


def _shrink(config) -> None:
    values = config.to_dict()
    for key, value in SIZES.items():
        if key in values and (isinstance(values[key], int) and not isinstance(values[key], bool)
                              or values[key] is None and key in SIZED_WHEN_NONE):
            try:
                setattr(config, key, value)
            except (AttributeError, TypeError):  # a derived property
                pass
    if values.get("qk_rope_head_dim") is not None and "head_dim" in values:  # MLA: rotary over the rope part
        config.head_dim = SIZES["qk_rope_head_dim"]
    layers = getattr(config, "num_hidden_layers", None) or 2
    for key in ("layer_types", "layers_block_type"):
        types = getattr(config, key, None)
        if isinstance(types, list) and types:
            kinds = sorted(set(types), key=types.index)  # every kind of layer the model has, in its order
            try:
                setattr(config, key, [kinds[i % len(kinds)] for i in range(layers)])
            except (AttributeError, TypeError):
                pass
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and pad >= VOCAB:
        config.pad_token_id = 0  # (a pad id inside the vocabulary: learned positions offset by it)
    for key in ("bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if hasattr(config, key):
            try:
                setattr(config, key, None)
            except Exception:  # a strict field that must be an id: the first one, inside the vocabulary
                setattr(config, key, 0)
    if getattr(config, "is_encoder_decoder", False) is False and hasattr(config, "is_decoder"):
        config.is_decoder = True


def tiny_config(model_type: str, vocab: int = VOCAB):
    """The config class's defaults shrunk (module docstring), with a vocabulary of ``vocab`` tokens."""
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.for_model(model_type)
    configs = [config]
    try:
        text = config.get_text_config()
        if text is not config:
            configs.append(text)
    except (ValueError, AttributeError):
        pass
    # the other sub-models too (vision, audio encoders): built at their default sizes they cost a minute
    configs += [v for v in vars(config).values() if isinstance(v, PretrainedConfig) and all(v is not c for c in configs)]
    for c in configs:
        _shrink(c)
        if hasattr(c, "vocab_size"):
            c.vocab_size = vocab
    return config


def tiny_model(model_type: str, seed: int = 0, logit_scale: float = 4.0, vocab: int = VOCAB):
    """A random-weight tiny causal LM of ``model_type`` in eval mode, sharpened by ``logit_scale``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab)).eval()
    head = model.get_output_embeddings()
    if head is not None:
        with torch.no_grad():
            head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


PROMPTS = [[5, 17, 3, 44, 9, 12, 61, 7, 30, 2, 11, 90, 14],
           [2, 30, 4, 8, 99, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]  # longer than WINDOW
NEW = 20


def hf_greedy(model, prompt: List[int], new: int = NEW) -> List[int]:
    ids = torch.tensor([prompt])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def check_architecture(model_type: str):
    """(status, detail) of ``model_type``: ("supported", runner) when greedy speculative decoding
    (k = 3, a batch of two ragged prompts longer than the windows) equals HF's greedy generate;
    ("refused", message) when generate() refuses it before decoding with an error naming the
    architecture; ("skipped", reason) for SKIPPED; ("differs", detail) or ("error", detail) otherwise
    (the test's failures)."""
    import specdec_ext

    if model_type in SKIPPED:
        return "skipped", SKIPPED[model_type]
    try:
        model = tiny_model(model_type)
    except Exception as error:  # belongs in SKIPPED, with the reason
        return "unbuildable", f"{type(error).__name__}: {error}"
    draft = noisy_copy(model)
    try:
        result = specdec_ext.generate(PROMPTS, model, draft, max_new_tokens=NEW, k=3, eos_token_id=False,
                                      cost_probe=False)
    except ValueError as error:
        message = str(error)
        if "cannot be run" in message:
            return "refused", message
        return "error", f"{type(error).__name__}: {message}"
    except Exception as error:  # an error from inside the loop: what the issue says must never happen
        return "error", f"{type(error).__name__}: {error}"
    references = [hf_greedy(model, p) for p in PROMPTS]
    if result.token_ids != references:
        wrong = sum(a != b for r, o in zip(references, result.token_ids) for a, b in zip(r, o))
        return "differs", f"{wrong} of {2 * NEW} tokens differ from HF greedy"
    return "supported", result.plan.target_runner


def causal_lm_types() -> List[str]:
    """Every model type of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
