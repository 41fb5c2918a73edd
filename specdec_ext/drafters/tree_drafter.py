"""TreeModelDrafter: a HF draft model proposes a token *tree* per row (top-b expansion, d levels, N nodes).

Shape of the tree (EAGLE-2-style expand then rerank; b = branch, d = depth, N = node budget):
expansion: level 1 holds the draft's top-b tokens after the committed prefix; level l+1 takes the
top-b children of every kept level-l node, scores each by its cumulative draft log-probability (sum
of log softmax of the draft's raw logits along its root path) and keeps the best
``min(b * kept_l, N)`` of them (``beam_widths``). Rerank: of all expanded nodes the N with the best
cumulative log-probability form the tree (a child never scores above its parent, and a tiny depth
penalty breaks ties, so the kept set contains its ancestors). Nodes keep the expansion order (level
by level, best first within a level), a topological order (csrc/tree.h: ``parents[b, i] < i``, -1 =
child of the committed token). So the tree is deep where the draft is confident and branches where
it is not; b = 1 is the chain of min(d, N) tokens. Every row has the same node count N' = min(N,
expanded nodes); tokens and shape differ per row.

The candidates are a deterministic function of the draft, so the target verifies them with
``tree_verify(..., draft_probs=None)`` (accept x with probability p(x), else remove x from p and
renormalise): lossless at any temperature. ``meta.draft_probs`` is None on the tree path.

Draft cache (its own runner): before ``propose`` it holds a prefix of the committed tokens that ends
before the pending token. ``propose`` feeds the unseen committed tokens plus the pending token as one
chain forward and commits all but the pending one (logits at the pending token give level 1); each
further level is one *uncommitted* tree forward of [pending, nodes so far] with their parents (the
runner rolls tentative tokens back by metadata). So the draft never commits a tree node and ``accept``
has nothing to roll back; the next step feeds the accepted path and the emitted token. d draft forwards
per step, like a chain drafter with k = d.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..metadata import SpecDecodeMetadata
from .model_drafter import ModelDrafter


DEPTH_TIE_BREAK = 1e-4  # subtracted per level from the rerank score: a child never ties its parent


def beam_widths(branch: int, depth: int, budget: int) -> List[int]:
    """Nodes kept per expanded level: ``min(branch ** level, budget)`` for levels 1..depth."""
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in (branch, depth, budget)):
        raise ValueError(f"draft tree (b, d, N) must be positive ints, got ({branch!r}, {depth!r}, {budget!r})")
    widths, width = [], 1
    for _ in range(depth):
        width = min(branch * width, budget)
        widths.append(width)
    return widths


def tree_num_nodes(branch: int, depth: int, budget: int) -> int:
    """N': the nodes of every proposed tree (the verify budget is N' + 1 tokens per target pass)."""
    return min(budget, sum(beam_widths(branch, depth, budget)))


class TreeModelDrafter(ModelDrafter):
    """Top-b draft tree from a HF draft model. ``k`` is the number of nodes N' (<= N)."""

    is_tree = True

    def __init__(self, model, runner_factory: Callable, *, branch: int, depth: int, budget: int, vocab_size: int):
        self.widths = beam_widths(branch, depth, budget)
        self.branch, self.depth = branch, depth
        super().__init__(model, runner_factory, k=tree_num_nodes(branch, depth, budget), vocab_size=vocab_size)

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """ModelDrafter's prefill, with room in the draft cache for [pending, every expanded node]."""
        B, S = meta.token_buffer.shape
        room = S + sum(self.widths) + 1
        if self.runner is None or self.runner.max_batch_size < B or self.runner.max_seq_len < room:
            self.runner = self.runner_factory(self.model, max_batch_size=B, max_seq_len=room)
        super().prefill(prompts, meta)

    # ------------------------------------------------------------------ the step
    def _feed_unseen_and_pending(self, meta: SpecDecodeMetadata) -> torch.Tensor:
        """Chain-feed the committed tokens not yet in the draft cache and the pending token; commit all
        but the pending one. Returns the draft logits at the pending token [B, V_d]."""
        S = meta.token_buffer.shape[1]
        seen = self.runner.lengths.to(meta.seq_lens.device)  # [B]
        num_feed = meta.seq_lens - seen  # [B], 1 .. depth + 2
        width = int(num_feed.max())
        columns = torch.arange(width, dtype=torch.int64, device=seen.device)
        positions = (seen[:, None] + columns).clamp(max=S - 1)  # [B, W]
        feed = torch.gather(meta.token_buffer, 1, positions)  # [B, W]
        logits = self.runner.forward(feed, num_feed)  # [B, W, V_d]
        self.runner.commit(num_feed - 1)
        return logits[self._rows, num_feed - 1]

    def propose(self, meta: SpecDecodeMetadata) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        B, N, b = meta.batch_size, self.k, self.branch
        device = meta.token_buffer.device
        C = sum(self.widths)  # expanded nodes
        tokens = torch.zeros((B, C), dtype=torch.int64, device=device)  # [B, C]
        parents = torch.full((B, C), -1, dtype=torch.int64, device=device)  # [B, C] (expansion indices)
        scores = torch.zeros((B, C), dtype=torch.float32, device=device)  # [B, C] rerank scores
        pending = torch.gather(meta.token_buffer, 1, (meta.seq_lens - 1)[:, None])  # [B, 1]
        logits = self._fit_vocab(self._feed_unseen_and_pending(meta))[:, None]  # [B, F=1, V]
        frontier_scores = torch.zeros((B, 1), dtype=torch.float32, device=device)  # [B, F]
        frontier_index = torch.full((B, 1), -1, dtype=torch.int64, device=device)  # [B, F] node ids
        start = 0
        for level, width in enumerate(self.widths):
            if level > 0:  # draft logits at the frontier: one uncommitted tree forward of [pending, nodes]
                feed = torch.cat([pending, tokens[:, :start]], dim=1)  # [B, start+1]
                out = self.runner.forward(feed, None, tree_parents=parents[:, :start].to(torch.int32).contiguous())
                logits = self._fit_vocab_3d(out.gather(
                    1, (frontier_index + 1)[:, :, None].expand(-1, -1, out.shape[-1])))  # [B, F, V]
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, F, V]
            top_lp, top_tok = logprobs.topk(b, dim=-1)  # [B, F, b]
            cand = (frontier_scores[:, :, None] + top_lp).flatten(1)  # [B, F*b]
            cand_tok = top_tok.flatten(1)
            cand_parent = frontier_index[:, :, None].expand(-1, -1, b).flatten(1)
            best, pick = cand.topk(width, dim=-1)  # [B, width], best first
            tokens[:, start:start + width] = cand_tok.gather(1, pick)
            parents[:, start:start + width] = cand_parent.gather(1, pick)
            scores[:, start:start + width] = best - DEPTH_TIE_BREAK * (level + 1)
            frontier_scores = best
            frontier_index = torch.arange(start, start + width, device=device).expand(B, -1)
            start += width
        # rerank: the N best nodes, kept in expansion (topological) order, parents renumbered
        keep = scores.topk(N, dim=-1).indices.sort(dim=-1).values  # [B, N] expansion indices
        new_index = torch.full((B, C + 1), -1, dtype=torch.int64, device=device)  # slot C: the root
        new_index.scatter_(1, keep, torch.arange(N, device=device).expand(B, -1).contiguous())
        old_parents = parents.gather(1, keep)  # [B, N], -1 = root
        meta.draft_token_ids.copy_(tokens.gather(1, keep))
        meta.tree_parents.copy_(new_index.gather(1, torch.where(old_parents < 0, C, old_parents)).to(torch.int32))
        meta.num_draft.fill_(N)
        return meta.draft_token_ids, None

    def _fit_vocab_3d(self, logits: torch.Tensor) -> torch.Tensor:
        B, F, V = logits.shape
        return self._fit_vocab(logits.reshape(B * F, V)).reshape(B, F, -1)

    def accept(self, meta: SpecDecodeMetadata) -> None:
        """Nothing to roll back: the draft cache only ever commits committed tokens (see the module
        docstring); the next propose feeds the accepted path and the emitted token."""
        return None
