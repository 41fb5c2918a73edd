"""LoadGatedK: the server's draft length per step, chosen from what the steps cost at the load it runs.

generate()'s k="auto" (adaptive.py) chooses k for one batch whose size is fixed for the generation. A
server's batch changes at every join and leave, and the regime map's crossover is a function of it: as
the batch widens, a verify pass of w rows x (K + 1) tokens stops being memory-bound and the drafted
tokens stop paying for it. So each step makes the same choice as k="auto", at the current width w:

    K* = argmax_K  sum_{b running} E_b(K) / time(w, K)            K in 0..k_max  (0: a plain step)

    E_b(K)     = 1 + sum_{i<=K} prod_{j<=i} a_{b,j}               (adaptive.expected_tokens)
    time(w, K) = V(w (K + 1)) + D(w, K) + H                       (K = 0: V(w) + H, no draft pass)

with the costs keyed by the load:

- V(n): a verify step (the target pass, the verifier, the commit) as a function of the tokens n = w x t
  it forwards: a moving average per n the server ran, interpolated linearly between them and extrapolated
  optimistically outside them (above the largest: the last segment's slope, flat from a single point;
  below the smallest: the first segment's slope, never below proportional to n): an option whose cost
  was never measured looks cheap, gets chosen and is then measured, so no option stays untried because
  a guess made it look dear. Keyed by tokens, not by (w, t): the GEMMs of a 16 x 1 pass see the 16 rows a 4 x 4
  pass does, so what one width measured serves the others (attention over the context differs, and the
  measurements at each n correct for the mix the server runs). Never below the floor the prompt
  chunks give (``PassFloor``): a pass's time per token does not rise with its tokens, so a pass of n
  tokens takes at least n t(c) / c for any prefill chunk of c >= n tokens timed. Without it the last
  segment's slope, measured between two nearby sizes, extrapolated a [16, 9] pass at 30 ms where it
  takes 67 (its tokens at 466 us each, a 256-token chunk's at 455: one thread, bf16, this CPU) and the
  server speculated at 16 rows at 0.6x plain decoding's rate for dozens of steps. A pass that follows a
  prompt chunk in its step is not timed into V: it runs on the caches the chunk evicted (measured at 16
  rows: a [16, 1] pass 8.3-9.1 ms after a chunk, 6.0-6.5 ms without; a [16, 5] pass 18-19 ms either way),
  an extra that the step pays whatever K it drafts. Timed in, the last chunks before a switch on left
  V(16) at 8.1 ms while speculation ran (no plain step measures it then), plain decoding estimated at
  1600 tokens/s where its steps ran at 1950, and K = 4 chosen at 0.9x plain decoding's rate.
- D(w, K): a draft step's time at w rows drafting K tokens (K sequential passes of [w, 1] and a fixed
  part: feeding the committed tokens, host work): per width, the least-squares line d_0 + K c (c >= 0,
  adaptive.nonneg_line) through the moving averages per K drafted there, through the origin while one K
  was; a width without data takes the nearest measured width's line (before any draft pass was timed,
  K x DEFAULT_PRIOR_DRAFT_COST x V(w)). A per-token cost measured at K = 1 alone carries the fixed part
  and made longer drafts look dear (measured: k = 1 chosen at one client, where k = 4 is 1.2x faster).
- H: the moving average of a step's host time outside the draft and verify parts.
- a_{b,j}: row b's acceptance by position, forgetting counts as in adaptive.py; a row that joins starts
  from the acceptance pooled over the rows that ended before it (p0 before any).

The pass is shared and padded ([w, K + 1]): a row drafting fewer than K saves nothing, so every row
drafts K* (adaptive.best_cap, with k="auto"'s guards: the longest K within LONGER_TOLERANCE of
the best, the K in use kept within SWITCH_MARGIN, switching on only when the best beats plain decoding
by SWITCH_ON_MARGIN; switching off is never delayed).

Catching up. A draft pass after plain steps first feeds the draft model every token committed since its
last pass (counted per slot: one per plain step its row ran); while off, time(w, K >= 1) is charged that
catch-up spread over CATCH_UP_HORIZON steps, at the measured feed time (``FeedCost``: a line d_0 + n c
through the feeds timed, by the tokens n they fed; before one was measured, the draft's per-token cost at
w rows / w per token; a time per token averaged over the feeds, as this was before, took a one-row feed's
call overhead for a per-token cost: 0.25 ms per token estimated where a 233-token feed at 16 rows took
0.012), and so are the draft prefills the batcher deferred for rows
that joined while off (``pending_tokens``: their committed tokens, fed before the first step that drafts,
at their own measured time per token, ``record_draft_prefill``; counting w x the steps since, as this did
before, charged a row that joined while off twice: 3.5 s estimated against 0.5 s measured at 16 rows),
and over fewer steps when the running rows have fewer tokens left to decode (``steps_left``: as a load
phase drains, its last rows switched speculation on and paid 0.35 s of catch-up a few tokens before
their end): a switch on must repay it soon (measured at 16 rows: single on-steps
scattered through plain stretches fed the draft every token and cost 3-10% of the throughput).

Measurements are kept fresh two ways. While speculation is off, every EXPLORE_EVERY steps (doubling up to
EXPLORE_BACKOFF x that while explorations leave it off) one step drafts EXPLORE_K tokens: the cheapest
look, it measures the rows' first-position acceptance and V at 2w, whose slope from V(w) extrapolates
the longer drafts (measured at 16 rows: exploring with the best K, often 8, cost a [16, 9] pass each
time, 2-3 plain steps). Only where the estimate is near: the best K's rate at least EXPLORE_BAND x plain
decoding's, and where its catch-up (the estimate above, paid in full by the exploring step) costs at most
EXPLORE_OVERHEAD x the plain steps until the next exploration (measured at 16 clients: an exploration's
step took 94 ms, 78 of them the deferred draft prefills of the rows that joined while off, against 8-ms
plain steps; every request running through it took ~1.3 ms more per token, and TPOT p99 rose 10% over
plain decoding's). An exploration's draft pass first feeds the draft model every token committed since its last
pass (the whole plain stretch, w rows of it), so exploring where speculation is far from paying would
charge the draft model's cost for every token decoded while off (measured: 0.95x plain at 16 clients);
a batch that shrinks changes the estimate (the costs are interpolated at the new width), not an
exploration. While on, where the choice is close (the best K within
REFRESH_BAND of plain decoding) and V(w) was not measured in the last STALE_STEPS steps, one plain step
without a prompt chunk before its pass (V(n), above) measures it again (with k="auto"'s 64 steps, a plain cost measured during a moment of load on the shared
CPU kept speculation on at 0.90x plain for a whole 32-client run).

Joining rows. While speculating, every request that joins pays the draft model's prefill of its prompt
before its first drafting step; while off, a later switch on pays it (``pending_tokens`` above). So each
K >= 1 is also charged J x (the draft prefill's time per token), J the prompt tokens joining per step
(a moving average over steps, ``record_joins``). Measured at 4 clients (64-token requests): the drafting
steps at 4 rows gained 5-25% over plain ones, and the steps in which a request joined cost 81-106 ms
against the plain server's 67-69 (the draft's prefill of ~250 tokens, ~8 ms, and a drafting step beside
the prompt chunk): the two about cancelled, where the estimate had seen the gain alone. J is at least the
prompt tokens of the rows still in their chunked prefill, spread over CATCH_UP_HORIZON steps (they join
within a few steps, and the average follows a burst too slowly): at the start of a 16-client burst the
first rows drafted at widths 2-6 while 15 prompts waited, each join then paid its draft prefill beside
the chunks, and the burst's first requests ran at a TPOT 10-16% above the plain server's (its p99).

No row slower. The batch's rate is a sum over its rows, but the pass is shared: a step drafting K takes
time(w, K) for every row, and a row that accepts little gets about one token from it where a plain step
gives it one in time(w, 0). So a K is chosen only where the row with the least E_b(K) still gets at
least (1 - ROW_LOSS_TOLERANCE) of its plain rate, E_b(K) / time(w, K) >= (1 - ROW_LOSS_TOLERANCE) /
time(w, 0); at one row this is the choice itself. Measured on a Zen 5 (avx512bf16, bench_serve, 16
clients into 16 rows): a step drafting 2 tokens at 16 rows took 17.5 ms against a plain step's 7.7, so
the batch gained 1.1-1.3x on those steps while a row accepting little ran at half its plain rate, and
the speculative server's TPOT p99 was 7-43% above the plain server's at an equal throughput; with this
rule, 1-11% (BENCHMARKS.md, issue 30, "On a Zen 5").

Holding a clear "off". Where the best K's estimated rate is below HOLD_BAND x plain decoding's, the choice
(K = 0) is kept for the next HOLD_STEPS steps while the running rows stay the same: between joins and
leaves nothing a plain step measures can move the estimate that far (no acceptance is observed while off;
the rows' growing catch-up only makes drafting dearer), and the estimate costs ~0.5 ms of Python per step
at 16 rows, 4% of a plain step of the bundled pair there (measured: the speculative server's plain steps
cost 13.4 ms of CPU against the plain server's 12.8, in-process).

Calibration. A server process starts knowing no cost. ``specdec serve`` runs one request of its own before it
listens (Engine.calibrate): its steps draft the schedule of ``start_calibration`` (plain steps, then every
K up and down again), so V(n) holds t = 1..k_max + 1 tokens at width 1 and D(1, K) every K before the
first client's step (measured at one client without it: the early steps chose from optimistic
extrapolations, and the controller drafted 3.2 tokens per step on average where 4 paid best). The
request's acceptance is forgotten afterwards (the prior is the clients'), its costs kept.

Under CUDA graphs (``lengths``: plan.graph_draft_lengths). A capture drafts one length for every row, so
the choice is made among the few lengths the batcher captures (the others' times are infinite) and given
to every slot (``choose(..., uniform=True)``); calibration and exploration use those lengths only.

Host work. The choice runs between two model passes, which evict numpy's code and data from the caches:
there a numpy call costs 4-6 us, and ``choose`` in numpy took 300-480 us a step at 4-32 rows (measured with
a 64-MB sweep between calls standing in for the pass), 4-6% of a plain step at 16 rows. The arithmetic
(the step times, E per row, the rates) runs on host floats, and a slot's E(K) is kept until its counts
change (``observe`` of its drafts, ``join``, a new pooled shape): while speculation is off no row drafts,
so the choice at 16-32 rows reads every E from that cache.

Seeded rows. A request that gave a seed (``GenerationRequest.seeded``) drafts ``pinned_k`` tokens every
step whatever the load, so that its tokens are the same alone and batched: its Philox draws follow its
own steps, and the draft lengths decide which draw serves which position. The pass is then at least
pinned_k + 1 wide. Greedy rows' tokens never depend on k, and an unseeded sample is distributed exactly
as the target's whatever k is (every choice verifies with the same lossless rule).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..adaptive import (DEFAULT_COST_SMOOTHING, DEFAULT_FORGETTING, DEFAULT_PRIOR_ACCEPTANCE,
                        DEFAULT_PRIOR_DRAFT_COST, DEFAULT_PRIOR_STRENGTH, EXPLORE_BACKOFF, GENERATION_SMOOTHING,
                        LONGER_TOLERANCE, MIN_TIMED_PREFILL_TOKENS, REFRESH_BAND, SWITCH_MARGIN, SWITCH_ON_MARGIN,
                        acceptance_by_position, best_cap, column_sums, expected_by_row, moving_average,
                        nonneg_line)
from ..stats import StepOutcome

EXPLORE_EVERY = 16  # steps between explorations while speculation is off
CATCH_UP_HORIZON = 16  # steps over which a switch on must repay the draft model's catch-up
STALE_STEPS = 16  # a plain step's cost (V(w)) older than this is measured again where the choice is close
EXPLORE_K = 1  # drafts per row of an exploration
JOIN_SMOOTHING = 0.05  # weight of a step in J, the prompt tokens joining per step (joins are rare and large)
HOLD_BAND = 0.9  # a choice to stay off is kept while the best K's rate is below this x plain decoding's ...
HOLD_STEPS = 8  # ... for this many steps, while the running rows stay the same
# A draft length is chosen only where no running row's expected rate falls more than this below what a plain
# step gives it ("No row slower")
ROW_LOSS_TOLERANCE = 0.1
PASS_FLOOR_MARGIN = 0.9  # of a prefill chunk's time per token: the chunk's own overheads (a row's start, the draft's
#   stand-in) are not in a verify pass, nor is all of its attention (measured: verify passes of 20-144 tokens at
#   1.03-1.2x a 256-token chunk's time per token, this CPU)
EXPLORE_BAND = 0.97  # ... made only where the best K's estimated rate is at least this x plain decoding's (near)
EXPLORE_OVERHEAD = 0.1  # ... and where its catch-up costs at most this x the plain steps until the next one
# Why a step drafted what it did (the /metrics label of each choice)
MEASURED = "measured"  # the argmax of the measured rates
EXPLORE = "explore"  # off: one step drafts the best K >= 1 to measure it
REFRESH = "refresh"  # on, close call: one plain step measures V(w) again
PINNED = "pinned"  # a seeded row is running: it drafts pinned_k (the others K*)
FIXED = "fixed"  # -k N: no choice
CALIBRATE = "calibrate"  # the server's own start-up request: every K in turn (start_calibration)
REASONS = (MEASURED, EXPLORE, REFRESH, PINNED, FIXED, CALIBRATE)


@dataclass(frozen=True)
class DraftChoice:
    """One step's draft lengths."""

    k: int  # the widest budget: the verify pass is [w, k + 1] (0: a plain step)
    reason: str  # one of REASONS
    budget: List[int]  # [w] drafts per row (0 for free slots)
    rates: Optional[Tuple[float, float]] = None  # (plain's, K*'s) estimated tokens/s, when estimated


