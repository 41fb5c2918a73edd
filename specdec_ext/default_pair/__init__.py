"""The bundled default (target, draft) model pair: small Llama-style models trained on Python source.

Layout of this directory (weights are committed to git directly, bf16 safetensors)::

    target/     LlamaForCausalLM save_pretrained dir (config.json, model.safetensors, generation_config.json)
    heads/      Medusa-style draft heads for the target (specdec_ext/heads.py; tools/train_heads.py)
    draft/      LlamaForCausalLM save_pretrained dir, same tokenizer, distilled from the target
    tokenizer/  byte-level BPE PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json)
    MODEL_CARD.md

How they were trained and how well they do: ``MODEL_CARD.md``; rebuild with
``tools/train_default_pair.py``. This module imports neither the compiled extension nor the decode loop.
"""
import os

import torch

PAIR_DIR = os.path.dirname(os.path.abspath(__file__))
TARGET_DIR = os.path.join(PAIR_DIR, "target")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")
TOKENIZER_DIR = os.path.join(PAIR_DIR, "tokenizer")
HEADS_DIR = os.path.join(PAIR_DIR, "heads")  # Medusa-style heads for the target (tools/train_heads.py)

_REQUIRED = {
    TARGET_DIR: ("config.json", "model.safetensors"),
    DRAFT_DIR: ("config.json", "model.safetensors"),
    TOKENIZER_DIR: ("tokenizer.json", "tokenizer_config.json"),
}

__all__ = ["load_default_pair", "load_default_heads", "PAIR_DIR", "TARGET_DIR", "DRAFT_DIR", "TOKENIZER_DIR",
           "HEADS_DIR"]


def _check_files():
    missing = [os.path.join(d, f) for d, files in _REQUIRED.items() for f in files
               if not os.path.isfile(os.path.join(d, f))]
    if missing:
        raise FileNotFoundError(
            "the default model pair of specdec_ext is incomplete; missing: " + ", ".join(missing)
            + ". Reinstall the package (the files are package data), or rebuild them with "
            "`python tools/train_default_pair.py --out runs/default_pair` and copy "
            "runs/default_pair/final/{target,draft,tokenizer} into " + PAIR_DIR)


def load_default_pair(dtype=torch.float32, device="cpu"):
    """Load the bundled pair offline.

    Parameters
    ----------
    dtype : torch.dtype
        Parameter dtype of both models (stored as bf16; default float32).
    device : str or torch.device
        Where to put both models.

    Returns
    -------
    (target, draft, tokenizer)
        Two ``LlamaForCausalLM`` in eval mode sharing one ``PreTrainedTokenizerFast``.
    """
    _check_files()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    models = []
    for path in (TARGET_DIR, DRAFT_DIR):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        models.append(model.to(device).eval())
    target, draft = models
    if target.config.vocab_size != draft.config.vocab_size or target.config.vocab_size != len(tokenizer):
        raise RuntimeError(
            f"default pair vocab mismatch: target {target.config.vocab_size}, draft "
            f"{draft.config.vocab_size}, tokenizer {len(tokenizer)}")
    return target, draft, tokenizer


def load_default_heads(dtype=torch.float32, device="cpu"):
    """Load the bundled target's Medusa-style heads (``specdec_ext.heads.MedusaHeads``, eval mode)."""
    from ..heads import load_heads
    return load_heads(HEADS_DIR, dtype=dtype, device=device)
