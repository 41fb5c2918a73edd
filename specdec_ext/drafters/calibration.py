"""NodeCalibration: how often the target emits a tree candidate, as a function of its draft probability.

A tree's expected accepted length is the sum over its nodes of P(every token on the node's root path
is the token the target emits there), and each factor is P(target emits x | the parent was reached).
Ranking nodes by the draft's own cumulative log-probability (EAGLE-2) assumes that factor is q(x),
the draft probability; a draft (or a head) is rarely calibrated that way: a small draft's top-1 is
emitted more often than its q says, while deeper heads are overconfident. NodeCalibration learns the
factor online from the verify outcomes: per depth and sibling rank (1st, 2nd, 3rd or later choice of
the parent: at greedy a 2nd choice is emitted only when the 1st is not, whatever its probability),
the candidates' draft probabilities fall in ``bins`` equal bins, and each bin counts (candidates
reached, candidates emitted), starting from a prior of ``prior_trials`` reached candidates emitted
at the bin's centre probability (so before any data the ranking is EAGLE-2's). Any candidate set
that is a function of the past keeps verification lossless, so learning from earlier steps' outcomes
changes speed only, never the output distribution.

The tables live as long as the drafting model (``shared_calibration``: one per (model, tree depth,
temperature), held in a weak dictionary), so later generate() calls in the process start from what
earlier ones learnt; a seeded sample at T > 0 ranks by the prior alone instead (``learns=False``;
plan._tree_calibration says why: the seed must reproduce the sample whatever ran before and whatever rows
run beside it).
"""
from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch

CALIBRATION_BINS = 8
RANKS = 3  # sibling ranks told apart: 1st, 2nd, 3rd-or-later choice
PRIOR_TRIALS = 2.0  # pseudo-candidates per bin at the bin's centre probability
MIN_RATE = 1e-4  # floor of a bin's rate (its log is a node score)


_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[Tuple[int, float], NodeCalibration]]" = \
    weakref.WeakKeyDictionary()


def shared_calibration(model: torch.nn.Module, depth: int, temperature: float) -> "NodeCalibration":
    """The calibration of trees of ``depth`` levels drafted by ``model`` at ``temperature`` (made on first use)."""
    tables = _SHARED.setdefault(model, {})
    key = (depth, float(temperature))
    if key not in tables:
        tables[key] = NodeCalibration(depth)
    return tables[key]


def reset_calibrations() -> None:
    """Forget every shared calibration (each tree drafter then starts from the prior again)."""
    _SHARED.clear()


class NodeCalibration:
    """Per (depth, sibling rank) bins of draft probability -> rate at which the target emits the candidate."""

    def __init__(self, depth: int, *, bins: int = CALIBRATION_BINS, prior_trials: float = PRIOR_TRIALS,
                 device=None, learns: bool = True):
        self.depth, self.bins = depth, bins
        self.learns = learns  # False: the prior's rates, whatever is observed (plan._tree_calibration)
        centres = (torch.arange(bins, dtype=torch.float64, device=device) + 0.5) / bins
        self.trials = torch.full((depth, RANKS, bins), prior_trials, dtype=torch.float64, device=device)
        self.hits = centres.expand(depth, RANKS, bins) * prior_trials  # [d, RANKS, bins]
        self._log_rate = self._rates()

    def _rates(self) -> torch.Tensor:
        return (self.hits / self.trials).clamp(min=MIN_RATE).log().float()  # [d, RANKS, bins]

    def _bin(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs * self.bins).long().clamp(0, self.bins - 1)

    def log_rate(self, level: int, logprobs: torch.Tensor) -> torch.Tensor:
        """log P(emitted) of candidates at depth ``level + 1`` given their draft log-probabilities
        ``logprobs`` [..., b], the parent's top-b in order (the last dimension is the sibling rank)."""
        table = self._log_rate[min(level, self.depth - 1)].to(logprobs.device)  # [RANKS, bins]
        rank = torch.arange(logprobs.shape[-1], device=logprobs.device).clamp(max=RANKS - 1)
        return table[rank.expand_as(logprobs), self._bin(logprobs.exp())]

    def observe(self, node_logprobs: torch.Tensor, node_depth: torch.Tensor, node_rank: torch.Tensor,
                tokens: torch.Tensor, parents: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                emitted: torch.Tensor, active: torch.Tensor) -> None:
        """Count the candidates of a verified tree step.

        node_logprobs [B, N] fp32 (the score feature of each node: its draft log-probability),
        node_depth [B, N] (1 = child of the root), node_rank [B, N] (0 = the parent's first choice),
        tokens [B, N], parents [B, N] (-1 = root), path [B, N] and num_accepted [B] (tree_verify's),
        emitted [B, N+1] (the accepted tokens then the recovered/bonus one; the token emitted at
        depth j is emitted[:, j-1]), active [B] bool (rows whose step counts). No host reads: the
        counts are scattered into the tables, which move to the nodes' device on first use.
        """
        if not self.learns:
            return
        B, N = tokens.shape
        device = tokens.device
        path = path.to(torch.int64)
        accepted = num_accepted.to(torch.int64).clamp(min=0)  # [B]
        valid = torch.arange(N, device=device)[None, :] < accepted[:, None]  # [B, N] path slots in use
        on_path = torch.zeros((B, N), dtype=torch.int32, device=device)
        on_path.scatter_add_(1, path.clamp(min=0), valid.to(torch.int32))
        parents = parents.to(torch.int64)
        parent_on_path = on_path.gather(1, parents.clamp(min=0)) > 0
        reached = ((parents < 0) | parent_on_path) & active.to(device)[:, None]  # [B, N]
        depth = node_depth.to(torch.int64).clamp(1, self.depth)
        hit = reached & (tokens == emitted.gather(1, depth - 1))  # [B, N]
        rank = node_rank.to(torch.int64).clamp(0, RANKS - 1)
        index = (((depth - 1) * RANKS + rank) * self.bins + self._bin(node_logprobs.exp())).flatten()  # [B*N]
        if self.trials.device != device:
            self.trials, self.hits = self.trials.to(device), self.hits.to(device)
        self.trials.view(-1).scatter_add_(0, index, reached.flatten().to(self.trials.dtype))
        self.hits.view(-1).scatter_add_(0, index, hit.flatten().to(self.hits.dtype))
        self._log_rate = self._rates()
