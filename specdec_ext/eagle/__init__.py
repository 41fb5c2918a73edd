"""EAGLE-3 (issue 27): a feature-level drafter on the target's own hidden states.

    model.py        Eagle3Model / EagleConfig: fc over the fused target states, one Llama-style layer whose
                    attention reads [embedding(token); feature], its own KV cache, final norm, lm_head over a
                    reduced draft vocabulary (d2t / t2d)
    drafter.py      EagleDrafter: chains (q over target ids, zero off the draft vocabulary) or EAGLE-2 dynamic
                    trees, fed by a target runner built with hidden_taps (runners/taps.py)
    kernels.py      the head's chain passes on the project's batch-invariant CPU kernels
    checkpoints.py  load_eagle / save_eagle: SafeAILab/EAGLE and SpecForge checkpoints, vLLM speculators'
                    format; check_target (a head made for another target is refused before any work)
    training.py     train_eagle: self-distillation with the training-time test, on a CPU or a GPU
    command.py      ``specdec train-eagle`` (texts.py: the pieces of text the target continues)
    spec.py         EagleDrafterSpec and eagle_head_for: what generate()'s draft= takes

Use: ``runner = make_runner("lean", target, ..., hidden_taps=head.config.layer_ids)`` and
``EagleDrafter(runner, head, k=4)`` (or ``tree=(b, d, N)``); ``generate(..., draft=EagleDrafterSpec(path))``
where the plan wires drafter "eagle" (models.load_models -> eagle_head_for; plan: a tapped target runner;
build: EagleDrafter over it).
"""
from __future__ import annotations

from .checkpoints import LAYOUTS, EagleMismatchError, bind_target, check_target, load_eagle, save_eagle
from .drafter import EagleDrafter
from .model import Eagle3Model, EagleConfig
from .spec import EAGLE_DRAFT, EagleDrafterSpec, eagle_head_for, is_eagle_draft
from .training import TrainConfig, TrainResult, train_eagle

__all__ = ["Eagle3Model", "EagleConfig", "EagleDrafter", "EagleDrafterSpec", "EagleMismatchError", "EAGLE_DRAFT",
           "LAYOUTS", "TrainConfig", "TrainResult", "bind_target", "check_target", "eagle_head_for", "is_eagle_draft",
           "load_eagle", "save_eagle", "train_eagle"]
