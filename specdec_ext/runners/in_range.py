"""A draft runner fed only token ids its embedding has.

A target and a draft may pad their vocabularies to different sizes (models.check_vocabularies: each covers
the tokenizer). Where the target's output is the larger, it may emit an id past the draft's embedding (a
padding id: untrained, so rare, yet possible in sampling; Qwen2.5-7B's 152064 against its 0.5B draft's
151936), which the drafter then feeds its runner: the lean kernels refused it mid-generation ("feed ... is
outside the embedding") and HF's embedding raised an IndexError. ``InRangeFeeds`` maps such ids to
OUT_OF_RANGE_FEED wherever the drafter feeds its runner. The draft then conditions on another token there
and proposes worse; verification is the target's, so the output is unchanged (lossless).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

OUT_OF_RANGE_FEED = 0  # the id fed in place of one past the draft's embedding (any id it has would do)


class InRangeFeeds:
    """``runner`` (a ModelRunner) with every fed id below ``rows`` (its model's embedding rows); the rest of
    the runner as it is."""

    def __init__(self, runner, rows: int):
        self._runner, self._rows = runner, int(rows)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _tensor(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.masked_fill(ids >= self._rows, OUT_OF_RANGE_FEED)

    def _lists(self, sequences: Sequence[Sequence[int]]) -> List[List[int]]:
        return [[t if t < self._rows else OUT_OF_RANGE_FEED for t in s] for s in sequences]

    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._runner.start(self._lists(prompts))

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._runner.start_rows(rows, self._lists(prompts))

    def extend_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._runner.extend_rows(rows, self._lists(chunks))

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self._runner.forward(self._tensor(input_ids), *args, **kwargs)

    def greedy_chain(self, tokens: torch.Tensor, steps: int, *, feed: Optional[torch.Tensor] = None, **kwargs):
        if feed is None:  # (tokens[:, 0] is fed, then overwritten by the chain's own drafts from column 1)
            tokens[:, 0].masked_fill_(tokens[:, 0] >= self._rows, OUT_OF_RANGE_FEED)
        return self._runner.greedy_chain(tokens, steps, feed=None if feed is None else self._tensor(feed), **kwargs)


def in_range_feeds(runner, model, target_vocab: int):
    """``runner`` over ``model``, wrapped where ``target_vocab`` (the target's output size) passes the
    model's embedding rows; else ``runner`` itself."""
    rows = model.get_input_embeddings().weight.shape[0]
    return InRangeFeeds(runner, rows) if target_vocab > rows else runner
