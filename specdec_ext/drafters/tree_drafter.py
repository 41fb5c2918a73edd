"""TreeModelDrafter: a HF draft model proposes a token *tree* per row (top-b expansion, d levels, N nodes).

Shape of the tree (EAGLE-2-style expand then rerank; b = branch, d = depth, N = node budget):
expansion: level 1 holds the draft's top-b tokens after the committed prefix; level l+1 takes the
top-b children of every kept level-l node, scores each by its cumulative score along its root path
and keeps the best ``min(b * kept_l, N)`` of them (``beam_widths``). Rerank: of all expanded nodes the
N with the best cumulative score form the tree (a child never scores above its parent, and a tiny
depth penalty breaks ties, so the kept set contains its ancestors). A node's own score is the log of
the rate at which the target emitted candidates like it (same depth and sibling rank, similar draft
probability) in earlier steps, learnt online (drafters/calibration.py; before any data it is the
draft log-probability, EAGLE-2's score): the cumulative score then estimates log P(node accepted),
so the tree holds the N nodes with the largest expected contribution to the accepted length. Nodes
keep the expansion order (level by level, best first within a level), a topological order
(csrc/tree.h: ``parents[b, i] < i``, -1 = child of the committed token). So the tree is deep where
the draft is confident and branches where it is not; b = 1 is the chain of min(d, N) tokens. Every
row has the same node count N' = min(N, expanded nodes); tokens and shape differ per row.

Candidates. Greedy (T = 0): the top-b of each node, a deterministic function of the draft and of
past outcomes, verified by ``tree_verify(..., draft_probs=None)`` (the first child equal to the
target's argmax). T > 0: each expanded node's b children are drawn *without replacement* from the
draft's filtered q (``draw_without_replacement``), and the proposal's ``probs [B, N, V]`` holds for
every node the distribution it was drawn from (q with its earlier siblings removed, renormalised), so
``tree_verify`` runs recursive rejection sampling (accept x with min(1, p(x) / q_x(x)), else
p <- norm(max(0, p - q_x)) and try the next sibling): the first child is accepted as often as a chain
draft, each further sibling adds its chance, and the output is distributed exactly as the target's.
Which draws the tree keeps is decided before they are drawn (``grow_tree``), or the kept ones would be
biased.

Draft cache (its own runner): before ``propose`` it holds a prefix of the committed tokens that ends
before the pending token. ``propose`` feeds the unseen committed tokens plus the pending token as one
chain forward and commits all but the pending one (logits at the pending token give level 1); each
further level is one *uncommitted* tree forward of [pending, nodes so far] with their parents (the
runner rolls tentative tokens back by metadata). So the draft never commits a tree node and ``commit``
has nothing to roll back; the next step feeds the accepted path and the emitted token. d draft forwards
per step, like a chain drafter with k = d.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import ops
from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from ..sampling import filtered_probs, sample_inverse_cdf
from .calibration import NodeCalibration
from .model_drafter import ModelDrafter, RunnerFactory, active_processing


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


FrontierLogprobs = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (level, logprobs [B, F, V]) -> (child log q [B, F, b], child tokens [B, F, b], child q rows [B, F, b, V])
SampleChildren = Callable[[int, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
SIBLING_TIE_BREAK = 1e-6  # subtracted per sibling rank from a sampled child's score: draw order breaks ties


EMPTY_MASS = 1e-12  # a filtered q with less mass left than this is used up: draw from the unfiltered one
LOG_Q_FLOOR = -1e4  # floor of a draw's score (finite, so the tie-break keeps sibling order strict)


def draw_without_replacement(q: torch.Tensor, fallback: torch.Tensor, uniforms: torch.Tensor):
    """b sequential draws without replacement per row (the order of the draws matters).

    Draw j comes from q with draws 0..j-1 removed and renormalised, or, once q's support is used up
    (a top-k / top-p filter left fewer than b tokens), from ``fallback`` (a full-support distribution)
    likewise; ``rows[..., j, :]`` is the distribution draw j came from, which the verifier needs
    (recursive rejection sampling: any proposal works as long as it is the one sampled from).

    The first returned tensor scores the draws for the tree's selection, and it must not depend on
    the drawn tokens: keeping or dropping a draw because of its own value would bias the kept
    candidates away from the rows they are verified against. So draw j is scored by the j-th largest
    probability of q (known before the draw; for top-b candidates it is their own probability).

    q, fallback [B, F, V] fp32; uniforms [B, F, b] -> (log of q's b largest probabilities [B, F, b]
    floored at LOG_Q_FLOOR, tokens [B, F, b] int64, rows [B, F, b, V] fp32)
    """
    B, F, V = q.shape
    b = uniforms.shape[-1]
    # ... and once the fallback's support is used up too (at a temperature near 0 it is one token), from the
    # tokens not drawn yet, uniformly: 0 / 0 made NaN rows, which the verifier refused
    left, left_fallback, left_any = q.clone(), fallback.clone(), torch.ones_like(q)
    tokens = torch.empty((B, F, b), dtype=torch.int64, device=q.device)
    rows = torch.empty((B, F, b, V), dtype=torch.float32, device=q.device)
    for j in range(b):
        mass, fallback_mass = left.sum(-1, keepdim=True), left_fallback.sum(-1, keepdim=True)  # [B, F, 1]
        row = torch.where(mass > EMPTY_MASS, left / mass.clamp(min=EMPTY_MASS),
                          torch.where(fallback_mass > EMPTY_MASS, left_fallback / fallback_mass.clamp(min=EMPTY_MASS),
                                      left_any / left_any.sum(-1, keepdim=True)))
        x = sample_inverse_cdf(row.reshape(B * F, V), uniforms[:, :, j].reshape(-1)).view(B, F)
        tokens[:, :, j], rows[:, :, j] = x, row
        for remaining in (left, left_fallback, left_any):
            remaining.scatter_(-1, x[..., None], 0.0)
    ranked = q.topk(b, dim=-1).values.clamp(min=1e-30).log().clamp(min=LOG_Q_FLOOR)
    return ranked, tokens, rows


class DraftTree(NamedTuple):
    """A proposed tree, N nodes per row in topological order."""

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int32, -1 = child of the root
    logprobs: torch.Tensor  # [B, N] fp32: the node's draft log-probability (sampled: that of the
    #                         parent's rank-th likeliest token, known before the draw)
    depth: torch.Tensor  # [B, N] int64: 1 = child of the root
    rank: torch.Tensor  # [B, N] int64: 0 = its parent's first choice (sampled: the first draw)
    probs: Optional[torch.Tensor] = None  # [B, N, V] fp32: sampled trees, the q each node was drawn from


def grow_tree(frontier_logprobs: FrontierLogprobs, widths: Sequence[int], branch: int, num_nodes: int,
              calibration: Optional[NodeCalibration] = None,
              sample_children: Optional[SampleChildren] = None) -> DraftTree:
    """Expand the top-``branch`` children of the frontier level by level, then keep the ``num_nodes``
    best nodes by cumulative score (the module docstring's rule, shared by every tree drafter). A node's
    score is its draft log-probability, or with ``calibration`` the learned log-rate at which the
    target emits such a candidate (drafters/calibration.py).

    ``frontier_logprobs(level, tokens, parents, frontier_index)`` returns the log-probabilities of the
    children of the current frontier, [B, F, V] (or [B, 1, V] when they do not depend on the parent,
    as for heads); ``tokens`` [B, C] and ``parents`` [B, C] (expansion indices, -1 = root) hold the
    nodes expanded so far, ``frontier_index`` [B, F] the frontier's node indices (-1 at level 0).

    ``sample_children`` (sampled trees, T > 0) draws each frontier node's b children without
    replacement instead of taking its top-b. Their verification needs every kept sibling to follow
    all earlier draws of its parent, and whether a draw is kept must not depend on the drawn token
    (see ``draw_without_replacement``): draw j is scored by the parent's j-th largest probability,
    capped by its earlier siblings' scores (running minimum, minus a tiny tie-break), so any best-N
    set holds a prefix of each sibling list chosen before looking at the draws.

    Returns a DraftTree (topological order, parents renumbered).
    """
    tokens = parents = scores = own = depths = ranks = probs = None
    frontier_index = frontier_scores = None
    for level, width in enumerate(widths):
        if level == 0:
            logprobs = frontier_logprobs(0, None, None, None)  # [B, 1, V]
            B, device = logprobs.shape[0], logprobs.device
            tokens = torch.zeros((B, 0), dtype=torch.int64, device=device)  # [B, C]
            parents = torch.zeros((B, 0), dtype=torch.int64, device=device)  # [B, C] expansion indices
            scores = torch.zeros((B, 0), dtype=torch.float32, device=device)  # [B, C] rerank scores
            own = torch.zeros((B, 0), dtype=torch.float32, device=device)  # [B, C] node log-probabilities
            depths = torch.zeros((B, 0), dtype=torch.int64, device=device)  # [B, C]
            ranks = torch.zeros((B, 0), dtype=torch.int64, device=device)  # [B, C]
            if sample_children is not None:
                probs = torch.zeros((B, 0, logprobs.shape[-1]), dtype=torch.float32, device=device)  # [B, C, V]
            frontier_index = torch.full((B, 1), -1, dtype=torch.int64, device=device)  # [B, F]
            frontier_scores = torch.zeros((B, 1), dtype=torch.float32, device=device)  # [B, F]
        else:
            logprobs = frontier_logprobs(level, tokens, parents, frontier_index)  # [B, F or 1, V]
        B, F = frontier_scores.shape
        if sample_children is None:
            top_lp, top_tok = logprobs.topk(branch, dim=-1)  # [B, F or 1, b]
        else:
            top_lp, top_tok, top_q = sample_children(level, logprobs)  # [B, F, b], [B, F, b], [B, F, b, V]
        # (a child the processors removed, log q = -inf, stays -inf: a calibrated score would keep certain rejections)
        step = top_lp if calibration is None else torch.where(torch.isneginf(top_lp), top_lp,
                                                              calibration.log_rate(level, top_lp))
        if sample_children is not None:
            ties = SIBLING_TIE_BREAK * torch.arange(branch, device=step.device)
            step = torch.cummin(step, dim=-1).values - ties
        cand = (frontier_scores[:, :, None] + step).flatten(1)  # [B, F*b]
        cand_lp = top_lp.expand(B, F, branch).flatten(1)
        cand_tok = top_tok.expand(B, F, branch).flatten(1)
        cand_rank = torch.arange(branch, device=top_tok.device).expand(B, F, branch).flatten(1)
        cand_parent = frontier_index[:, :, None].expand(-1, -1, branch).flatten(1)
        best, pick = cand.topk(width, dim=-1)  # [B, width], best first
        start = tokens.shape[1]
        tokens = torch.cat([tokens, cand_tok.gather(1, pick)], dim=1)
        parents = torch.cat([parents, cand_parent.gather(1, pick)], dim=1)
        scores = torch.cat([scores, best - DEPTH_TIE_BREAK * (level + 1)], dim=1)
        own = torch.cat([own, cand_lp.gather(1, pick)], dim=1)
        depths = torch.cat([depths, torch.full_like(pick, level + 1)], dim=1)
        ranks = torch.cat([ranks, cand_rank.gather(1, pick)], dim=1)
        if probs is not None:
            V = top_q.shape[-1]
            probs = torch.cat([probs, top_q.reshape(B, F * branch, V).gather(1, pick[:, :, None].expand(-1, -1, V))], 1)
        frontier_scores = best
        frontier_index = torch.arange(start, start + width, device=best.device).expand(B, -1)
    # rerank: the N best nodes, kept in expansion (topological) order, parents renumbered
    B, C = tokens.shape
    device = tokens.device
    keep = scores.topk(num_nodes, dim=-1).indices.sort(dim=-1).values  # [B, N] expansion indices
    new_index = torch.full((B, C + 1), -1, dtype=torch.int64, device=device)  # slot C: the root
    new_index.scatter_(1, keep, torch.arange(num_nodes, device=device).expand(B, -1).contiguous())
    old_parents = parents.gather(1, keep)  # [B, N], -1 = root
    new_parents = new_index.gather(1, torch.where(old_parents < 0, C, old_parents)).to(torch.int32)
    kept_probs = None if probs is None else probs.gather(1, keep[:, :, None].expand(-1, -1, probs.shape[-1]))
    return DraftTree(tokens.gather(1, keep), new_parents, own.gather(1, keep), depths.gather(1, keep),
                     ranks.gather(1, keep), kept_probs)


def observe_tree(calibration: Optional[NodeCalibration], tree: DraftTree, meta: SpecDecodeMetadata,
                 verdict: Verdict) -> None:
    """Feed a verified tree step to the calibration (a no-op without one)."""
    if calibration is not None:
        calibration.observe(tree.logprobs, tree.depth, tree.rank, tree.tokens, tree.parents, verdict.path,
                            verdict.num_accepted, verdict.tokens, meta.active)


class TreeModelDrafter(ModelDrafter):
    """Top-b draft tree from a HF draft model. ``slots`` is the number of nodes N' (<= N)."""

    is_tree = True
    device_steps = False  # a tree's forwards vary per step (eager)
    windowed_prefill = False  # (adaptive k, whose looks window the prefill, runs chains only)
    greedy_looks = False

    def __init__(self, model, runner_factory: RunnerFactory, *, branch: int, depth: int, budget: int,
                 vocab_size: int, calibration: Optional[NodeCalibration] = None):
        self.widths = beam_widths(branch, depth, budget)
        self.branch, self.depth = branch, depth
        self.calibration = calibration  # None: rank by draft log-probability (EAGLE-2)
        self.tree: Optional[DraftTree] = None
        super().__init__(model, runner_factory, k=tree_num_nodes(branch, depth, budget), vocab_size=vocab_size)

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """ModelDrafter's prefill, with room in the draft cache for [pending, every expanded node]."""
        B, S = meta.token_buffer.shape
        self._ensure_runner(B, S + sum(self.widths) + 1)
        super().prefill(prompts, meta)
        self.parents = torch.full((B, self.slots), -1, dtype=torch.int32, device=meta.device)  # [B, N]

    # ------------------------------------------------------------------ the step
    def _feed_unseen_and_pending(self, meta: SpecDecodeMetadata) -> torch.Tensor:
        """Chain-feed the committed tokens not yet in the draft cache and the pending token; commit all
        but the pending one. Returns the draft logits at the pending token [B, V_d]."""
        S = meta.token_buffer.shape[1]
        seen = self.runner.lengths.to(meta.device)  # [B]
        num_feed = meta.seq_lens - seen  # [B], 1 .. depth + 2
        width = int(num_feed.max())
        columns = torch.arange(width, dtype=torch.int64, device=seen.device)
        positions = (seen[:, None] + columns).clamp(max=S - 1)  # [B, W]
        feed = torch.gather(meta.token_buffer, 1, positions)  # [B, W]
        logits = self.runner.forward(feed, num_feed)  # [B, W, V_d]
        self.runner.commit(num_feed - 1)
        return logits[self._rows, num_feed - 1]

    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        pending = meta.pending_tokens()  # [B, 1]
        first = self._fit_vocab(self._feed_unseen_and_pending(meta))[:, None]  # [B, 1, V]
        processing = active_processing(meta)

        def frontier_logprobs(level, tokens, parents, frontier_index):
            if level == 0:
                logits = first
            else:  # draft logits at the frontier: one uncommitted tree forward of [pending, nodes so far]
                feed = torch.cat([pending, tokens], dim=1)  # [B, nodes so far + 1]
                out = self.runner.forward(feed, None, tree_parents=parents.to(torch.int32).contiguous())
                logits = self._fit_vocab(out.gather(
                    1, (frontier_index + 1)[:, :, None].expand(-1, -1, out.shape[-1])))  # [B, F, V]
            if processing is not None:  # each node's children from its processed q', as the target verifies p'
                logits = processing.apply_frontier(logits, tokens, parents, frontier_index, meta.temperature)
            return torch.log_softmax(logits.float(), dim=-1)

        sample_children = None if meta.sampling.greedy else self._sampler(meta)
        self.tree = grow_tree(frontier_logprobs, self.widths, self.branch, self.slots, self.calibration,
                              sample_children)
        self.token_ids.copy_(self.tree.tokens)
        self.parents.copy_(self.tree.parents)
        self.num_draft.fill_(self.slots)
        if self.tree.probs is not None:
            self.probs.copy_(self.tree.probs)
        return Proposal(self.token_ids, self.probs, self.num_draft, parents=self.parents)

    def _sampler(self, meta: SpecDecodeMetadata):
        """Children drawn without replacement from the filtered draft q (T > 0), with Philox draws of
        (seed, draft offset): level l uses the columns after those of levels < l."""
        b, sampling = self.branch, meta.sampling
        frontier = [1] + self.widths[:-1]  # nodes expanded at each level
        uniforms = ops.philox_uniforms(meta.seed, meta.draft_offset, b * sum(frontier))  # [B, b * sum F]
        starts = [b * sum(frontier[:level]) for level in range(len(frontier))]

        def sample_children(level, logprobs):
            B, F, _ = logprobs.shape
            u = uniforms[:, starts[level]:starts[level] + F * b].reshape(B, F, b)
            q = filtered_probs(logprobs, sampling)  # [B, F, V]
            fallback = torch.softmax(logprobs / sampling.temperature, dim=-1)
            return draw_without_replacement(q, fallback, u)

        return sample_children

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Nothing to roll back: the draft cache only ever commits committed tokens (see the module
        docstring); the next propose feeds the accepted path and the emitted token. The step's outcome
        updates the node calibration."""
        observe_tree(self.calibration, self.tree, meta, verdict)

    def checkpoint(self):
        """Trees are not probed (adaptive k is for chains)."""
        return None

    def start_rows(self, rows, prompts, meta) -> None:
        raise NotImplementedError("TreeModelDrafter does not support continuous batching (start_rows): a tree's "
                                  "draft cache is per step, not per row")
