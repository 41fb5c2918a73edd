"""The bundled default (target, draft) model pair: small Llama-style models trained on Python source.

Layout of this directory (weights are committed to git directly, bf16 safetensors)::

    target/     LlamaForCausalLM save_pretrained dir (config.json, generation_config.json); its weights are
                committed packed (model.safetensors.planes, packing.py: 35 of 50.5 MiB) and unpacked on
                first use into ~/.cache/specdec_ext/default_pair/target-<digest>/ (TARGET_DIR, target_dir())
    heads/      Medusa-style draft heads for the target (specdec_ext/heads.py; tools/train_heads.py)
    eagle/      an EAGLE-3 head for the target (specdec_ext/eagle/; specdec train-eagle), stored int8 with a
                scale per row (eagle/checkpoints.py INT8_WEIGHTS)
    draft/      LlamaForCausalLM save_pretrained dir, same tokenizer, distilled from the target
    tokenizer/  byte-level BPE PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json)
    MODEL_CARD.md

How they were trained and how well they do: ``MODEL_CARD.md``; rebuild with
``tools/train_default_pair.py``. This module imports neither the compiled extension nor the decode loop.
"""
import filecmp
import json
import os

import torch

from .packing import PACKED_SUFFIX, packed_digest, unpacked, write_replacing

PAIR_DIR = os.path.dirname(os.path.abspath(__file__))
PACKED_TARGET_DIR = os.path.join(PAIR_DIR, "target")  # config files and the packed weights (packing.py)
TARGET_FILES = ("config.json", "generation_config.json")
CACHE_ROOT = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                          "specdec_ext", "default_pair")  # SPECDEC_CACHE_DIR overrides it


def target_dir_path() -> str:
    """Where the target's save_pretrained directory is, made or not: ``<cache>/target-<digest>/`` (the digest read
    from the packed file's header), or the package's own directory for a rebuilt pair whose weights are not packed
    (no .planes file). Nothing is written: a path compares with it (``models.is_bundled_target``)."""
    packed = os.path.join(PACKED_TARGET_DIR, "model.safetensors" + PACKED_SUFFIX)
    if not os.path.isfile(packed):
        return PACKED_TARGET_DIR
    return os.path.join(os.environ.get("SPECDEC_CACHE_DIR", CACHE_ROOT), f"target-{packed_digest(packed)[:16]}")


def target_dir() -> str:
    """The target's save_pretrained directory with its weights unpacked (``target_dir_path``), made on the first
    use of the bundled target, not at import (the package directory is never written: an uninstall leaves
    nothing behind in it; importing specdec_ext wrote 51 MB into ~/.cache, and failed where it could not)."""
    folder = target_dir_path()
    if folder == PACKED_TARGET_DIR or folder in _MADE:
        return folder
    os.makedirs(folder, exist_ok=True)
    for name in TARGET_FILES:
        source, copy = os.path.join(PACKED_TARGET_DIR, name), os.path.join(folder, name)
        if not os.path.isfile(copy) or not filecmp.cmp(source, copy, shallow=False):
            with open(source, "rb") as f:
                write_replacing(copy, f.read())
    unpacked(os.path.join(PACKED_TARGET_DIR, "model.safetensors" + PACKED_SUFFIX), os.path.join(folder, "model.safetensors"))
    _MADE.add(folder)
    return folder


_MADE: set = set()  # target directories made (or found whole) by this process


def __getattr__(name: str):
    if name == "TARGET_DIR":  # (made on first use: ``target_dir``)
        return target_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")
TOKENIZER_DIR = os.path.join(PAIR_DIR, "tokenizer")
HEADS_DIR = os.path.join(PAIR_DIR, "heads")  # Medusa-style heads for the target (tools/train_heads.py)
EAGLE_DIR = os.path.join(PAIR_DIR, "eagle")  # an EAGLE-3 head for the target (specdec train-eagle)

_REQUIRED = {  # (the target's directory is checked where target_dir() makes it)
    DRAFT_DIR: ("config.json", "model.safetensors"),
    TOKENIZER_DIR: ("tokenizer.json", "tokenizer_config.json"),
}

__all__ = ["load_default_pair", "load_default_heads", "load_default_eagle", "PAIR_DIR", "TARGET_DIR", "DRAFT_DIR",
           "TOKENIZER_DIR", "HEADS_DIR", "EAGLE_DIR"]


def trained_context():
    """The sequence length both models were trained on (train_summary.json's ``seq``; None without it): the
    draft declares it as its context window (drafters/model_drafter.py ``DRAFT_WINDOW_ATTRIBUTE``), since
    past it the rotary draft extrapolates and accepts less."""
    try:
        with open(os.path.join(PAIR_DIR, "train_summary.json")) as f:
            seq = json.load(f).get("seq")
    except (OSError, ValueError):
        return None
    return seq if isinstance(seq, int) and seq >= 2 else None


def _check_files():
    required = {**_REQUIRED, target_dir(): ("config.json", "model.safetensors")}
    missing = [os.path.join(d, f) for d, files in required.items() for f in files
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
        Two ``LlamaForCausalLM`` in eval mode sharing one ``PreTrainedTokenizerFast``; the draft's config
        carries ``specdec_draft_window``, the sequence length it was trained on (``trained_context``).
    """
    _check_files()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    models = []
    for path in (target_dir(), DRAFT_DIR):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        models.append(model.to(device).eval())
    target, draft = models
    draft.config.specdec_draft_window = trained_context()  # (the attribute's name: model_drafter.py)
    if target.config.vocab_size != draft.config.vocab_size or target.config.vocab_size != len(tokenizer):
        raise RuntimeError(
            f"default pair vocab mismatch: target {target.config.vocab_size}, draft "
            f"{draft.config.vocab_size}, tokenizer {len(tokenizer)}")
    return target, draft, tokenizer


def load_default_heads(dtype=torch.float32, device="cpu"):
    """Load the bundled target's Medusa-style heads (``specdec_ext.heads.MedusaHeads``, eval mode)."""
    from ..heads import load_heads
    return load_heads(HEADS_DIR, dtype=dtype, device=device)


def load_default_eagle(target):
    """The bundled target's EAGLE-3 head (``specdec_ext.eagle.Eagle3Model``, fp32, eval mode), bound to ``target``."""
    from ..eagle.checkpoints import load_eagle
    return load_eagle(EAGLE_DIR, target)
