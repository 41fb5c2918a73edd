"""ServeMetrics: what the engine measured, in the Prometheus text exposition format (version 0.0.4).

The engine thread records; ``render`` (the /metrics endpoint, another thread) reads under one lock.
Gauges that describe the engine's state now (queue length, running rows, cache in use) are passed to
``render`` by the engine, so they are never stale.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

from ..stats import GenerationStats, StepOutcome

PREFIX = "specdec"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
REQUEST_TIME_SMOOTHING = 0.2  # weight of the newest request in the mean request time (Retry-After)

Gauge = Tuple[str, float, Dict[str, str]]  # (help, value, labels)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[index] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> List[str]:
        out, total = [], 0
        for bound, count in zip(list(self.buckets) + [math.inf], self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {total}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


class ServeMetrics:
    """Counters and histograms of the serving engine (see the module docstring)."""

    def __init__(self, draft_slots: int, tpot_slo: Optional[float] = None):
        self._lock = threading.Lock()
        self.draft_slots = int(draft_slots)
        self.finished: Counter = Counter()  # finish reason -> requests
        self.rejected: Counter = Counter()  # reason -> requests
        self.prompt_tokens = self.generated_tokens = 0
        self.steps = GenerationStats(k=self.draft_slots, batch_size=0)  # target passes, acceptance by position
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.mean_request_s: Optional[float] = None
        self.draft_lengths: Counter = Counter()  # (k, reason) -> decode steps
        self.tpot_slo, self.slo_misses = tpot_slo, 0  # the TPOT target (seconds) and requests that missed it

    def reset(self) -> None:
        """Every counter and histogram back to zero (after the engine's calibration request)."""
        fresh = ServeMetrics(self.draft_slots, self.tpot_slo)
        with self._lock:
            for name, value in vars(fresh).items():
                if name != "_lock":
                    setattr(self, name, value)

    # ------------------------------------------------------------------ recording (engine thread)
    def record_step(self, outcome: StepOutcome) -> None:
        """One target pass over the running rows."""
        with self._lock:
            self.steps.record_step(outcome)

    def record_draft_length(self, k: int, reason: str) -> None:
        """One decode step drafted ``k`` per row (the widest budget; 0: a plain step), for ``reason``."""
        with self._lock:
            self.draft_lengths[(k, reason)] += 1

    def record_slo_miss(self) -> None:
        with self._lock:
            self.slo_misses += 1

    def record_tokens(self, count: int) -> None:
        with self._lock:
            self.generated_tokens += count

    def record_end(self, finish_reason: str, prompt_tokens: int, new_tokens: int, seconds: float,
                   first_token_s: Optional[float], per_token_s: Optional[float]) -> None:
        """A request ended: its reason, sizes, time since it was submitted, time to its first token and
        mean time per later token (None where it has none)."""
        with self._lock:
            self.finished[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            if first_token_s is not None:
                self.ttft.observe(first_token_s)
            if per_token_s is not None:
                self.tpot.observe(per_token_s)
            w = REQUEST_TIME_SMOOTHING
            self.mean_request_s = seconds if self.mean_request_s is None else (1 - w) * self.mean_request_s + w * seconds

    def record_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    # ------------------------------------------------------------------ reading
    def tokens_per_target_pass(self) -> float:
        return self.steps.tokens_per_pass if self.steps.row_steps else 0.0

    def render(self, gauges: Dict[str, Gauge]) -> str:
        """The exposition text: counters, then ``gauges`` (name -> (help, value, labels)), then histograms."""
        with self._lock:
            out: List[str] = []
            _family(out, "requests_total", "counter", "Requests that ended, by finish reason.",
                    [({"finish_reason": r}, n) for r, n in sorted(self.finished.items())])
            _family(out, "requests_rejected_total", "counter", "Requests refused before they ran, by reason.",
                    [({"reason": r}, n) for r, n in sorted(self.rejected.items())])
            _family(out, "prompt_tokens_total", "counter", "Prompt tokens of ended requests.",
                    [({}, self.prompt_tokens)])
            _family(out, "generated_tokens_total", "counter", "Tokens returned to clients.",
                    [({}, self.generated_tokens)])
            steps = self.steps
            _family(out, "target_passes_total", "counter", "Batched target passes (decode steps).",
                    [({}, steps.steps)])
            _family(out, "row_target_passes_total", "counter", "Target passes counted per running row.",
                    [({}, steps.row_steps)])
            _family(out, "tokens_per_target_pass", "gauge",
                    "Tokens the verifier emitted per row per target pass (accepted drafts + 1), since start.",
                    [({}, self.tokens_per_target_pass())])
            _family(out, "draft_length_steps_total", "counter",
                    "Decode steps by draft length k (0: a plain step, speculation off) and why it was chosen "
                    "(measured, explore, refresh, pinned, fixed).",
                    [({"k": str(k), "reason": r}, n) for (k, r), n in sorted(self.draft_lengths.items())])
            _family(out, "speculation_off_steps_total", "counter", "Decode steps that drafted nothing.",
                    [({}, sum(n for (k, _), n in self.draft_lengths.items() if k == 0))])
            if self.tpot_slo is not None:
                _family(out, "tpot_slo_seconds", "gauge", "The target time per output token (--tpot-slo-ms).",
                        [({}, self.tpot_slo)])
                _family(out, "tpot_slo_misses_total", "counter",
                        "Requests whose time per output token ended above the target.", [({}, self.slo_misses)])
            positions = [{"position": str(i + 1)} for i in range(self.draft_slots)]
            _family(out, "draft_reached_total", "counter", "Row-steps that reached draft position i.",
                    list(zip(positions, steps.reached)))
            _family(out, "draft_accepted_total", "counter", "Row-steps that accepted draft position i.",
                    list(zip(positions, steps.accepted)))
            _family(out, "draft_acceptance_rate", "gauge",
                    "Accepted / reached at draft position i, since start.",
                    [(p, a / r if r else 0.0) for p, r, a in zip(positions, steps.reached, steps.accepted)])
            for name, (help_text, value, labels) in gauges.items():
                _family(out, name, "gauge", help_text, [(labels, value)])
            for name, help_text, histogram in (
                    ("time_to_first_token_seconds", "Time from submission to the first token.", self.ttft),
                    ("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
                     self.tpot)):
                out += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
                out += histogram.lines(f"{PREFIX}_{name}")
            return "\n".join(out) + "\n"


def _family(out: List[str], name: str, kind: str, help_text: str, samples) -> None:
    out += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.append(f"{PREFIX}_{name}{{{label_text}}} {_number(value)}" if label_text
                   else f"{PREFIX}_{name} {_number(value)}")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))
