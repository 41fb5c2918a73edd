"""What generate()'s ``draft=`` takes for EAGLE-3, and how it becomes a head bound to the target.

    draft=EagleDrafterSpec("runs/eagle")     a checkpoint directory, either layout (eagle/checkpoints.py)
    draft=EagleDrafterSpec(head)             a loaded Eagle3Model
    draft=head                               the same, without the wrapper
    draft="path/to/eagle-checkpoint"         a directory whose config.json is an EAGLE-3 head's

``eagle_head_for(draft, target)`` checks the head against the target (EagleMismatchError naming both
values, before any model work), completes its layer ids (default (2, L // 2, L - 3)) and puts it on the
target's device; the plan then builds the target runner with ``hidden_taps`` = those ids.
"""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from typing import Union

from .checkpoints import CONFIG, EAGLE_ARCHITECTURE, SPECULATORS_ARCHITECTURE, bind_target, load_eagle
from .model import Eagle3Model

__all__ = ["EagleDrafterSpec", "EAGLE_DRAFT", "is_eagle_draft", "is_eagle_checkpoint", "eagle_head_for"]

EAGLE_DRAFT = "eagle"  # draft= value: the bundled target's EAGLE-3 head (default_pair/eagle/)


@dataclass(frozen=True)
class EagleDrafterSpec:
    """generate(..., draft=EagleDrafterSpec(head)): an EAGLE-3 head, a checkpoint directory or an Eagle3Model.
    ``k`` / ``draft_tree`` of generate() shape its drafts (a chain, or an EAGLE-2 dynamic tree)."""

    head: Union[str, os.PathLike, Eagle3Model]


def is_eagle_checkpoint(path) -> bool:
    """Whether ``path`` is a directory holding an EAGLE-3 head's config.json (either layout)."""
    config = os.path.join(os.fspath(path), CONFIG)
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    architectures = raw.get("architectures") or []
    # (SafeAILab/EAGLE's released EAGLE-3 heads say "LlamaForCausalLM": their draft_vocab_size, a field no HF
    # config has, is what tells them from a Llama draft model)
    return (EAGLE_ARCHITECTURE in architectures or SPECULATORS_ARCHITECTURE in architectures
            or raw.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in raw)


def is_eagle_draft(draft) -> bool:
    """Whether generate()'s ``draft=`` names an EAGLE-3 head (the forms of the module docstring, or "eagle")."""
    if isinstance(draft, (Eagle3Model, EagleDrafterSpec)):
        return True
    if isinstance(draft, str) and draft == EAGLE_DRAFT:
        return True
    return isinstance(draft, (str, os.PathLike)) and os.path.isdir(draft) and is_eagle_checkpoint(draft)


# The bundled head per target module, as load_models caches the bundled pair: reading and dequantizing it
# took 72 ms, paid again by every generate(..., draft="eagle") call.
_BUNDLED_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def eagle_head_for(draft, target) -> Eagle3Model:
    """The head ``draft`` names, checked against and bound to ``target`` (module docstring); the bundled head
    ("eagle") is loaded once per target module and device."""
    if isinstance(draft, str) and draft == EAGLE_DRAFT:  # (models.load_models checked the target is the bundled one)
        from ..default_pair import load_default_eagle
        device = next(target.parameters()).device
        cached = _BUNDLED_HEADS.get(target)
        if cached is None or cached[0] != device:
            cached = (device, load_default_eagle(target))
            _BUNDLED_HEADS[target] = cached
        return cached[1]
    head = draft.head if isinstance(draft, EagleDrafterSpec) else draft
    if not isinstance(head, Eagle3Model):
        return load_eagle(os.fspath(head), target)
    head.config = bind_target(head.config, target)
    return head.to(next(target.parameters()).device).eval().requires_grad_(False)
