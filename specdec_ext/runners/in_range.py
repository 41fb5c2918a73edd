"""A draft runner fed only token ids its embedding has.

A target and a draft may pad their vocabularies to different sizes (models.check_vocabularies: each covers
the tokenizer). Where the target's output is the larger, it may emit an id past the draft's embedding (a
padding id: untrained, so rare, yet possible in sampling; Qwen2.5-7B's 152064 against its 0.5B draft's
151936), which the drafter then feeds its runner: the lean kernels refused it mid-generation ("feed ... is
outside the embedding") and HF's embedding raised an IndexError. ``in_range_feeds`` maps such ids to
OUT_OF_RANGE_FEED in every method through which the drafter feeds its runner. The draft then conditions on
another token there and proposes worse; verification is the target's, so the output is unchanged (lossless).
The runner stays itself (its type, capabilities and state): only those methods are wrapped, on the instance.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

OUT_OF_RANGE_FEED = 0  # the id fed in place of one past the draft's embedding (any id it has would do)


def in_range_feeds(runner, model, target_vocab: int):
    """``runner`` over ``model``, its feeding methods wrapped where ``target_vocab`` (the target's output size)
    passes the model's embedding rows; returns it."""
    rows = int(model.get_input_embeddings().weight.shape[0])
    if target_vocab <= rows:
        return runner

    def tensor(ids: torch.Tensor) -> torch.Tensor:
        return ids.masked_fill(ids >= rows, OUT_OF_RANGE_FEED)

    def lists(sequences: Sequence[Sequence[int]]) -> List[List[int]]:
        return [[t if t < rows else OUT_OF_RANGE_FEED for t in s] for s in sequences]

    start, start_rows, forward = runner.start, runner.start_rows, runner.forward

    runner.start = lambda prompts: start(lists(prompts))
    runner.start_rows = lambda rows_, prompts: start_rows(rows_, lists(prompts))
    runner.forward = lambda input_ids, *args, **kwargs: forward(tensor(input_ids), *args, **kwargs)
    if runner.capabilities.chunked_prefill:  # (extend_rows, declared)
        extend_rows = runner.extend_rows
        runner.extend_rows = lambda rows_, chunks: extend_rows(rows_, lists(chunks))
    if runner.capabilities.greedy_chain:
        greedy_chain = runner.greedy_chain

        def chain(tokens: torch.Tensor, steps: int, *, feed: Optional[torch.Tensor] = None, **kwargs):
            if feed is None:  # (tokens[:, 0] is fed, then the chain's own drafts from column 1)
                tokens[:, 0].masked_fill_(tokens[:, 0] >= rows, OUT_OF_RANGE_FEED)
            return greedy_chain(tokens, steps, feed=None if feed is None else tensor(feed), **kwargs)

        runner.greedy_chain = chain
    return runner