class CostCurve:
    """A time as a function of a size: a moving average per size seen, interpolated (module docstring)."""

    def __init__(self, smoothing: float = DEFAULT_COST_SMOOTHING):
        self.smoothing = smoothing
        self.sizes: List[int] = []  # sorted
        self.times: Dict[int, float] = {}  # size -> seconds (moving average)
        self.seen: Dict[int, int] = {}  # size -> the step it was last observed

    def observe(self, size: int, seconds: float, step: int) -> None:
        if seconds <= 0 or size <= 0:
            return
        if size not in self.times:
            bisect.insort(self.sizes, size)
        self.times[size] = moving_average(self.times.get(size, math.nan), seconds, self.smoothing)
        self.seen[size] = step

    def fresh(self, size: int, step: int) -> bool:
        return step - self.seen.get(size, -10 ** 9) <= STALE_STEPS

    def at(self, size: int) -> Optional[float]:
        """The interpolated time at ``size`` (None before any observation; optimistic outside the sizes seen)."""
        sizes = self.sizes
        if not sizes:
            return None
        first, last = sizes[0], sizes[-1]
        if size <= first:
            proportional = self.times[first] * size / first
            if len(sizes) == 1:
                return proportional
            slope = max(0.0, (self.times[sizes[1]] - self.times[first]) / (sizes[1] - first))
            return max(self.times[first] - slope * (first - size), proportional)
        if size >= last:
            if len(sizes) == 1:
                return self.times[last]
            slope = max(0.0, (self.times[last] - self.times[sizes[-2]]) / (last - sizes[-2]))
            return self.times[last] + slope * (size - last)
        i = bisect.bisect_left(sizes, size)
        lo, hi = sizes[i - 1], sizes[i]
        if hi == size:
            return self.times[hi]
        f = (size - lo) / (hi - lo)
        return (1 - f) * self.times[lo] + f * self.times[hi]


