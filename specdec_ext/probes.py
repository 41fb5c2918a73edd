"""Adaptive k's start-up probes and the cost-model probe of a plain step: target passes and draft steps
timed on the caches of the running generation, each rolled back, so the caches are left as they were."""
from __future__ import annotations

import time
import weakref
from typing import Dict, Optional, Tuple

import torch

from .adaptive import ProbeRequest
from .drafters import Drafter
from .metadata import SpecDecodeMetadata
from .runners import ModelRunner
from .stats import Timer, median_time
from .step import sample_plain

COST_PROBE_PASSES = 3  # plain one-token target passes timed after prefill for the cost model
# A plain step probed this recently for the same target model, batch size and device stands for the next
# generations' (the cost-model stats only): with a fixed k every generate() call paid COST_PROBE_PASSES
# target passes (~6 ms on the bundled pair, one CPU thread) that the caller waited for
PLAIN_STEP_REUSE_S = 60.0
_PLAIN_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(B, device): (s, when)}


def probe_target_step(target: ModelRunner, meta: SpecDecodeMetadata, timer: Timer) -> float:
    """Median time of one plain decode step (one-token target pass, sampling, commit): the cost
    model's unit. Each probe step is rolled back (truncate), so the caches are left as they were."""
    B = meta.batch_size
    pending = meta.pending_tokens()  # [B, 1]
    lengths = target.lengths.clone()  # [B]
    one = torch.ones_like(meta.seq_lens)  # [B]
    token = torch.empty((B, 1), dtype=torch.int64, device=meta.device)  # [B, 1]
    status = torch.empty((B,), dtype=torch.int32, device=meta.device)  # [B]

    def plain_step():
        sample_plain(target.forward(pending), meta, token, status, check=False)
        token.tolist()
        target.commit(one)

    return median_time(timer, plain_step, lambda: target.truncate(lengths), COST_PROBE_PASSES)


def recent_target_step(target: ModelRunner, meta: SpecDecodeMetadata, timer: Timer) -> float:
    """``probe_target_step``, or the one made for the same target model, batch size and device within the
    last PLAIN_STEP_REUSE_S seconds (in this process)."""
    try:
        table = _PLAIN_STEPS.setdefault(target.model, {})
    except TypeError:  # (a model that cannot be weakly referenced: probed every time)
        return probe_target_step(target, meta, timer)
    key, now = (meta.batch_size, str(meta.device)), time.monotonic()
    recent = table.get(key)
    if recent is not None and now - recent[1] < PLAIN_STEP_REUSE_S:
        return recent[0]
    seconds = probe_target_step(target, meta, timer)
    table[key] = (seconds, now)
    return seconds


def probe_costs(target: ModelRunner, drafter: Drafter, meta: SpecDecodeMetadata, request: ProbeRequest,
                timer: Timer, passes: int) -> Tuple[Dict[int, float], Dict[int, float]]:
    """Adaptive k's start-up probes (adaptive.ProbeRequest), each pass rolled back: ({t: seconds} of
    target forwards over [B, t], {s: seconds} of draft steps of s tokens per row). The draft probe
    needs a drafter whose proposals cost something (its ``checkpoint`` gives an undo)."""
    B = meta.batch_size
    draft_times: Dict[int, float] = {}
    undo = drafter.checkpoint() if request.draft_counts else None
    if undo is not None:
        for i, count in enumerate(request.draft_counts):
            budget = [count] * B
            if i == 0:  # warm-up
                drafter.propose(meta, budget)
                undo()
            draft_times[count] = median_time(timer, lambda: drafter.propose(meta, budget), undo, passes)
    verify_times: Dict[int, float] = {}
    if request.verify_widths:
        pending = meta.pending_tokens()  # [B, 1]
        lengths = target.lengths.clone()  # [B]
        target.forward(pending)  # warm-up
        target.truncate(lengths)
        for t in request.verify_widths:
            tokens = pending.expand(B, t).contiguous()  # [B, t]: the content does not change the cost
            verify_times[t] = median_time(timer, lambda: target.forward(tokens), lambda: target.truncate(lengths),
                                          passes)
    return verify_times, draft_times


def probe_plain_chain(target: ModelRunner, meta: SpecDecodeMetadata, passes: int, timer: Timer,
                      repeats: int) -> Optional[float]:
    """Adaptive k's start-up probe of P: seconds per pass of a greedy plain chain of ``passes`` passes
    from each row's pending token (the median of ``repeats`` calls, each rolled back); None when the
    cache has no room for one pass."""
    lengths = target.lengths.clone()  # [B]
    passes = min(passes, target.max_seq_len - max(lengths.tolist()))
    if passes < 1:
        return None
    chain = torch.empty((meta.batch_size, passes + 1), dtype=torch.int64)  # [B, 1 + passes]
    chain[:, 0] = meta.pending_tokens()[:, 0].cpu()
    seconds = median_time(timer, lambda: target.greedy_chain(chain, passes + 1), lambda: target.truncate(lengths),
                          repeats)
    return seconds / passes
