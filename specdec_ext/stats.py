"""Statistics of a speculative generation and the cost model (cost_model.py) they are checked against.

The measured acceptance a is the fraction of drafted positions that were reached and accepted
(the maximum-likelihood estimate of an i.i.d. per-token acceptance); the draft cost c and the verify
cost v are measured per step, relative to one plain decode step of the target.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .cost_model import expected_tokens_per_pass, predicted_speedup
from .plots import plot_generation


def format_measured(value: Optional[float], spec: str) -> str:
    """``value`` in ``spec``, or "-" where nothing was measured (None or NaN: a position no step reached)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so that host timers measure it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """perf_counter() after a device synchronisation."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()


def median_time(timer, run: Callable[[], object], undo: Callable[[], object], passes: int) -> float:
    """Median seconds of ``passes`` timed calls of ``run`` (``timer.now()``), each followed by an
    untimed ``undo`` (the probes' rollback, so that every pass starts from the same state)."""
    times = []
    for _ in range(passes):
        start = timer.now()
        run()
        times.append(timer.now() - start)
        undo()
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True)
class StepOutcome:
    """A verify step's acceptance, on the host, for the stats and adaptive k (counted once, here).

    A row that drafted d tokens and accepted n of them *reached* draft positions 0..min(n+1, d)-1
    (position n, when n < d, is the rejected one) and *accepted* positions 0..n-1."""

    rows: List[int]  # the active (not frozen) rows
    drafted: List[int]  # num_draft of each of those rows
    accepted: List[int]  # num_accepted of each of those rows
    # positions reached per row, min(accepted + 1, drafted): computed once (read per row, it was O(B^2))
    reached: List[int] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "reached", [min(n + 1, d) for n, d in zip(self.accepted, self.drafted)])

    @classmethod
    def of(cls, num_accepted: Sequence[int], num_draft: Sequence[int], active: Sequence[bool],
           ended_at_leaf: Optional[Sequence[bool]] = None) -> "StepOutcome":
        """``ended_at_leaf`` (a tree step, per row): whether the accepted path ends at a node without children,
        past which no position was reached (a tree of N nodes is not N positions deep)."""
        rows = [b for b, live in enumerate(active) if live]
        outcome = cls(rows, [num_draft[b] for b in rows], [max(num_accepted[b], 0) for b in rows])
        if ended_at_leaf is not None:
            object.__setattr__(outcome, "reached", [min(n + (0 if ended_at_leaf[b] else 1), d) for b, n, d in
                                                    zip(rows, outcome.accepted, outcome.drafted)])
        return outcome


