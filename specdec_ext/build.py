"""Build what a DecodePlan runs: the target's runner and the drafter (plan.py decided everything)."""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

from .drafters import CrossTokenizerDrafter, Drafter, HeadsDrafter, ModelDrafter, NgramDrafter, TreeModelDrafter
from .drafters.calibration import NodeCalibration, shared_calibration
from .drafters.model_drafter import draft_window_of
from .eagle import EagleDrafter
from .models import Models
from .plan import PRIOR_CALIBRATION, DecodePlan
from .runners import ModelRunner, make_runner, output_vocab_size
from .runners.in_range import in_range_feeds


def build(plan: DecodePlan, models: Models) -> Tuple[ModelRunner, Optional[Drafter]]:
    """(the target's runner, the drafter or None) for ``plan``; the built target runner has the
    capabilities the plan resolved for it (checked: the plan is what the loop branches on)."""
    target = make_runner(plan.target_runner, models.target, max_batch_size=plan.padded_batch_size,
                         max_seq_len=plan.max_seq_len, static_shapes=plan.static_shapes, hidden_taps=plan.hidden_taps)
    drafter = build_drafter(plan, models, target)
    # (after the drafter, as the loop runs it: heads hook the target's head for the passes of their generation)
    with drafter.running() if drafter is not None else contextlib.nullcontext():
        capabilities = target.capabilities
    if capabilities != plan.target_capabilities:
        raise RuntimeError(f"the {plan.target_runner} target runner has capabilities {capabilities}, the "
                           f"plan resolved {plan.target_capabilities}: runners.capabilities_of is out of date")
    return target, drafter


def build_drafter(plan: DecodePlan, models: Models, target: Optional[ModelRunner] = None) -> Optional[Drafter]:
    """The drafter the plan names; ``target`` (the target's runner) is what an EAGLE-3 head reads its
    features from."""
    vocab_size = output_vocab_size(models.target)
    temperature = plan.sampling.temperature

    def calibration(model, depth: int) -> NodeCalibration:  # plan._tree_calibration says which, and why
        if plan.tree_calibration == PRIOR_CALIBRATION:
            return NodeCalibration(depth, learns=False)
        return shared_calibration(model, depth, temperature)

    if plan.drafter == "none":
        return None
    if plan.drafter == "ngram":
        return NgramDrafter(plan.slots)
    if plan.drafter == "eagle":
        return EagleDrafter(target, models.draft, k=plan.slots, tree=plan.tree, fixed_shapes=plan.cuda_graphs)
    if plan.drafter == "heads":
        b, d, n = plan.tree
        return HeadsDrafter(models.target, models.heads, branch=b, depth=d, budget=n,
                            calibration=calibration(models.heads, d))

    def draft_runner(*, max_batch_size: int, max_seq_len: int) -> ModelRunner:
        runner = make_runner(plan.draft_runner, models.draft, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                             compute_dtype=plan.draft_compute_dtype, static_shapes=plan.static_shapes)
        # (a draft in its own vocabulary is fed its own ids)
        return runner if plan.drafter == "cross-tokenizer" else in_range_feeds(runner, models.draft, vocab_size)

    if plan.drafter == "cross-tokenizer":
        return CrossTokenizerDrafter(models.draft, draft_runner, k=plan.slots, bridge=models.bridge,
                                     mode=plan.cross_tokenizer,
                                     max_draft_positions=getattr(models.draft.config, "max_position_embeddings", None))
    if plan.tree is not None:
        b, d, n = plan.tree
        return TreeModelDrafter(models.draft, draft_runner, branch=b, depth=d, budget=n, vocab_size=vocab_size,
                                calibration=calibration(models.draft, d))
    return ModelDrafter(models.draft, draft_runner, k=plan.slots, vocab_size=vocab_size,
                        confidence_threshold=plan.draft_confidence, context_window=draft_window_of(models.draft))
