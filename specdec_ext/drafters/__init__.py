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

Adaptive k's deferred prefill and looks (decode.py ``DrafterPrefill``), where the flags say so:

    drafter.prepare(meta)                  build what a prefill needs before it is timed (a runner)
    drafter.prefill_tokens(lengths) -> int tokens ``prefill`` feeds rows of these committed lengths (what
                                           switching speculation on costs: all of them, or a draft
                                           model's context window)
    drafter.prefill_window(prompts, meta, window)
                                           ``windowed_prefill``: the prompts' last ``window`` tokens only
    drafter.look(meta, tokens) -> [B][n] bool
                                           ``greedy_looks``: feed the committed tokens it lacks, the last
                                           tokens[b] with logits; whether its greedy token after each
                                           equals the committed one that follows (no target pass)

Declared flags (class attributes of ``Drafter``, read instead of probing the object): ``slots``,
``is_tree``, ``model`` (the draft model or None), ``device_steps`` (``reserve_step`` / ``sync_host``
run a step on the device: a draft model on the paged runner in host mode, serving under CUDA graphs).

Continuous batching (the serving engine, specdec_ext/serve/): rows join and leave a running batch.

    drafter.start_rows(rows, prompts, meta)
                                           rows (free slots) join: meta covers every slot, and its
                                           token_buffer / seq_lens of these rows hold the prompts and
                                           first tokens; the other rows keep their state
    drafter.hold_rows(rows, meta)          rows (free slots) count as in use without their tokens, as a
                                           free row inside the batch: a row still prefilling, or one
                                           whose draft prefill waits (a draft model runs no forward)
    drafter.free_rows(rows)                rows leave; their state is released at once

Between them ``propose`` / ``commit`` get a view of rows 0 .. the highest row in use
(``SpecDecodeMetadata.rows``), whose ``row_sampling`` may differ per row. The chain drafters (ModelDrafter,
NgramDrafter, CrossTokenizerDrafter, an EAGLE-3 head's chains) implement them; tree drafters do not.

Contract: the drafter samples only what the verifier checks. A stochastic drafter returns the exact
(filtered) distribution q each token was sampled from; a deterministic one returns None (q is then
one-hot at the drafted token). Its randomness comes from Philox keyed by (meta.seed, meta.draft_offset),
so a row's proposals do not depend on which rows share the batch.
"""
from __future__ import annotations

from ..metadata import Proposal
from .base import Drafter
from .cross_tokenizer import CrossTokenizerDrafter  # a draft model with another tokenizer (through text)
from .heads_drafter import HeadsDrafter  # a tree from heads on the target
from .model_drafter import ModelDrafter
from .ngram import NgramDrafter
from .tree_drafter import TreeModelDrafter  # proposes a tree

__all__ = ["Drafter", "ModelDrafter", "CrossTokenizerDrafter", "NgramDrafter", "TreeModelDrafter", "HeadsDrafter",
           "Proposal"]
