"""TpotSlo: a target time per output token for every request (``specdec serve --tpot-slo-ms``).

A running row's time per token is the batch's step time (its decode step and the prefill chunk before
it) over the tokens the step gives the row. The scheduler has three levers, and this uses them where
the machine can meet the target:

- the draft length: none here. At a given width the k that maximises the batch's tokens per second
  (serve/draft_length.py) is the one that minimises each row's time per token, time(w, K) / E(K),
  so the SLO does not change it;
- the prefill chunk: a step's chunk is cut to what the target leaves after the decode step,
  (target x tokens per row per step - decode step time) / prefill time per token, all measured, at
  least MIN_PREFILL_CHUNK so that a joining prompt always advances;
- admission: a waiting request is admitted only while the time per token measured at the width it
  would make (interpolated between the widths run, optimistic beyond: serve/draft_length.CostCurve) is
  within the target; it waits in the queue instead (its time to first token pays, the running rows'
  times per token do not). One row is always admitted into an empty batch.

A request whose own time per token ended above the target counts as a miss (/metrics).
"""
from __future__ import annotations

import math
from typing import Optional

from ..adaptive import moving_average
from .draft_length import CostCurve

PREFILL_SMOOTHING = 0.3  # weight of a new chunk's time per token in its moving average


class TpotSlo:
    """The target (seconds per output token) and what the batcher measured against it."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"the TPOT target must be > 0 seconds, got {seconds!r}")
        self.target = float(seconds)
        self.per_token = CostCurve()  # width -> seconds per token of a running row
        self.prefill_per_token = math.nan
        self.last_step_s = 0.0  # the last decode step's time (no prefill)
        self.last_tokens = 1.0  # ... and the mean tokens it gave a running row
        self.steps = 0

    def observe_step(self, width: int, step_s: float, prefill_s: float, mean_tokens: float) -> None:
        """A step at ``width``: its decode time, the prefill chunk's before it, the mean tokens per row."""
        self.steps += 1
        self.last_step_s, self.last_tokens = step_s, max(mean_tokens, 1e-9)
        self.per_token.observe(width, (step_s + prefill_s) / self.last_tokens, self.steps)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_per_token = moving_average(self.prefill_per_token, seconds / tokens, PREFILL_SMOOTHING)

    def chunk_budget(self, ceiling: int, floor: int, decoding: bool) -> int:
        """Prompt tokens this step may prefill: what the target leaves after the decode step."""
        if not decoding or math.isnan(self.prefill_per_token):
            return ceiling
        spare = self.target * self.last_tokens - self.last_step_s
        return int(min(ceiling, max(floor, spare / self.prefill_per_token)))

    def admits(self, width: int) -> bool:
        """Whether a batch of ``width`` rows is expected to meet the target (unmeasured: yes)."""
        expected: Optional[float] = self.per_token.at(width)
        return expected is None or expected <= self.target

    def missed(self, per_token_s: Optional[float]) -> bool:
        return per_token_s is not None and per_token_s > self.target