class PassFloor:
    """A lower bound on a pass's time from the prompt chunks the server prefilled (module docstring, V(n)):
    ``at(n)`` = PASS_FLOOR_MARGIN x n x the largest time per token among the chunks of >= n tokens timed
    (0 where none was). Per chunk size, a moving average of its time per token."""

    def __init__(self, smoothing: float = DEFAULT_COST_SMOOTHING):
        self.smoothing = smoothing
        self.per_token: Dict[int, float] = {}  # chunk tokens -> seconds per token (moving average)
        self._sizes: List[int] = []  # sorted
        self._suffix: List[float] = []  # [i]: the largest per_token over _sizes[i:]

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if tokens not in self.per_token:
            bisect.insort(self._sizes, tokens)
        self.per_token[tokens] = moving_average(self.per_token.get(tokens, math.nan), seconds / tokens, self.smoothing)
        suffix, largest = [], 0.0
        for size in reversed(self._sizes):
            largest = max(largest, self.per_token[size])
            suffix.append(largest)
        self._suffix = suffix[::-1]

    def at(self, tokens: int) -> float:
        i = bisect.bisect_left(self._sizes, tokens)
        return PASS_FLOOR_MARGIN * tokens * self._suffix[i] if i < len(self._sizes) else 0.0


class DraftCosts:
    """D(w, K), a draft step's time at w rows drafting K tokens (module docstring)."""

    def __init__(self, smoothing: float = DEFAULT_COST_SMOOTHING):
        self.smoothing = smoothing
        self.times: Dict[int, Dict[int, float]] = {}  # width -> {K: seconds (moving average)}

    def observe(self, width: int, drafted: int, seconds: float) -> None:
        if seconds <= 0 or drafted <= 0:
            return
        at = self.times.setdefault(width, {})
        at[drafted] = moving_average(at.get(drafted, math.nan), seconds, self.smoothing)

    def line(self, width: int) -> Optional[Tuple[float, float]]:
        """(d_0, c) at ``width`` (the nearest measured width's; None before any observation)."""
        if not self.times:
            return None
        nearest = min(self.times, key=lambda w: (abs(w - width), w))
        points = self.times[nearest]
        if len(points) == 1:
            (k, seconds), = points.items()
            return 0.0, seconds / k
        ks = list(points)
        return nonneg_line(ks, [points[k] for k in ks], [1.0] * len(ks))