@dataclass
class GenerationStats:
    """What a generation measured. Times in seconds; rates per second."""

    k: int  # draft slots per step (a tree: its node budget; ``tree``)
    batch_size: int
    tree: Optional[Tuple[int, int, int]] = None  # (branch, depth, nodes) of a tree drafter, else None
    steps: int = 0  # decode steps (one target pass each, for the whole batch)
    row_steps: int = 0  # (row, step) pairs of active rows
    emitted: int = 0  # tokens the verifier emitted over active row-steps (before EOS/max cuts)
    new_tokens: int = 0  # tokens returned (after EOS, max_new_tokens and stop-string cuts)
    reached: List[int] = field(default_factory=list)  # [k] row-steps that reached draft position i
    accepted: List[int] = field(default_factory=list)  # [k] row-steps that accepted draft position i
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    target_step_time: Optional[float] = None  # one plain target decode step (k="auto"'s V(1), else the cost probe)
    adaptive: Optional[Dict[str, object]] = None  # adaptive k: AdaptiveK.summary() (chosen widths, costs)

    def __post_init__(self):
        if not self.reached:
            self.reached = [0] * self.k
            self.accepted = [0] * self.k

    # --------------------------------------------------------------- recording
    def record_step(self, outcome: StepOutcome) -> None:
        """One verify step (one target pass for the batch)."""
        self.steps += 1
        self.row_steps += len(outcome.rows)
        self.emitted += sum(outcome.accepted) + len(outcome.rows)
        for reached, accepted in zip(outcome.reached, outcome.accepted):
            for i in range(reached):
                self.reached[i] += 1
                self.accepted[i] += i < accepted

    # --------------------------------------------------------------- derived
    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per row per target pass: mean accepted + 1."""
        return self.emitted / self.row_steps if self.row_steps else float("nan")

    @property
    def acceptance_by_position(self) -> List[float]:
        """P(draft position i accepted | position i reached), i = 0..k-1."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance a: accepted / reached draft positions (all positions pooled)."""
        reached = sum(self.reached)
        return sum(self.accepted) / reached if reached else float("nan")

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else float("nan")

    @property
    def tpot(self) -> float:
        """Time per output token of a row after the first: decode time / (mean new tokens per row - 1)."""
        per_row = self.new_tokens / max(self.batch_size, 1)
        return self.decode_time / (per_row - 1) if per_row > 1 else float("nan")

    @property
    def draft_time_per_step(self) -> float:
        return self.draft_time / self.steps if self.steps else float("nan")

    @property
    def verify_time_per_step(self) -> float:
        return self.verify_time / self.steps if self.steps else float("nan")

    @property
    def draft_cost(self) -> float:
        """c: one draft forward relative to one plain target step (needs target_step_time)."""
        if not self.target_step_time or not self.steps or self.k == 0 or self.adaptive:
            return float("nan")  # (adaptive k: k is the most a step drafts, not what each did)
        return self.draft_time_per_step / self.k / self.target_step_time

    @property
    def verify_cost(self) -> float:
        """v: one verify step relative to one plain target step (needs target_step_time)."""
        if not self.target_step_time or not self.steps:
            return float("nan")
        return self.verify_time_per_step / self.target_step_time

    @property
    def predicted_tokens_per_pass(self) -> float:
        """The fixed-k cost model's tokens per pass at the measured acceptance (NaN under adaptive k, whose
        steps draft 0..k each)."""
        if not self.row_steps or self.adaptive:
            return float("nan")
        return expected_tokens_per_pass(self.acceptance_rate, self.k)

    @property
    def predicted_speedup(self) -> float:
        """The cost model's decode speedup from the measured acceptance a and step costs c, v."""
        if math.isnan(self.draft_cost) or math.isnan(self.acceptance_rate):
            return float("nan")
        return predicted_speedup(self.acceptance_rate, self.k, self.draft_cost, self.verify_cost)

    @property
    def measured_decode_speedup(self) -> float:
        """Tokens per decode second over 1 / target_step_time (decode phase only, no prefill)."""
        if not self.target_step_time or not self.steps:
            return float("nan")
        return self.tokens_per_pass * self.target_step_time / (self.decode_time / self.steps)

    def plot(self, path: str, *, label: str = "") -> str:
        """Draw acceptance by draft position and tokens per target pass against the cost model into ``path``
        (a .png, 1200 x 450 pixels; ``label`` names the pair in the title) and return ``path``. Needs
        matplotlib: ``pip install ".[plot]"`` in the checkout; raises ValueError when nothing was drafted."""
        return plot_generation(self, path, label=label)

    def as_dict(self) -> Dict[str, object]:
        return {
            "k": self.k,
            "tree": None if self.tree is None else list(self.tree),
            "batch_size": self.batch_size,
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "tokens_per_pass": self.tokens_per_pass,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "prefill_time_s": self.prefill_time,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "total_time_s": self.total_time,
            "tokens_per_s": self.tokens_per_second,
            "tpot_s": self.tpot,
            "target_step_time_s": self.target_step_time,
            "draft_cost_c": self.draft_cost,
            "verify_cost_v": self.verify_cost,
            "predicted_tokens_per_pass": self.predicted_tokens_per_pass,
            "predicted_speedup": self.predicted_speedup,
            "adaptive": self.adaptive,
        }

    def __str__(self) -> str:  # (print(result.stats): the summary, as README says; repr() keeps the fields)
        return self.summary()

    def summary(self) -> str:
        """A few human-readable lines."""
        by_pos = ", ".join(format_measured(a, "{:.2f}") for a in self.acceptance_by_position)
        lines = [
            f"tokens: {self.new_tokens} in {self.total_time:.3f}s ({format_measured(self.tokens_per_second, '{:.1f}')} tok/s, "
            f"TPOT {format_measured(self.tpot * 1e3, '{:.2f}')} ms), batch {self.batch_size}, "
            + (f"k=auto (k_max {self.k})" if self.adaptive
               else f"tree {self.tree[0]}x{self.tree[1]}, {self.k} nodes" if self.tree else f"k={self.k}"),
            f"target passes: {self.steps}, tokens per pass {format_measured(self.tokens_per_pass, '{:.2f}')} "
            f"(cost model {format_measured(self.predicted_tokens_per_pass, '{:.2f}')}), acceptance a={format_measured(self.acceptance_rate, '{:.3f}')}, "
            f"by position [{by_pos}]",
            f"time: prefill {self.prefill_time * 1e3:.1f} ms, draft {self.draft_time * 1e3:.1f} ms, "
            f"verify {self.verify_time * 1e3:.1f} ms",
        ]
        if self.target_step_time and self.adaptive:
            lines.append(f"cost model: k varies per step (adaptive k below); target step "
                         f"{self.target_step_time * 1e3:.2f} ms, measured decode speedup "
                         f"{format_measured(self.measured_decode_speedup, '{:.2f}x')}")
        elif self.target_step_time:
            lines.append(
                f"cost model: target step {self.target_step_time * 1e3:.2f} ms, c={self.draft_cost:.3f}, "
                f"v={self.verify_cost:.3f} -> predicted decode speedup {format_measured(self.predicted_speedup, '{:.2f}x')} "
                f"(measured {format_measured(self.measured_decode_speedup, '{:.2f}x')})")
        if self.adaptive:
            a = self.adaptive
            lines.append(f"adaptive k (k_max={a['k_max']}): mean k per row {format_measured(a['mean_row_k'], '{:.2f}')}, "
                         f"steps by verify width {a['steps_by_width']}, speculation off for "
                         f"{a['speculation_off_steps']} steps")
        return "\n".join(lines)
