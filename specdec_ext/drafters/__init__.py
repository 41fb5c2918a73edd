"""Drafters: anything that proposes k tokens per row for the target to verify.

Every drafter implements the small interface below; the decode loop calls it and nothing else, so a
HF draft model, n-gram / suffix lookup, or heads on the target plug in the same way.

    drafter.prefill(prompts, meta)    once, after the target's prefill (meta.token_buffer holds the
                                      prompts and the first emitted token, meta.seq_lens their count)
    drafter.propose(meta)             -> (draft_token_ids [B, k] int64, draft_probs [B, k, V] fp32 or
                                      None); also writes them into meta.draft_token_ids / draft_probs
                                      and sets meta.num_draft [B]
    drafter.accept(meta)              after verification: meta.num_accepted [B] and meta.seq_lens [B]
                                      (updated) tell it what was committed; roll its state back
    drafter.skip(meta)                adaptive k: instead of propose when no row drafts this step (the
                                      step is plain decoding); accept(meta) still follows
    drafter.close()                   once, when the loop ends (releases hooks on the target)

Adaptive k (specdec_ext/adaptive.py): when meta.draft_budget (host list [B]) is set, row b proposes at
most draft_budget[b] tokens (num_draft[b] <= draft_budget[b] <= k); a drafter that learns its counts
on the host may lower meta.draft_budget to them (assign a new list), which narrows the verify pass.

Contract: the drafter samples only what the verifier checks. A stochastic drafter returns the exact
(filtered) distribution q each token was sampled from; a deterministic one returns None (q is then
one-hot at the drafted token). Its randomness comes from Philox keyed by (meta.seed, meta.draft_offset)
so that a row's proposals do not depend on which rows share the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..metadata import SpecDecodeMetadata


class Drafter:
    """Base class of the drafter interface (see the module docstring)."""

    #: draft tokens per step
    k: int

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError

    def propose(self, meta: SpecDecodeMetadata) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def accept(self, meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError

    def skip(self, meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support adaptive k (skip)")

    def close(self) -> None:
        """Release what the drafter holds on the models (nothing by default)."""


from .model_drafter import ModelDrafter  # noqa: E402
from .ngram import NgramDrafter  # noqa: E402
from .tree_drafter import TreeModelDrafter  # noqa: E402  (proposes a tree: meta.tree_parents)
from .heads_drafter import HeadsDrafter  # noqa: E402  (a tree from heads on the target)

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "TreeModelDrafter", "HeadsDrafter"]