class FeedCost:
    """The draft model's catch-up feed time as a function of the tokens it feeds: a moving average of
    (tokens, seconds) per power-of-two size class, and the least-squares line d_0 + n c (c >= 0) through
    them; from one class, in proportion to the tokens (module docstring, "Catching up")."""

    def __init__(self, smoothing: float = DEFAULT_COST_SMOOTHING):
        self.smoothing = smoothing
        self.points: Dict[int, Tuple[float, float]] = {}  # size class -> (tokens, seconds), moving averages

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        size = int(tokens).bit_length()
        n, t = self.points.get(size, (math.nan, math.nan))
        self.points[size] = (moving_average(n, float(tokens), self.smoothing),
                             moving_average(t, seconds, self.smoothing))

    def at(self, tokens: int) -> Optional[float]:
        """Seconds to feed ``tokens`` tokens (None before any feed was timed)."""
        if not self.points:
            return None
        if len(self.points) == 1:
            (n, t), = self.points.values()
            return t * tokens / n
        fixed, per_token = self._line()
        return max(fixed + per_token * tokens, 0.0)

    def per_token(self) -> Optional[float]:
        """The time of one more token fed (the line's slope; from one class, its average per token)."""
        if not self.points:
            return None
        if len(self.points) == 1:
            (n, t), = self.points.values()
            return t / n
        return self._line()[1]

    def _line(self) -> Tuple[float, float]:
        xs, ys = zip(*self.points.values())
        return nonneg_line(xs, ys, [1.0] * len(xs))


