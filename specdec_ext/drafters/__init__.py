"""Drafters: anything that proposes draft tokens (a chain of k, or a tree of N) for the target to verify.

Every drafter implements the small interface below; the decode loop calls it and nothing else, so a
HF draft model (chains or trees), n-gram / suffix lookup, or heads on the target plug in the same way.

    drafter.prefill(prompts, meta)         once, after the target's prefill (meta.token_buffer holds the
                                           prompts and the first emitted token, meta.seq_lens their count)
    drafter.propose(meta, budget) -> Proposal
                                           this step's drafts (metadata.Proposal), in tensors the drafter
                                           owns; ``budget`` (adaptive k, host list [B] or None) caps row
                                           b's drafts at budget[b]
    drafter.skip(meta)                     adaptive k: no draft this step (the step is plain decoding)
    drafter.commit(meta, verdict)          after the target committed: meta.seq_lens / meta.num_kept and
                                           the verdict say what was kept; keep it, roll the rest back
    drafter.checkpoint() -> undo or None   for the cost probes: a callable that restores the drafter's
                                           state after probe proposals (None: proposing costs nothing
                                           worth timing)
    drafter.close()                        once, when the loop ends (releases hooks on the target)

Continuous batching (the serving engine, specdec_ext/serve/): rows join and leave a running batch.

    drafter.start_rows(rows, prompts, meta)
                                           rows (free slots) join: meta covers every slot, and its
                                           token_buffer / seq_lens of these rows hold the prompts and
                                           first tokens; the other rows keep their state
    drafter.free_rows(rows)                rows leave; their state is released at once

Between them ``propose`` / ``commit`` get a view of rows 0 .. the highest row in use
(``SpecDecodeMetadata.rows``), whose ``row_sampling`` may differ per row. ModelDrafter and NgramDrafter
implement them; tree drafters do not.

Contract: the drafter samples only what the verifier checks. A stochastic drafter returns the exact
(filtered) distribution q each token was sampled from; a deterministic one returns None (q is then
one-hot at the drafted token). Its randomness comes from Philox keyed by (meta.seed, meta.draft_offset),
so a row's proposals do not depend on which rows share the batch.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..metadata import Proposal, SpecDecodeMetadata, Verdict


class Drafter:
    """Base class of the drafter interface (see the module docstring)."""

    slots: int  # draft slots per step: a chain's k, a tree's N nodes
    is_tree: bool = False  # proposals carry tree parents

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError

    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        raise NotImplementedError

    def skip(self, meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support adaptive k (skip)")

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        raise NotImplementedError

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support continuous batching (start_rows)")

    def free_rows(self, rows: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support continuous batching (free_rows)")

    def checkpoint(self) -> Optional[Callable[[], None]]:
        """An undo for the cost probes' proposals, or None (nothing worth timing)."""
        return None

    def close(self) -> None:
        """Release what the drafter holds on the models (nothing by default)."""


from .model_drafter import ModelDrafter  # noqa: E402
from .ngram import NgramDrafter  # noqa: E402
from .tree_drafter import TreeModelDrafter  # noqa: E402  (proposes a tree)
from .heads_drafter import HeadsDrafter  # noqa: E402  (a tree from heads on the target)

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "TreeModelDrafter", "HeadsDrafter", "Proposal"]