class LoadGatedK:
    """The draft length of each server step (see the module docstring). ``k_max``: the server's draft
    slots; ``pinned_k``: what seeded rows draft; ``rows``: the slots; ``lengths``: the draft lengths a
    step may take (None: 0..k_max; under CUDA graphs ``graph_draft_lengths``, the shapes it captures)."""

    def __init__(self, k_max: int, *, rows: int, pinned_k: int, explore_every: int = EXPLORE_EVERY,
                 lengths: Optional[Sequence[int]] = None):
        if not 1 <= pinned_k <= k_max:
            raise ValueError(f"pinned_k must lie in [1, k_max={k_max}], got {pinned_k}")
        lengths = tuple(range(k_max + 1)) if lengths is None else tuple(sorted({int(K) for K in lengths}))
        if lengths[0] != 0 or lengths[-1] > k_max or pinned_k not in lengths or len(lengths) < 2:
            raise ValueError(f"lengths must hold 0, pinned_k={pinned_k} and others in [1, k_max={k_max}], got {lengths}")
        self.k_max, self.pinned_k, self.explore_every = int(k_max), int(pinned_k), max(int(explore_every), 1)
        self.lengths = lengths
        self._excluded = [K not in lengths for K in range(k_max + 1)]  # [k_max+1]: never chosen
        self.m, self.g = DEFAULT_PRIOR_STRENGTH, DEFAULT_FORGETTING
        self.reached = np.zeros((rows, k_max))  # R_i per slot, decayed
        self.accepted = np.zeros((rows, k_max))  # A_i per slot, decayed
        self.pooled = np.full(k_max, DEFAULT_PRIOR_ACCEPTANCE)  # acceptance of the rows that ended
        self.shape = np.ones(k_max)  # s_i of the pooled acceptance (adaptive.acceptance_by_position)
        self._prefix = np.tri(k_max + 1, k_max, k=-1)  # row j: j ones, then zeros
        self._expected: Dict[int, List[float]] = {}  # slot -> E(K), K = 0..k_max, until its counts change
        self.verify, self.draft, self.floor = CostCurve(), DraftCosts(), PassFloor()
        self.host = math.nan
        self.step = 0
        self._cap = 0  # K* of the last measured choice (0: speculation off)
        self._held: Optional[Tuple[int, Tuple[int, ...], DraftChoice]] = None  # (until step, running, choice)
        self._interval = self.explore_every
        self._next_explore = self.explore_every
        self._since_draft = 0  # plain steps since the last draft pass: the next one also feeds their tokens
        self._behind = [0] * rows  # per slot: tokens its row committed in plain steps since
        #   the last draft pass (what that pass feeds it; a row that joined while off is in pending_tokens)
        self.feed = FeedCost()  # the draft model's catch-up feed time by the tokens it feeds
        self.prefill_per_token = math.nan  # seconds per token of the draft prefills (record_draft_prefill)
        self.join_tokens = 0.0  # J: prompt tokens joining per step (record_joins)
        self.waiting_tokens = 0  # prompt tokens of the rows in their chunked prefill (record_joins)
        self._drafted = np.zeros(rows, dtype=bool)  # the slot's row drafted since it joined
        self._schedule: List[int] = []  # calibration: the draft lengths of the next steps
        self._warming = False  # the next observed step is the calibration's first: not timed
        self._prefill_seen = False  # observe_prefill saw a chunk (the first is not timed)
        for slot in range(rows):
            self.join(slot)

    # ------------------------------------------------------------------ calibration (module docstring)
    def start_calibration(self) -> int:
        """The next steps draft a fixed schedule: two plain steps (the first one warms up and is not
        timed), every K of ``lengths`` from 1 to k_max and back (the first draft step after plain ones is a catch-up, so
        each K is timed as a draft once at least), a plain step. Returns its length in steps."""
        drafting = [K for K in self.lengths if K > 0]
        self._schedule = [0, 0, *drafting, *reversed(drafting), 0]
        self._warming = True
        return len(self._schedule)

    @property
    def calibrating(self) -> bool:
        return bool(self._schedule)

    def end_calibration(self) -> None:
        """Forget the calibration request's rows (acceptance, the pooled prior, its join); keep the costs it measured."""
        self._schedule = []
        self.pooled = np.full(self.k_max, DEFAULT_PRIOR_ACCEPTANCE)
        self.shape = np.ones(self.k_max)
        self._expected.clear()
        self._cap, self._since_draft, self._held, self.join_tokens, self.waiting_tokens = 0, 0, None, 0.0, 0
        self._behind = [0] * len(self._behind)
        self._interval, self._next_explore = self.explore_every, self.step + self.explore_every
        for slot in range(self.reached.shape[0]):
            self.join(slot)

    # ------------------------------------------------------------------ rows
    def join(self, slot: int) -> None:
        """A request takes ``slot``: its counts start from the pooled prior."""
        self.reached[slot] = 0.0
        self.accepted[slot] = 0.0
        self._drafted[slot] = False
        self._behind[slot] = 0
        self.reached[slot, 0] = self.m
        self.accepted[slot, 0] = self.m * self.pooled[0]
        self._expected.pop(slot, None)

    def leave(self, slot: int) -> None:
        """The row in ``slot`` ended; a row that drafted moves the pooled prior towards its acceptance."""
        if self._drafted[slot]:
            mine = self.acceptance()[slot]
            self.pooled = (1 - GENERATION_SMOOTHING) * self.pooled + GENERATION_SMOOTHING * mine
            a = self.pooled
            self.shape[1:] = np.where(a[:-1] > 0, a[1:] / np.maximum(a[:-1], 1e-12), 1.0)
            self._expected.clear()  # (the shape enters every row's deep positions)

    def acceptance(self) -> np.ndarray:
        """a_i per slot: [rows, k_max]."""
        return acceptance_by_position(self.reached, self.accepted, self.shape, self.m)

    def _expected_sums(self, running: Sequence[int]) -> List[float]:
        """sum over the ``running`` slots of E_b(K), K = 0..k_max: [k_max+1] host floats ("Host work"); a slot's
        E is computed again only after its counts changed (``observe`` of its draft, ``join``, a new shape)."""
        missing = [slot for slot in running if slot not in self._expected]
        if missing:
            self._expected.update(zip(missing, expected_by_row(self.reached, self.accepted, self.shape, self.m, missing)))
        return column_sums([self._expected[slot] for slot in running], self.k_max + 1)

    # ------------------------------------------------------------------ costs
    def step_times(self, width: int) -> Optional[np.ndarray]:
        """time(width, K) for K = 0..k_max in seconds: [k_max+1]; None before any verify step was timed."""
        times = self._step_times(width)
        return None if times is None else np.array(times)

    def _step_times(self, width: int) -> Optional[List[float]]:
        """``step_times`` as host floats ("Host work")."""
        verify = [self.verify.at(width * (K + 1)) for K in range(self.k_max + 1)]
        if verify[0] is None:
            return None
        verify = [max(v, self.floor.at(width * (K + 1))) for K, v in enumerate(verify)]
        line = self.draft.line(width)
        fixed, per_token = line if line is not None else (0.0, DEFAULT_PRIOR_DRAFT_COST * verify[0])
        joining = max(self.join_tokens, self.waiting_tokens / CATCH_UP_HORIZON)  # (module docstring, "Joining rows")
        join_cost = joining * self._draft_prefill_per_token(width)
        drafts = [0.0] + [max(fixed + per_token * K, 0.0) + join_cost for K in range(1, self.k_max + 1)]  # K = 0: none
        host = 0.0 if math.isnan(self.host) else self.host
        return [v + d + host for v, d in zip(verify, drafts)]

    # ------------------------------------------------------------------ the batcher's calls
    @property
    def speculating(self) -> bool:
        """Whether the last measured choice drafted (the batcher defers joining rows' draft prefills while not)."""
        return self._cap > 0

    def choose(self, width: int, running: Sequence[int], seeded: Sequence[int], *, pending_tokens: int = 0,
               uniform: bool = False, steps_left: Optional[int] = None, after_prefill: bool = False) -> DraftChoice:
        """This step's draft lengths over slots 0..width-1: ``running`` the slots decoding, ``seeded``
        those of them whose request gave a seed; ``pending_tokens`` what the draft model must prefill
        before it drafts (rows that joined while speculation was off), charged like a catch-up;
        ``uniform`` (CUDA graphs: a capture drafts one length for every row): every slot gets the same
        budget, pinned_k while a seeded row runs; ``steps_left``: the most plain steps any running row may
        still take (its max_new_tokens left): a catch-up is repaid over at most that many steps;
        ``after_prefill``: a prompt chunk ran before this step's pass (which then cannot refresh V)."""
        self.step += 1
        held = self._held
        if held is not None and self.step < held[0] and held[1] == tuple(running) and not seeded \
                and len(held[2].budget) == width:
            return held[2]
        self._held = None
        times = self._step_times(width)
        reason, rates = MEASURED, None
        if self._schedule:
            cap, reason = self._schedule.pop(0), CALIBRATE
        elif times is None:  # nothing timed yet: draft the pinned length once to measure it
            cap = self.pinned_k
        else:
            catch_up = per_step = 0.0
            if self._cap == 0 and (self._since_draft or pending_tokens):
                horizon = CATCH_UP_HORIZON if steps_left is None else max(1, min(CATCH_UP_HORIZON, steps_left))
                catch_up = self._catch_up_s(width, running, pending_tokens)
                per_step = catch_up / horizon  # charged to every K >= 1
            times = [math.inf if excluded else t + (per_step if K else 0.0)
                     for K, (t, excluded) in enumerate(zip(times, self._excluded))]
            all_rates = [e / t for e, t in zip(self._expected_sums(running), times)]  # [k_max+1]
            if len(running) > 1:  # "No row slower": the row that accepts least, against its plain step
                worst = [min(column) for column in zip(*(self._expected[slot] for slot in running))]
                for K in range(1, self.k_max + 1):
                    if worst[K] * times[0] < (1.0 - ROW_LOSS_TOLERANCE) * times[K]:
                        all_rates[K] = 0.0
            switch_on = SWITCH_ON_MARGIN if self._cap == 0 else 0.0
            current = self._cap if self._cap > 0 else None
            cap = best_cap(all_rates, LONGER_TOLERANCE, current, SWITCH_MARGIN, switch_on) if running else 0
            best = max(range(1, self.k_max + 1), key=all_rates.__getitem__)  # (the first of equal rates)
            rates = (all_rates[0], all_rates[cap if cap > 0 else best])
            self._cap = cap
            if cap > 0:
                self._interval, self._next_explore = self.explore_every, self.step + self.explore_every
                if all_rates[best] < (1 + REFRESH_BAND) * all_rates[0] and not self.verify.fresh(width, self.step) \
                        and not after_prefill:
                    cap, reason = 0, REFRESH
            elif self.step >= self._next_explore and all_rates[best] >= EXPLORE_BAND * all_rates[0] \
                    and catch_up <= EXPLORE_OVERHEAD * self._interval * times[0]:
                cap, reason = min(K for K in self.lengths if K >= min(EXPLORE_K, self.k_max)), EXPLORE
                self._next_explore = self.step + self._interval
                self._interval = min(2 * self._interval, EXPLORE_BACKOFF * self.explore_every)
        budget = [0] * width
        seeded_set = set(seeded)
        for slot in running:
            budget[slot] = self.pinned_k if slot in seeded_set else cap
        if seeded_set and cap != self.pinned_k:
            reason = PINNED
        if uniform:
            budget = [self.pinned_k if seeded_set else cap] * width
        choice = DraftChoice(max(budget, default=0), reason, budget, rates)
        if reason == MEASURED and choice.k == 0 and rates is not None and rates[1] < HOLD_BAND * rates[0]:
            self._held = (self.step + HOLD_STEPS, tuple(running), choice)
        return choice

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The batcher prefilled a chunk of ``tokens`` prompt tokens (one row) in ``seconds``: V's floor. Not the
        first chunk it reports: the process's first pass (cold caches, first-use copies of the weights)."""
        if self._prefill_seen:
            self.floor.observe(tokens, seconds)
        self._prefill_seen = True

    def record_joins(self, tokens: int, waiting: int = 0) -> None:
        """Once per decode step: the prompt tokens of the rows that joined since the last one (J) and of the
        rows still prefilling (``waiting``: J is at least those over CATCH_UP_HORIZON steps)."""
        self.join_tokens = (1.0 - JOIN_SMOOTHING) * self.join_tokens + JOIN_SMOOTHING * max(int(tokens), 0)
        self.waiting_tokens = max(int(waiting), 0)

    def record_draft_prefill(self, tokens: int, seconds: float) -> None:
        """The batcher prefilled ``tokens`` tokens into the drafter in ``seconds`` (a joining row's prompt, or
        the deferred draft prefills when speculation switches on); fewer than MIN_TIMED_PREFILL_TOKENS are
        not timed (adaptive.py: the call's fixed cost, taken per token, priced later prefills 28x too dear)."""
        if tokens >= MIN_TIMED_PREFILL_TOKENS and seconds > 0:
            self.prefill_per_token = moving_average(self.prefill_per_token, seconds / tokens, DEFAULT_COST_SMOOTHING)

    def _catch_up_s(self, width: int, running: Sequence[int], pending_tokens: int = 0) -> float:
        """What the next draft pass spends feeding the tokens the ``running`` slots' rows committed in plain
        steps since the last one (counted per slot), and the draft prefills of the rows that joined while
        speculation was off (``pending_tokens``), each at its measured time per token."""
        behind = sum(self._behind[slot] for slot in running)
        return self._feed_s(width, behind) + pending_tokens * self._draft_prefill_per_token(width)

    def _feed_s(self, width: int, tokens: int) -> float:
        """Seconds a catch-up feed of ``tokens`` tokens takes (before one was timed: the draft's per-token
        cost at w rows / w per token)."""
        if tokens <= 0:
            return 0.0
        timed = self.feed.at(tokens)
        return tokens * self._drafted_per_token(width) if timed is None else timed

    def _draft_prefill_per_token(self, width: int) -> float:
        """Seconds per token of a draft prefill (before one was timed: a catch-up feed's per token)."""
        if not math.isnan(self.prefill_per_token):
            return self.prefill_per_token
        timed = self.feed.per_token()
        return self._drafted_per_token(width) if timed is None else timed

    def _drafted_per_token(self, width: int) -> float:
        """A drafted token's time per row at ``width`` rows (D's per-token cost / w; 0 before any draft pass)."""
        line = self.draft.line(width)
        return 0.0 if line is None else line[1] / width

    def observe(self, width: int, choice: DraftChoice, outcome: StepOutcome, *, verify_width: int,
                draft_time: float, verify_time: float, host_time: float, after_prefill: bool = False) -> None:
        """The step ``choice`` ran: its outcome, the verify pass's tokens per row and the parts' times;
        ``after_prefill``: a prompt chunk ran before it in the step (its verify time is then not V's)."""
        if self._warming:  # a first pass's cold caches and allocations are not what a step costs
            self._warming = False
            self._since_draft += 1
            for slot in outcome.rows:
                self._behind[slot] += 1
            return
        if not after_prefill:
            self.verify.observe(width * verify_width, verify_time, self.step)
        drafted = choice.k
        if drafted > 0 and not self._since_draft:
            self.draft.observe(width, drafted, draft_time)
        elif drafted > 0:  # a catch-up: its feed time per token, beyond the drafting
            line = self.draft.line(width)
            feed = draft_time - (0.0 if line is None else line[0] + drafted * line[1])
            behind = sum(self._behind[slot] for slot in outcome.rows)
            self.feed.observe(behind, feed)
        self._since_draft = self._since_draft + 1 if drafted == 0 else 0
        if drafted == 0:
            for slot in outcome.rows:
                self._behind[slot] += 1
        else:
            self._behind = [0] * len(self._behind)
        if host_time > 0:
            self.host = moving_average(self.host, host_time, DEFAULT_COST_SMOOTHING)
        live = [i for i, d in enumerate(outcome.drafted) if d > 0]
        if live:
            rows = [outcome.rows[i] for i in live]
            self._drafted[rows] = True
            reached, accepted = outcome.reached, outcome.accepted
            self.reached[rows] = self.g * self.reached[rows] + self._prefix[[reached[i] for i in live]]
            self.accepted[rows] = self.g * self.accepted[rows] + self._prefix[[accepted[i] for i in live]]
            for slot in rows:
                self._expected.pop(slot, None)


def describe(controller: Optional[LoadGatedK], slots: int) -> str:
    """The startup line's words for the draft length."""
    if slots == 0:
        return "no drafts (plain decoding)"
    if controller is None:
        return f"k={slots} fixed"
    if controller.lengths == tuple(range(controller.k_max + 1)):
        choices = f"0..{controller.k_max}"
    else:
        choices = "one of " + ", ".join(map(str, controller.lengths)) + " (the captured lengths)"
    return (f"k by load: {choices} per step from measured step costs at the running width "
            f"(seeded requests draft {controller.pinned_k})")
