"""Adaptive draft length: per row and per step, the k that maximises expected tokens per second.

``AdaptiveK`` is a host-side controller the decode loop consults once per step (``plan``: the draft
budget of every row) and informs once per step (``observe``), or once per plain chain segment it ran
instead of steps when every budget was 0 (``observe_plain``). It never touches the device: it works
on the host lists the loop already reads (stats.StepOutcome) and on times the loop measures, its
step timers and the start-up probes it runs when ``start`` asks for them (decode.probe_costs,
decode.probe_plain_chain).

The maths
---------
Acceptance by position. For row b and draft position i = 1..k_max let a_i be the probability that
draft i is accepted GIVEN that drafts 1..i-1 were (position i was *reached*). Acceptance varies
with i (the draft drifts away from the target; yet the steps that reach deep positions are the easy
stretches, and on the bundled pair a_i rises with i), so a_i is estimated per position, not as one
i.i.d. a. Each verify step of a row that drafted d tokens and accepted n of them reached positions
1..min(n+1, d) and accepted positions 1..n. With exponential forgetting (factor g per drafting step
of the row, an effective window of 1 / (1 - g) steps) the counts are

    R_i <- g R_i + [i reached],    A_i <- g A_i + [i accepted]          (every position, each step)

Every position decays each step, reached or not: all a_i then describe the same recent window. (A
decay per observation of the position would let a deep position keep the counts of the last easy
streak that reached it, long after the row turned hard, and overstate E(k) for long drafts.)

starting from m pseudo-observations of acceptance p0 at position 1 (R_1 = m, A_1 = m p0: a prior
that is forgotten like any observation, so a row that never accepts goes to a_1 -> 0), and

    a_1 = A_1 / R_1,      a_i = (A_i + m min(1, s_i a_{i-1})) / (R_i + m)   for i > 1

(a deep position with little data behaves like the position before it, times s_i). A later generation
with the same target, drafter and batch size starts its rows from m pseudo-observations at position 1
of the acceptance pooled over the previous generations' rows, and from its shape s_i = a_i / a_{i-1}
(1 without a pooled prior) (``start`` / ``finish``: the pool is a moving average over generations with
weight GENERATION_SMOOTHING, so that a start follows the workload rather than the one prompt before
it; a generation that drafted nothing moves it towards p0). Before their own data, deep positions thus
follow the row's own position 1 in the pooled shape: pseudo-observations at every position kept a
low-acceptance prompt's deep positions at the pool's (0.95 where 0.6 came) for some 30 steps, and
E(k) with them.

Expected tokens. A row drafting k tokens emits the accepted prefix plus one recovered/bonus token:

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j           (E(0) = 1: plain decoding)

which is (1 - a^(k+1)) / (1 - a) of the mission note when every a_i = a.

Cost. A step of the loop with k drafts (k >= 1) takes

    time(k) = V(k + 1) + D(k) + H     (D(0) = 0: no draft pass at all; D(k) ~ k c)

where V(t) is the measured time of a verify step over t tokens per row (the target forward over
[B, t], the verifier and the commit) at the CURRENT batch size, D(k) the measured time of a
draft step of k tokens per row, and H the measured host time between two steps (the stop checks,
the stats, ``observe`` and ``plan``: the moving average of the gap from one step's commit to the
next step's draft, the time the loop's consumer holds it between yields left out). Both V and D come
from noisy timings (a few percent per step on a CPU, more on a shared one, where a step now and then
loses a time slice to another process: every moving average of times caps a new time at SPIKE_CAP x
itself), so each is a weighted least-squares fit through what was measured, not an interpolation
between points: D a line, V a line that may bend upwards once (``knee_curve``):

    V(t) = V_1 + (t - 1) v' + d max(0, t - h),  v', d >= 0      D(k) = d_0 + k c,  c >= 0   (D(0) = 0)

Interpolating noisy points and forcing the result non-decreasing kept the noise that happened to
be high and biased every choice towards short drafts (BENCHMARKS.md, "k=auto"). A line alone is
wrong where a pass turns from memory-bound to compute-bound within the widths k_max + 1 spans: on
the AVX2 path the bundled target's pass is flat to t = 2-3 and then rises by 0.6 of V_1 a row, and a
line through it put V(3) 25% high, so k="auto" stayed off where drafting 2 tokens ran at 1.2x plain
(BENCHMARKS.md, "V's knee"). V's points: a start-up probe (target forwards over [B, t] for t in
{1, 2, 3, 4, k_max+1}, the median of three each, rolled back; asked for once per process for a target
model and batch size, whose costs the later controllers share: by the first generation that runs, which
need not be the first one, since a generation that ends at its prefill probes nothing), weight 1, and
the moving average of every width the loop ran within the last COST_MEMORY_STEPS steps, weight
OBSERVED_WEIGHT. The probe times the forward only, while a step also verifies and commits: probed points
are shifted by the running mean of (observed - probed) time at the widths the loop ran. D's points: a
start-up probe of the drafter (draft steps of 1, 2, 3 and k_max tokens, each rolled back; for a drafter whose proposals
cost something, i.e. whose ``checkpoint`` gives an undo; once per process for a drafter and batch
size), weight 1, shifted by the running mean of (observed - probed) time at the counts the loop ran (a
probed step feeds nothing, the loop's also feed what the last step committed: without the shift the line
through the probe and the one count the loop ran put that count 15-25% low, measured on forced AVX2), and
the moving average of the draft time per drafted count the loop ran within the
last COST_MEMORY_STEPS steps (a draft pass right after skipped steps or a plain segment also feeds
their tokens and is not timed), weight OBSERVED_WEIGHT. The probe anchors the line at both ends: the
counts the loop runs cluster near its choice, and a draft step has a fixed part (feeding the committed
tokens, host work) that a line through them alone would get wrong. Without a probe and with a single
count observed, D(k) = k c.
In relative units v = V(k+1) / V(1), c' = c / V(1) (with d_0 = 0 and H = 0) this is the note's
speedup E / (v + k c').

Plain decoding, k = 0, is whatever the loop runs when no row drafts, at its own measured cost: time(0)
= P, the time per pass of greedy plain chains (``start``'s ``plain_chain`` > 0: every row greedy on a
runner that chains, decode.plain_segment: PLAIN_CHAIN_TOKENS one-token passes per op call, the stop
checks between calls: 1.2-1.4x faster per token than a one-token step of the loop, measured on the
bundled pair), else the loop's
one-token step, time(0) = V(1) + H. P is the moving average of the observed segments' time per pass
(their host time included) over the segments of ``plain_chain`` passes: a shorter one, a row's last
passes before its stop, pays a chain call's fixed cost over fewer passes (1.3-1.5x P a pass on the
bundled pair, forced AVX2), and it carried into the next generation's choice; before any segment, a
start-up probe (greedy chains of ``plain_chain`` passes, the median of three, rolled back; once per
process for a target and batch size). The two
sides are measured at different times, and another process on the cores slows every cost alike
(on the shared 2-core VM: by up to 2x within seconds), so neither side is compared stale with the
other fresh. While off, time(k >= 1) is scaled by how P moved since the last step was observed
(without this, a load rising during a plain stretch made the old step costs look cheap and switched
speculation on at a loss). While speculating no segment runs, so a P older than COST_MEMORY_STEPS
steps (or only probed) is measured again, by one plain segment, wherever the choice is close: the
best K's rate within REFRESH_BAND of plain decoding's (a segment then costs little; where
speculation wins by more, a stale P cannot change the choice). Speculation is thus measured
against the plain decoding the caller would otherwise get (``plain_generate``), not against the
loop's slower one-token step, which is what made k="auto" keep speculating where it lost a third of
the speed (issue 25).

Context. A pass reads every cached key and value of its rows, so each of these times grows with the
context: by beta a token of a row's committed context (``ContextSlope``; the same for a plain pass and a
verify pass of a few rows, whose keys are read once for the block). The costs are shared by the
generations of a process, whose prompts differ in length, and each time is kept with the context it was
measured at; ``plan``'s ``context`` (the active rows' mean) is where they are compared: every time is
shifted by beta x (context - its own). Measured on the bundled target, one thread: beta = 0.33 us a
token on the avx512bf16 path, 0.7 us on forced AVX2 (a pass over 32 and over 1024 tokens: 1.22 and
1.55 ms, 1.47 and 2.17 ms); a P observed over a 460-token prompt was 13% above a 150-token prompt's,
which made the next short prompt speculate at a loss (BENCHMARKS.md, "The costs at the context of the
step"). beta is the least-squares slope of time on context within each kind of pass, once the passes
spread over enough context; until then (a single prompt length) the times are compared as measured.

Choice. Row b's preferred draft length is

    k_b = argmax_{k in 0..k_max} E_b(k) / time(k)                      (tokens per second)

so k_b = 0 (speculation off for the row) exactly when no draft length beats plain decoding (by
SWITCH_ON_MARGIN while speculation is off, "Guards" below). All rows share one target pass whose
width is the largest k in the batch plus one, padded to [B, K+1]: a row drafting fewer than K saves
no time and loses expected tokens (E is increasing), so every active row drafts the batch's

    K* = argmax_K  sum_{b active} E_b(K) / time(K)

and a row whose own k_b is 0 rides along at no cost (nor does any row draft more than remaining - 1, the
tokens left to the longest unfinished row less the one every step emits: drafts past them are never kept,
while a one-token ending paid a k_max draft and a width k_max + 1 pass). K* = 0 switches speculation off
for the batch (the drafter is not called; the loop runs a plain chain segment, or a plain one-token step where
it cannot chain, and plans again after it): this is how the batch-size crossover of the regime map
shows up, measured rather than hard-coded: as the batch grows, V(t) / V(1) grows (the verify pass
stops being memory-bound) and time(K) outgrows the extra tokens. K* = 0 exactly when plain
decoding's rate is at least every K >= 1's (the gain of speculation below one); the guards below
choose among the K >= 1 only, never in favour of speculating.

Guards against estimation noise in the choice (measured on the bundled pair, where the
rate is flat within a few percent over k = 5..8 and a row's acceptance hardly drifts within a
generation, BENCHMARKS.md): of the caps whose estimated rate is within LONGER_TOLERANCE (2%) of the
best, the longest is taken (deep positions' estimates lean low where a_i rises with i: they shrink
towards the shallower position's); and the cap in use is kept while its rate stays within
SWITCH_MARGIN (4%) of the best (changing k on noise loses tokens: E(k) is concave in k, so
alternating k and k' emits fewer than their mean would), except that switching speculation off is
never delayed. Switching it on is: while off (and at the start of a generation) the best K must beat
plain decoding by SWITCH_ON_MARGIN (5%), since on a shared CPU the estimates move by several percent
and switching on costs what E / time leaves out (the drafter's prefill, deferred until then, or its
catch-up over the tokens committed meanwhile). The counts forget slowly for the same reason
(g = 0.95, m = 2: with g = 0.9 the choice followed noise; a total collapse of acceptance is then
followed within a few windows, not a few steps).

Trying a prompt. While the drafter's prefill is deferred (decode.py: a generation that has not
speculated yet), speculation must also save more than that prefill costs (its measured time per
token, ``record_prefill``) over the tokens left, at the rows' estimate (the acceptance pooled over
the drafter's earlier generations, until the rows have their own). This is an expected-value choice:
a prompt whose acceptance turns out low has paid the drafter's prefill and the steps it takes the
counts to see it (measured on the bundled pair: the prefill is 2.5% of a 64-token generation of a
147-token prompt, prefill included; the steps about as much again), which no later step earns back.
So a look (``looking``: the plan's drafts are explorations, or the generation's first LOOK_STEPS
drafting steps, speculation switched on by the prior alone) prefills the draft model with the prompt's
last tokens only (decode.py, ``DrafterPrefill`` and LOOK_WINDOW), and the whole prefill is paid by the
first step that speculates after it, which ``plan``'s ``prefill`` makes repay it. The generation's
first plan that may draft (``opening``) bets on the pooled acceptance: it chooses at that acceptance less
OPENING_DOUBT x the spread of the earlier prompts' acceptance about the pool (a lower bound), so a
workload of like prompts bets as the pool says and one whose prompts differ bets short or waits for a
look (measured on forced AVX2, where a wide pass is dear: a prompt of acceptance 0.4 after ones of 0.9-1.0
bet k = 5-6 and lost 5-6% of its generation to two such steps).

Exploration. A row whose choice is 0 stops producing acceptance data, so its estimate could never
recover after a change of regime (the text becomes repetitive, a new prompt section...). Every
``explore_every`` steps (a plain chain segment counts one step per pass; an exploration falls due at
the first plan at or after its step), every such row drafts ``explore_k`` tokens anyway (all at the
same step: if the batch was off, that is one draft pass for the batch, which also feeds the draft
the tokens committed meanwhile, and one loop step of width explore_k + 1); a row whose exploration
was fully accepted explores again on the next step, so a recovered row gets back to speculation
within a few steps. An episode (an exploration and its follow-ups) that ends with speculation still
off doubles the interval, up to ``EXPLORE_BACKOFF`` x explore_every steps; speculating resets it. No
exploration starts with fewer tokens left than that longest interval (``plan``'s ``remaining``: too
few to use what it would find, and the first one of a generation also pays the drafter's prefill,
which the loop defers until the first draft, decode.py): a short generation whose prior (what earlier
generations measured, or p0) says speculation does not pay never pays for the drafter, while a longer
one explores early and finds a prompt that does (measured: prompts accepting 0.99 left plain when
their generation never explored). The cost is at most one small draft pass per
``explore_every`` steps plus its follow-ups (a follow-up is a step of width explore_k + 1, roughly
break-even where acceptance is high enough to be fully accepted often), falling to one per
EXPLORE_BACKOFF x explore_every while speculation keeps not paying. The costs keep being measured
too: the segments and the steps the loop runs update P, V, D and H as they go (another process on the
cores changes them); V falls back to its probe shifted by the last observed offset at the widths not
run for COST_MEMORY_STEPS steps, D to its probe at the counts not run; while off, the steps' costs
follow P, and while speculating a stale P is measured again where the choice is close (above).

Looks (greedy rows). Where every row is greedy and the loop runs plain chain segments, a drafter that has
``greedy_looks`` (a draft model) can say without any target pass what speculating would have accepted:
fed the generated tokens (teacher-forced, one draft pass whose LM head runs on the last LOOK_TOKENS of
them, decode.py ``DrafterPrefill.greedy_look``), its greedy token after position p is the first draft a
step from p would propose, accepted exactly when it is token p + 1, and a chain from p is accepted up to
the first mismatch. So one look gives, per row, the observations of the drafting steps a loop would have
made over those positions (``observe_look``) instead of an exploration's one. With looks (``start``'s
``looks``): every exploration is a look (the first one right after the generation's first plain segment, later ones on the backed-off
schedule; none with fewer than LOOK_REMAINING x explore_every tokens left), and speculation that is off
after plain segments switches on again only on the plan right after a look (a plan that would switch on
asks for one: ``look_due``, no drafts, then chooses with what it saw). A generation's start still
follows the prior (LOOK_STEPS below): betting there costs high-acceptance prompts nothing, where a look
first would cost them a segment of plain passes. Measured (BENCHMARKS.md, "Greedy looks"): a
verification exploration costs about as much as a look (a step of width 2 against a chained pass, and
the draft's catch-up) but reads one position, and the steps that a switch on made on the strength of one
accepted exploration (or of the pooled prior) were where prompts of acceptance 0.5-0.7 lost.

Losslessness does not depend on any of this: every choice of k per row and step verifies with the
same lossless rule. Two consequences to know: greedy output is unchanged (it is the target's greedy
output), but a SEEDED sample at temperature > 0 depends on the per-step choices (the Philox counters
are per step), which depend on measured times: it is still distributed exactly as the target's, but
not reproducible run to run. Pass a fixed k for reproducible seeded sampling.

Host cost: ``observe`` updates the counts of the rows that drafted (a few numpy operations per
step), ``plan`` recomputes the choice every REPLAN_STEPS calls (one per step or plain segment;
OFF_REPLAN_CALLS while speculation is off, only for a look where looks precede every switch on; or
when the active rows change or an exploration is due)
and repeats its last plan in between; V's fit is redone when its inputs changed, at most every
COST_REFRESH_STEPS steps. Between two model passes a numpy call costs 4-6 us (the pass has evicted
numpy's code and data from the caches), so the per-step arithmetic (acceptance, E(k), the rates, the
knee fit: a few dozen numbers per row) runs on host floats: measured on the bundled pair, forced AVX2,
batch 1, ``plan`` + ``observe`` took 170 us per step in numpy (with V's fit 300 us every 8 steps), 5% of
a 3.4 ms step and k="auto" speculating throughout at 0.95x the same k fixed; 80 us now (fit 130 us),
at parity. H charges what is left to every step. No device
synchronisation (the loop's timers and its read of num_accepted / num_draft are the only ones).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .stats import StepOutcome

DEFAULT_K_MAX = 8  # static buffer width of k="auto" (drafts per row per step, at most)
DEFAULT_PRIOR_ACCEPTANCE = 0.7  # p0: acceptance assumed before a row has data
DEFAULT_PRIOR_STRENGTH = 2.0  # m: pseudo-observations of the prior
DEFAULT_FORGETTING = 0.95  # g: per-step decay of the counts (window ~ 20 drafting steps)
DEFAULT_COST_SMOOTHING = 0.3  # weight of a new time measurement in the moving averages
DEFAULT_PRIOR_DRAFT_COST = 0.1  # c / V(1) assumed until the first draft pass is timed
DEFAULT_EXPLORE_EVERY = 16  # steps between explorations of the rows whose choice is 0
DEFAULT_EXPLORE_K = 1  # one draft token: the cheapest look (a full accept explores again next step)
DEFAULT_PROBE_WIDTHS = (1, 2, 3, 4)  # ... and k_max + 1: V's knee (``knee_curve``) lies near 2-4 rows on the CPUs measured
DEFAULT_PROBE_PASSES = 3  # timed forwards per probed width (the median is kept), after one warm-up
COST_MEMORY_STEPS = 64  # an observed width (verify) or count (draft) older than this is left to the probe
# A time above this many times its moving average counts as this many times it: on a shared CPU a step
# now and then loses a time slice to another process (measured: single steps at 3-6x), which is not
# the cost of the step; a real change still moves the average by up to (SPIKE_CAP - 1) x the
# smoothing weight a step (a doubling is followed within a few steps).
SPIKE_CAP = 2.0
# While speculating, a stale P (older than COST_MEMORY_STEPS, or only probed) is measured again by one
# plain segment whenever the best K's estimated rate is within this fraction above plain decoding's
# (measured: a P left over from a quieter moment, 30% too high, kept k = 8 on at a loss for a prompt
# of acceptance 0.6; a segment costs little where the rates are that close)
REFRESH_BAND = 0.3
OBSERVED_WEIGHT = 4.0  # weight of an observed width's moving average against a probed width's time
# plan() recomputes the budgets (and time(k)) every this many calls (one per step or plain segment) and
# repeats its last plan in between (unless the active rows change or an exploration is due): one step
# moves the estimates by about 1 - g = 5%, and a replan costs about 0.1-0.2 ms of host work between
# model passes
REPLAN_STEPS = 2
# ... and every this many calls while speculation is off and no row explores: the steps' costs then follow
# P (step_times), so the choice changes only with what explorations measure (each forces a replan). Where
# looks precede every switch on (``start``'s ``looks``, after the first plain segment), an off plan is
# repeated until a look is due or seen, or the rows change: between looks nothing that sets the choice
# moves (no acceptance data; the steps' costs follow P), and a replan cost 0.1-0.3 ms of host time between
# model passes, 0.5% of a 96-token generation that never speculated (measured on forced AVX2)
OFF_REPLAN_CALLS = 4
# The padded cap is the longest K whose estimated rate is within this fraction of the best: the rate
# is flat near its optimum, and the estimates of deep positions lean low where a_i rises with i
# (they shrink towards the shallower position's), so of near-equal estimates the longer draft is
# the better bet (module docstring, "Two guards").
LONGER_TOLERANCE = 0.02
# ... and a cap in use is kept while its estimated rate is within this fraction of the best: a change
# of k that estimation noise causes loses tokens (E(k) is concave in k, so alternating k and k' emits
# fewer tokens than their mean would), while a real change of regime moves the rates far more.
SWITCH_MARGIN = 0.04
# Speculation off (a generation starts off) switches on only when the best K's estimated rate beats plain
# decoding's by more than this fraction: on a shared CPU the estimates move by several percent from
# step to step, and switching on costs what E / time leaves out (the drafter's prefill, deferred until
# then, or its catch-up over the tokens committed meanwhile). Switching off is never delayed.
SWITCH_ON_MARGIN = 0.05
# The first passes after the prompt's prefill run slow (measured on forced AVX2 and portable, the bundled
# target, a 133-token prompt: the first two one-token passes 1.6x and 1.4x the later ones, every time; on
# AMX hardly): a step or plain segment that starts among this many passes of a generation is not timed into
# V, D or P. Taken as the decode's cost, the first two steps' 1.7x V(3) switched speculation off for
# prompts where drafting 2 tokens ran at 1.2x plain (BENCHMARKS.md, "V's knee").
COLD_PASSES = 2
COST_REFRESH_STEPS = 8  # plan() refits time(k) to the measurements every this many steps
# A drafter prefill of fewer tokens is not timed into its cost per token: its time is the call's fixed cost (the
# server's draft prefills of joining rows too, serve/draft_length.py ``record_draft_prefill``).
# Measured (the Zen 5, avx512bf16): ``specdec demo``'s 4-token warm-up on "x = 1" prefilled 3 tokens in 2.19 ms,
# 729 us a token against 26 us for a 32-token window; the average then priced the next prompts' 128-token
# prefill at 66 ms, which no 64-token generation repays, and the demo never speculated (0.92-0.98x plain)
MIN_TIMED_PREFILL_TOKENS = 16
# beta, a pass's cost per token of context a row holds (``ContextSlope``): each observation's weight decays
# by this factor per observation of its width (about the last hundred of each: a few generations)
CONTEXT_DECAY = 0.99
# ... estimated only once the observations spread over context (their weighted squared deviations from
# their width's mean, summed over widths) at least as much as this many at +-CONTEXT_SPREAD_TOKENS
CONTEXT_SPREAD_OBS = 8
CONTEXT_SPREAD_TOKENS = 64
MIN_PLAIN_STEP_S = 1e-6  # a fitted V(1) below this is the fit's floor, not a measurement
EXPLORE_BACKOFF = 4  # fruitless explorations stretch the interval up to this many times explore_every
LOOK_REMAINING = 2  # a look (greedy rows) needs this many times explore_every tokens left to use what it finds
# A generation's first steps that draft are a look at its prompt (``looking``: the drafter may run from a
# window of it, decode.py) until this many of them gave the rows their own counts: a speculation switched
# on by the prior alone (earlier generations' acceptance) then pays the whole draft prefill only where the
# prompt's own first drafts bear it out (measured: anchor prompts of acceptance 0.65 after ones of 1.0
# started speculating on the prior, paid the draft's prefill of 290 tokens and lost 10-12% to plain)
LOOK_STEPS = 4
# A generation's first plan that drafts (``opening``: no step, plain segment or look of its own yet) bets on the
# acceptance pooled over earlier prompts; it chooses at that acceptance less this many times how far a
# prompt's acceptance strays from the pool's (``DrafterMemory.spread``): a lower bound, not the mean. A
# workload of like prompts bets as before, one whose prompts differ bets short or not at all. Measured (forced
# AVX2, the anchor's prompts, which alternate between acceptance 0.4-0.6 and 0.98): csv after heapq bet k = 5-6
# on the pooled 0.86, two width-6 steps of 7-8 ms for 3 tokens where plain passes ran at 1.9 ms, 5-6% of its
# 128-token generation; the demo's three prompts (0.74-0.78) kept their bets
OPENING_DOUBT = 1.0
# ... how far a prompt strays from the pool before two generations have measured it (about the spread of the
# bundled pair's prompts, 0.35-1.0)
DEFAULT_PRIOR_SPREAD = 0.2
# Weight of a finished generation's pooled acceptance in the next generations' prior (about the last
# three generations): with the last one's alone, whether a prompt started speculating followed the
# prompt before it (measured: the anchor's prompts alternate between acceptance 0.55 and 1.0).
GENERATION_SMOOTHING = 0.3


# The controller's per-step arithmetic is a few dozen numbers per row. Between two model passes (whose
# weights have evicted numpy's code and data from the caches) a numpy call costs 4-6 us where it costs 1
# warm (measured on the bundled pair: a replan's ~30 numpy calls took 190 us, 6% of a 3 ms step), so the
# helpers below work on host floats; the numpy functions after them are their array forms.
def acceptance_rows(reached: List[List[float]], accepted: List[List[float]], shape: List[float],
                    m: float) -> List[List[float]]:
    """a_i per row from the decayed counts (the module docstring's estimate): a_1 = A_1 / R_1, and a deep
    position with little data shrinks towards the one before it times s_i.

    reached, accepted [B][K]; shape [K] -> [B][K]
    """
    rows = []
    for counts, hits in zip(reached, accepted):
        previous = hits[0] / max(counts[0], 1e-12)
        row = [previous]
        for i in range(1, len(counts)):
            previous = (hits[i] + m * min(shape[i] * previous, 1.0)) / (counts[i] + m)  # (shrunk: s_i a_{i-1})
            row.append(previous)
        rows.append(row)
    return rows


def expected_tokens(acceptance: List[float]) -> List[float]:
    """E(k) for k = 0..K of one row: E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j. acceptance [K] -> [K+1]."""
    out, reach, total = [1.0], 1.0, 0.0
    for a in acceptance:
        reach *= a  # P(position i accepted) = prod_{j<=i} a_j
        total += reach
        out.append(1.0 + total)
    return out


def expected_by_row(reached: np.ndarray, accepted: np.ndarray, shape: np.ndarray, m: float,
                    rows: Sequence[int]) -> List[List[float]]:
    """E(k), k = 0..K, of the rows ``rows`` from the decayed counts reached, accepted [B, K] (host floats):
    [len(rows)][K+1]."""
    counts, hits = reached.tolist(), accepted.tolist()
    estimates = acceptance_rows([counts[b] for b in rows], [hits[b] for b in rows], shape.tolist(), m)
    return [expected_tokens(acceptance) for acceptance in estimates]


def column_sums(rows: Sequence[Sequence[float]], width: int) -> List[float]:
    """The sum of ``rows`` ([n][width] host floats) per column: [width]."""
    sums = [0.0] * width
    for row in rows:
        sums = [total + value for total, value in zip(sums, row)]
    return sums


def best_cap(rates: List[float], tolerance: float = 0.0, current: Optional[int] = None, margin: float = 0.0,
             switch_on: float = 0.0) -> int:
    """The cap K* from the batch's rates [K+1] (tokens per second of drafting K, K = 0: plain decoding):
    ``padded_batch_cap``'s choice and guards."""
    best = max(rates[1:], default=-math.inf)
    if rates[0] * (1.0 + switch_on) >= best:
        return 0  # (never delayed: switching speculation off saves time at once)
    threshold = best * (1.0 - max(tolerance, 1e-12))
    near = [k for k in range(1, len(rates)) if rates[k] >= threshold]
    cap = near[-1] if tolerance > 0 else near[0]
    if (current is not None and 0 < current < len(rates) and rates[current] > rates[0]
            and rates[current] >= best * (1.0 - margin)):
        return int(current)
    return cap


def expected_tokens_table(acceptance: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..K from acceptance by position (``expected_tokens`` per row).

    acceptance [..., K] (a_1..a_K, conditional on reaching the position) -> [..., K+1]
    """
    acceptance = np.asarray(acceptance, dtype=np.float64)
    rows = acceptance.reshape(-1, acceptance.shape[-1]).tolist()
    return np.array([expected_tokens(a) for a in rows], dtype=np.float64).reshape(
        acceptance.shape[:-1] + (acceptance.shape[-1] + 1,))


def acceptance_by_position(reached: np.ndarray, accepted: np.ndarray, shape: np.ndarray, m: float) -> np.ndarray:
    """``acceptance_rows`` on arrays: reached, accepted [B, K]; shape [K] -> [B, K]."""
    rows = acceptance_rows(np.asarray(reached).tolist(), np.asarray(accepted).tolist(), np.asarray(shape).tolist(), m)
    return np.array(rows, dtype=np.float64).reshape(np.shape(reached))


class VerifyCosts:
    """What is known of V(t), the verify step's time over t tokens per row, at one batch size.

    Arrays are indexed by t (index 0 unused): ``probe`` the start-up forward times, ``obs`` the moving
    average of observed verify steps, ``obs_step`` when t was last observed, ``offset`` the moving
    average of observed - probed time (seconds), ``step`` a step counter (for the staleness of ``obs``).

    The plain path's P (seconds per pass of a greedy plain chain segment, the module docstring's
    "Plain decoding"): ``plain_probe`` the start-up probe, ``plain_obs`` the moving average of
    observed segments, ``plain_obs_step`` when last observed, ``step_plain`` P's estimate when a step
    was last observed. ``host``: H, the moving average of the host time between two steps.

    Each time comes with the context it was measured at (``*_context``: mean committed tokens per row;
    NaN: unknown), and ``slope`` estimates beta, what a token of context adds to a pass: the times are
    compared at the context of the step being planned (``AdaptiveK.verify_times``)."""

    def __init__(self, k_max: int):
        self.probe = np.full(k_max + 2, np.nan)
        self.obs = np.full(k_max + 2, np.nan)
        self.obs_step = np.full(k_max + 2, -10 ** 9, dtype=np.int64)
        self.offset = 0.0
        self.step = 0
        self.probe_curve: Optional[np.ndarray] = None  # probe interpolated at every width (cache)
        self.plain_probe = math.nan
        self.plain_obs = math.nan
        self.plain_obs_step = -10 ** 9
        self.host = math.nan
        self.step_plain = math.nan  # P as estimated when a step was last observed
        self.step_plain_context = math.nan  # ... at this context (tokens per row)
        # the context (mean tokens per row) each time was measured at, averaged as the time is
        self.probe_context = math.nan
        self.obs_context = np.full(k_max + 2, np.nan)
        self.plain_probe_context = math.nan
        self.plain_obs_context = math.nan
        self.slope = ContextSlope(k_max + 2)  # beta (group 0: the plain chain passes, t: verify width t)
        self.fit: Optional[np.ndarray] = None  # V(t) as last fitted (read-only), and what it was fitted to
        self.fit_inputs: Optional[tuple] = None


class ContextSlope:
    """beta: seconds a target pass gains per token of context a row holds, by weighted least squares of
    time on context within each group of like passes (the plain chain passes; the verify passes of one
    width), one slope shared by the groups: a pass reads each cached key and value once whatever its
    rows, so the context adds about the same to a pass of any small width. Measured on the bundled
    target, one thread, plain chain passes from 32 to 1024 tokens of context: 0.33 us a token on the
    avx512bf16 path (1.22 -> 1.55 ms), 0.7 us on forced AVX2 (1.47 -> 2.17 ms): the prompts of one
    benchmark, 150 and 460 tokens long, differ by 8-13% of a pass, which carried from one generation's
    measurements to the next one's choice. Each observation's weight decays by CONTEXT_DECAY per
    observation of its group; 0 until the observations spread over context (CONTEXT_SPREAD_OBS at
    +-CONTEXT_SPREAD_TOKENS), never negative. Host floats (a few per observation)."""

    def __init__(self, groups: int):
        self.sums = [[0.0] * 5 for _ in range(groups)]  # per group: decayed sums of 1, x, x^2, y, x y
        self._beta: Optional[float] = 0.0  # (None: to be recomputed)

    def add(self, group: int, context: float, seconds: float) -> None:
        self._beta = None
        s, d = self.sums[group], CONTEXT_DECAY
        s[0] = d * s[0] + 1.0
        s[1] = d * s[1] + context
        s[2] = d * s[2] + context * context
        s[3] = d * s[3] + seconds
        s[4] = d * s[4] + context * seconds

    def beta(self) -> float:
        if self._beta is None:
            sxx = sxy = 0.0
            for w, wx, wxx, wy, wxy in self.sums:
                if w > 0.0:
                    sxx += wxx - wx * wx / w
                    sxy += wxy - wx * wy / w
            enough = sxx >= CONTEXT_SPREAD_OBS * CONTEXT_SPREAD_TOKENS ** 2
            self._beta = max(sxy / sxx, 0.0) if enough else 0.0
        return self._beta


def shifted(seconds: float, measured_at: float, context: Optional[float], beta: float) -> float:
    """A time measured at context ``measured_at`` as it would be at ``context`` (either unknown, None or NaN:
    as it is)."""
    if context is None or math.isnan(context) or math.isnan(measured_at) or beta == 0.0:
        return seconds
    return seconds + beta * (context - measured_at)


class DrafterMemory:
    """What a finished generation leaves for the next one with the same target, drafter and batch
    size: the draft costs (per token, per drafted count, its prefill's per token) and the acceptance by
    position pooled over its rows (the next rows' prior, with strength m: an empirical-Bayes prior
    instead of p0)."""

    def __init__(self):
        self.draft_per_token: Optional[float] = None
        self.draft_obs: Optional[np.ndarray] = None  # [k_max+1] draft time per drafted count
        self.draft_obs_step: Optional[np.ndarray] = None  # [k_max+1] when each was last observed
        self.prefill_per_token: Optional[float] = None  # seconds per token of its prefill
        self.draft_probe: Optional[np.ndarray] = None  # [k_max+1] probed draft time per drafted count
        self.draft_probe_offset = 0.0  # seconds: moving average of a loop's draft step - the probe at its count
        self.acceptance: Optional[np.ndarray] = None  # [k_max]
        # moving average (GENERATION_SMOOTHING) of (a generation's position-1 acceptance - the pool's before it)^2
        self.spread: Optional[float] = None


# State shared by the controllers of one target model (weakly keyed): VerifyCosts per (batch size,
# k_max), so that the start-up probe runs once per process and later generations start from (and
# keep refining) what earlier ones measured; DrafterMemory per (batch size, k_max, drafter).
_SHARED: "weakref.WeakKeyDictionary[object, Dict[tuple, object]]" = weakref.WeakKeyDictionary()


_WATCHED_DRAFT_MODELS: "weakref.WeakSet[object]" = weakref.WeakSet()  # (their memories go when they do)


def drafter_key(drafter) -> tuple:
    """What identifies a drafter across generations (its model, else its class): the shared memory key. A
    model's memories are dropped when the model is collected (``_forget_draft_model``): else every draft model
    a long-lived target ever drafted with kept an entry, and a new model given a dead one's id took its memory."""
    model = drafter.model
    if model is None:
        return ("drafter", type(drafter).__module__, type(drafter).__qualname__)
    key = ("model", id(model))
    try:
        if model not in _WATCHED_DRAFT_MODELS:
            _WATCHED_DRAFT_MODELS.add(model)
            weakref.finalize(model, _forget_draft_model, key)
    except TypeError:  # not weakly referenceable: kept for the process
        pass
    return key


def _forget_draft_model(key: tuple) -> None:
    """Drop every shared DrafterMemory of the drafter ``key`` (its model was collected)."""
    for table in list(_SHARED.values()):  # (on whichever thread collected the model: snapshots, pop)
        for entry in [entry for entry in list(table) if entry[0] == "drafter" and entry[-1] == key]:
            table.pop(entry, None)


def moving_average(old: float, new: float, weight: float) -> float:
    """The update of a moving average of times (``old`` NaN: none yet), a spike capped at SPIKE_CAP x it."""
    if math.isnan(old):
        return new
    return (1.0 - weight) * old + weight * min(new, SPIKE_CAP * old)


def blend(old: float, new: float, weight: float) -> float:
    """``moving_average`` without the cap (for the contexts a time was measured at)."""
    return new if math.isnan(old) else (1.0 - weight) * old + weight * new


def nonneg_line(x: Sequence[float], y: Sequence[float], w: Sequence[float]):
    """(intercept, slope) of the weighted least-squares line through (x, y) with slope >= 0 (the
    weighted mean and 0 when the free fit descends or x takes a single value). A dozen points at
    most: plain Python is cheaper than numpy here."""
    total = sum(w)
    x_mean = sum(wi * xi for wi, xi in zip(w, x)) / total
    y_mean = sum(wi * yi for wi, yi in zip(w, y)) / total
    spread = sum(wi * (xi - x_mean) ** 2 for wi, xi in zip(w, x))
    if spread <= 0.0:
        return y_mean, 0.0
    slope = sum(wi * (xi - x_mean) * (yi - y_mean) for wi, xi, yi in zip(w, x, y)) / spread
    if slope <= 0.0:
        return y_mean, 0.0
    return y_mean - slope * x_mean, slope


def knee_curve(x: Sequence[float], y: Sequence[float], w: Sequence[float], at: np.ndarray) -> np.ndarray:
    """The weighted least-squares fit through (x, y) among the nondecreasing convex curves with at most
    one knee, evaluated at ``at``: y = p + s (x - x_0) + d max(0, x - h) with s, d >= 0, x_0 the least x
    and the knee h one of the x strictly between the least and the greatest (none: ``nonneg_line``).
    A pass over t rows reads the weights once and computes t rows: flat while memory-bound, then rising
    by the compute per row (measured on forced AVX2: V(1..9) = 2.0, 2.2, 2.6, 3.4, 4.0, 4.6, 5.7, 6.0,
    6.7 ms, where a line through them put V(3) at 3.2); the knee bends the line there and nowhere
    else, a line being one knee-less case. Each knee is fitted by its normal equations (with a knee
    strictly inside, the three columns are independent), a negative slope before it refitted flat, and a
    knee that does not bend is left out. A dozen points at most, fitted between two model passes: host
    floats (``acceptance_rows``: numpy's lstsq took 250 us there). [P] points -> [len(at)]."""
    x0 = min(x)
    first, slope = nonneg_line(x, y, w)
    best = (first + slope * x0, slope, 0.0, x0)  # (p, s, d, h): the line, no bend

    def error(p: float, s: float, d: float, h: float) -> float:
        return sum(wi * (p + s * (xi - x0) + d * max(0.0, xi - h) - yi) ** 2 for xi, yi, wi in zip(x, y, w))

    best_error = error(*best)
    for h in sorted(set(x))[1:-1]:
        # weighted moments of the columns 1, u = x - x_0, v = max(0, x - h) and of y
        s00 = s01 = s02 = s11 = s12 = s22 = t0 = t1 = t2 = 0.0
        for xi, yi, wi in zip(x, y, w):
            u, v = xi - x0, max(0.0, xi - h)
            s00 += wi
            s01 += wi * u
            s02 += wi * v
            s11 += wi * u * u
            s12 += wi * u * v
            s22 += wi * v * v
            t0 += wi * yi
            t1 += wi * u * yi
            t2 += wi * v * yi
        p, s, d = solve3(((s00, s01, s02), (s01, s11, s12), (s02, s12, s22)), (t0, t1, t2))
        if s < 0.0:  # flat, then rising
            det = s00 * s22 - s02 * s02
            p, s, d = (t0 * s22 - s02 * t2) / det, 0.0, (s00 * t2 - s02 * t0) / det
        if d <= 0.0:  # no bend: the line is the better fit of this shape
            continue
        e = error(p, s, d, h)
        if e < best_error:
            best, best_error = (p, s, d, h), e
    p, s, d, h = best
    return np.array([p + s * (t - x0) + d * max(0.0, t - h) for t in np.asarray(at, dtype=np.float64).tolist()])


def solve3(a: Tuple[Tuple[float, float, float], ...], b: Tuple[float, float, float]) -> Tuple[float, float, float]:
    """The solution of the 3 x 3 system a z = b (Cramer's rule; a nonsingular)."""
    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    whole = det(a)
    return tuple(det([[b[r] if c == col else a[r][c] for c in range(3)] for r in range(3)]) / whole
                 for col in range(3))


def padded_batch_cap(expected: np.ndarray, step_time: np.ndarray, active: np.ndarray,
                     tolerance: float = 0.0, current: Optional[int] = None, margin: float = 0.0,
                     switch_on: float = 0.0) -> int:
    """argmax_K sum_{b active} expected[b, K] / step_time[K]: the cap K* when every row drafts all of K
    (a padded pass). 0 (plain decoding) whenever its rate is at least every K >= 1's (ties -> 0), or,
    with ``switch_on`` (speculation is off now), unless the best K >= 1 beats it by more than that
    fraction. Among the K >= 1 that beat it: with ``tolerance`` > 0 the largest K whose rate is within
    that fraction of the best (0: ties -> the smaller K); with ``current`` (the cap in use, >= 1), it is
    kept while its rate is within ``margin`` of the best and still beats plain decoding
    (hysteresis). No guard ever favours speculating over plain decoding."""
    if not active.any():
        return 0
    rates = (expected[active].sum(axis=0) / step_time).tolist()  # [K+1]
    return best_cap(rates, tolerance, current, margin, switch_on)


@dataclass(frozen=True)
class ProbeRequest:
    """The start-up probes a controller asks the loop for (decode.probe_costs)."""

    verify_widths: Tuple[int, ...]  # time target forwards over [B, t] for these t
    draft_counts: Tuple[int, ...]  # time draft steps of s tokens per row for these s
    plain_passes: int = 0  # time greedy plain chains of this many passes (0: none; decode.probe_plain_chain)


@dataclass(frozen=True)
class AdaptiveOptions:
    """The knobs of an ``AdaptiveK`` controller, checked on construction.

    Parameters
    ----------
    prior_acceptance, prior_strength : float
        p0 in [0, 1] and m (finite, > 0) of the acceptance prior.
    forgetting : float
        g in (0, 1]: decay of the acceptance counts per drafting step of a row (1 = never forget).
    cost_smoothing : float
        Weight of a new time measurement in the moving averages of V(t) and c.
    prior_draft_cost : float
        c / V(1) assumed until the first draft pass is timed (finite, >= 0).
    explore_every, explore_k : int
        Every explore_every steps (backing off to EXPLORE_BACKOFF x that while explorations find
        nothing) the rows whose choice is 0 draft explore_k tokens (0 disables; at most k_max).
    probe_widths : sequence of int, optional
        Widths t timed by ``probe`` (default {1, 2, 3, 4, k_max + 1}; those outside [1, k_max + 1] dropped).
    probe_passes : int
        Timed forwards per probed width.
    share_costs : bool
        Share measurements with the other controllers of the same target model and batch size: the
        verify costs (the probe then runs once per process) and, per drafter, the draft cost and the
        pooled acceptance by position, the next generation's prior (default True).
    """

    prior_acceptance: float = DEFAULT_PRIOR_ACCEPTANCE
    prior_strength: float = DEFAULT_PRIOR_STRENGTH
    forgetting: float = DEFAULT_FORGETTING
    cost_smoothing: float = DEFAULT_COST_SMOOTHING
    prior_draft_cost: float = DEFAULT_PRIOR_DRAFT_COST
    explore_every: int = DEFAULT_EXPLORE_EVERY
    explore_k: int = DEFAULT_EXPLORE_K
    probe_widths: Optional[Sequence[int]] = None
    probe_passes: int = DEFAULT_PROBE_PASSES
    share_costs: bool = True

    def __post_init__(self):
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must lie in [0, 1], got {self.prior_acceptance}")
        if not 0.0 < self.prior_strength < math.inf:
            raise ValueError(f"prior_strength must be a finite number > 0, got {self.prior_strength}")
        if not 0.0 <= self.prior_draft_cost < math.inf:
            raise ValueError(f"prior_draft_cost must be a finite number >= 0, got {self.prior_draft_cost}")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must lie in (0, 1], got {self.forgetting}")
        if not 0.0 < self.cost_smoothing <= 1.0:
            raise ValueError(f"cost_smoothing must lie in (0, 1], got {self.cost_smoothing}")
        if self.explore_every < 0 or self.explore_k < 0:
            raise ValueError("explore_every and explore_k must be >= 0")


class AdaptiveK:
    """The adaptive-k controller (see the module docstring for the maths).

    Parameters
    ----------
    k_max : int
        Largest draft length (the static buffers' k).
    options : AdaptiveOptions, optional
        The controller's knobs (default ``AdaptiveOptions()``).
    **knobs
        Fields of ``AdaptiveOptions`` that replace those of ``options``, e.g.
        ``AdaptiveK(8, explore_every=0)``.
    """

    def __init__(self, k_max: int = DEFAULT_K_MAX, *, options: Optional[AdaptiveOptions] = None, **knobs):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
        options = replace(options if options is not None else AdaptiveOptions(), **knobs)
        self.k_max = k_max
        self.prior_acceptance = float(options.prior_acceptance)
        self.prior_strength = float(options.prior_strength)
        self.forgetting = float(options.forgetting)
        self.cost_smoothing = float(options.cost_smoothing)
        self.prior_draft_cost = float(options.prior_draft_cost)
        self.explore_every = int(options.explore_every)
        self.explore_k = min(int(options.explore_k), k_max)
        widths = options.probe_widths if options.probe_widths is not None else DEFAULT_PROBE_WIDTHS + (k_max + 1,)
        self.probe_widths = sorted({int(t) for t in widths if 1 <= int(t) <= k_max + 1})
        self.probe_passes = max(1, int(options.probe_passes))
        self.share_costs = bool(options.share_costs)
        self._memory: Optional[DrafterMemory] = None
        self._cost_batch_size: Optional[int] = None  # the batch size self.costs were measured at (reset)
        self.plain_chain = 0  # passes per greedy plain chain call of the loop (0: it cannot chain; ``start``)
        self.looks = False  # the loop runs looks after plain segments (greedy rows, a drafter that can; ``start``)
        self.reset(1)

    # ------------------------------------------------------------------ state
    def reset(self, batch_size: int) -> None:
        """Forget the rows (a new generation of ``batch_size`` rows); the measured costs are kept when
        the batch size is the same (they depend on it)."""
        B, K = batch_size, self.k_max
        self.batch_size = B
        self.reached = np.zeros((B, K))  # R_i, decayed
        self.accepted = np.zeros((B, K))  # A_i, decayed
        self.reached[:, 0] = self.prior_strength  # the prior: m pseudo-observations of p0 at position 1
        self.accepted[:, 0] = self.prior_strength * self.prior_acceptance
        self.shape = np.ones(K)  # s_i: a deep position without data is s_i x the one before (set_prior)
        self.prior_spread = DEFAULT_PRIOR_SPREAD  # how far a prompt's acceptance strays from the prior's (start)
        self.exploring = np.zeros(B, dtype=bool)  # the row's drafts of this step are an exploration
        self.follow_up = np.zeros(B, dtype=bool)  # the row's last exploration was fully accepted
        self._exploring_any = self.follow_up_any = False  # host flags of the two (plan / observe skip work)
        self._prefix_ones = np.tri(K + 1, K, k=-1)  # [K+1, K]: row j = j ones, then zeros
        self._explore_interval = max(self.explore_every, 1)
        self._next_explore = self._explore_interval - 1  # step index of the next scheduled exploration
        self.step = 0
        self._repeats = 0  # plan() calls since the last replan (it replans every REPLAN_STEPS calls)
        self._last_plan: Optional[List[int]] = None  # plan() repeats it between replans
        self._last_cap: Optional[int] = None  # the padded cap in use (SWITCH_MARGIN)
        self._speculating = False  # the last plan's cap was > 0 (else SWITCH_ON_MARGIN applies)
        self._refreshing = False  # the last plan was a plain segment to measure a stale P (REFRESH_BAND)
        self._drafted_steps = 0  # steps in which some row drafted (acceptance data for the next generations)
        self.look_due = False  # the last plan asks for a look after its plain segment (``observe_look``)
        self._looked = False  # a look was observed since the last plan (a switch on may follow)
        self.looks_observed = 0  # looks this generation
        self._times: Optional[List[float]] = None  # time(k) as of step _times_step (plan() refreshes it)
        self._context: Optional[float] = None  # the last plan's context (tokens per row; None: unknown)
        self._times_step = 0
        self._last_active: tuple = ()
        self._prev_off = False  # the last step did not call the drafter
        self._cold = 0  # target passes still to run before one is timed into the costs (``start``: COLD_PASSES)
        self.history: Dict[int, int] = {}  # chosen batch width K -> steps (for the stats)
        self.row_k_sum = 0  # sum of per-row draft budgets over active row-steps
        self.row_steps = 0
        self.plain_passes = 0  # passes run as plain chain segments (observe_plain)
        if self._cost_batch_size != B:  # costs are measured at one batch size
            self._cost_batch_size = B
            self.costs = VerifyCosts(K)
        self.draft_per_token: Optional[float] = None  # c, seconds (per drafter: measured afresh)
        self.draft_obs = np.full(K + 1, np.nan)  # [s] moving average of the draft time of s-token steps
        self.draft_obs_step = np.full(K + 1, -10 ** 9, dtype=np.int64)  # [s] costs.step when s last observed
        self.prefill_per_token: Optional[float] = None  # seconds per token of the drafter's deferred prefill
        self.draft_probe = np.full(K + 1, np.nan)  # [s] probed draft time of s-token steps (start-up)
        self.draft_probe_offset = 0.0  # moving average of (observed - probed) draft time at the counts run

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> np.ndarray:
        """a_i per row: [B, k_max] (see the module docstring)."""
        return acceptance_by_position(self.reached, self.accepted, self.shape, self.prior_strength)

    def verify_times(self, context: Optional[float] = None) -> np.ndarray:
        """V(t) for t = 1..k_max+1 in seconds: [k_max+1] (index t-1), or all NaN before any measurement;
        ``context``: at this many tokens per row (None: as measured; ``ContextSlope``)."""
        costs = self.costs
        fresh = costs.step - costs.obs_step <= COST_MEMORY_STEPS  # [k_max+2]
        beta = costs.slope.beta() if context is not None else 0.0
        inputs = (costs.probe.tobytes(), costs.obs.tobytes(), fresh.tobytes(), costs.offset, beta,
                  None if beta == 0.0 else round(context))
        if inputs == costs.fit_inputs:  # (while speculation is off nothing here moves: no refit)
            return costs.fit
        probe, obs, at = costs.probe.tolist(), costs.obs.tolist(), costs.obs_context.tolist()
        points = [(t - 1.0, shifted(v + costs.offset, costs.probe_context, context, beta), 1.0)
                  for t, v in enumerate(probe) if not math.isnan(v)]
        points += [(t - 1.0, shifted(v, at[t], context, beta), OBSERVED_WEIGHT)
                   for t, v in enumerate(obs) if not math.isnan(v) and fresh[t]]
        if not points:
            fit = np.full(self.k_max + 1, np.nan)
        else:
            fit = np.maximum(knee_curve(*zip(*points), np.arange(self.k_max + 1, dtype=np.float64)), 1e-9)
        fit.setflags(write=False)
        costs.fit, costs.fit_inputs = fit, inputs
        return fit

    def step_times(self, context: Optional[float] = None) -> np.ndarray:
        """time(k) = V(k+1) + D(k) + H for k = 0..k_max, then time(0) = P where the loop chains plain
        decoding and P is known: [k_max+1] seconds (relative units before any timing); ``context``: at
        this many tokens per row (None: as measured)."""
        verify = self.verify_times(context)
        if np.isnan(verify).any():
            verify = np.ones(self.k_max + 1)  # nothing measured yet: verification assumed free
            return verify + self.draft_times(verify[0])
        costs = self.costs
        times = verify + self.draft_times(verify[0]) + (0.0 if math.isnan(costs.host) else costs.host)
        plain = self.plain_time(context)
        if plain is not None:
            times[0] = plain
            if not self._speculating and not math.isnan(costs.step_plain):
                # off: the steps' costs follow the load P sees (P now at the last step's context)
                times[1:] *= self.plain_time(costs.step_plain_context) / costs.step_plain
        return times

    def plain_step_time(self) -> Optional[float]:
        """V(1): seconds of one plain decode step (a one-token target pass, verification, commit) at this
        batch size, as measured (probed or observed; None before any measurement)."""
        verify = float(self.verify_times()[0])
        return verify if verify > MIN_PLAIN_STEP_S else None  # (NaN: nothing measured; the fit's floor: none)

    def plain_time(self, context: Optional[float] = None) -> Optional[float]:
        """P, seconds per pass of the loop's greedy plain chains: the observed moving average, else the
        probe; None where the loop cannot chain or nothing was measured. ``context``: at this many
        tokens per row (None: as measured)."""
        if not self.plain_chain:
            return None
        costs = self.costs
        beta = costs.slope.beta()
        if not math.isnan(costs.plain_obs):
            return shifted(costs.plain_obs, costs.plain_obs_context, context, beta)
        if math.isnan(costs.plain_probe):
            return None
        return shifted(costs.plain_probe, costs.plain_probe_context, context, beta)

    def _plain_stale(self) -> bool:
        """Whether P was last measured more than COST_MEMORY_STEPS steps ago, or only probed."""
        costs = self.costs
        return bool(self.plain_chain) and (math.isnan(costs.plain_obs)
                                           or costs.step - costs.plain_obs_step > COST_MEMORY_STEPS)

    def draft_times(self, unit: float = 1.0) -> np.ndarray:
        """D(s), the draft time of a step drafting s tokens per row, s = 0..k_max: [k_max+1] seconds.

        The weighted least-squares line d_0 + s c (c >= 0, D(0) = 0) through the start-up probe of
        the drafter (weight 1, shifted by ``draft_probe_offset``) and the moving averages per s the loop
        ran (OBSERVED_WEIGHT); through
        the origin while those span a single s; before any timing s c with c = prior_draft_cost x
        ``unit``."""
        s = np.arange(self.k_max + 1, dtype=np.float64)
        offset = self.draft_probe_offset
        points = [(float(i), v + offset, 1.0) for i, v in enumerate(self.draft_probe.tolist())
                  if i > 0 and not math.isnan(v)]
        now, seen = self.costs.step, self.draft_obs_step.tolist()
        points += [(float(i), v, OBSERVED_WEIGHT) for i, v in enumerate(self.draft_obs.tolist())
                   if i > 0 and not math.isnan(v) and now - seen[i] <= COST_MEMORY_STEPS]
        if not points:
            c = self.draft_per_token if self.draft_per_token is not None else self.prior_draft_cost * unit
            return c * s
        if len({x for x, _, _ in points}) == 1:
            x, _, _ = points[0]
            return s * (sum(w * v for _, v, w in points) / sum(w for _, _, w in points)) / x
        fixed, per_token = nonneg_line(*zip(*points))
        curve = np.maximum(fixed + per_token * s, 0.0)
        curve[0] = 0.0
        return curve

    def _longest_interval(self) -> int:
        return EXPLORE_BACKOFF * max(self.explore_every, 1)

    # ------------------------------------------------------------------ the loop's calls
    def plan(self, active: Sequence[bool], remaining: Optional[int] = None, prefill: int = 0,
             context: Optional[float] = None) -> List[int]:
        """Draft budgets of this step, one per row (0 for finished rows). Host lists only. ``remaining``:
        the most tokens an unfinished row may still emit (None: unbounded); no exploration starts with
        fewer than the longest exploration interval left (too few to use what it would find), and no row
        drafts more than remaining - 1 tokens (a step emits at most its accepted drafts and one more, and
        no row may emit more than ``remaining``: drafts past that are never kept, while the draft and the
        verify pass pay for them). ``prefill``: the tokens the drafter must prefill before it can draft (the
        loop deferred its prefill; 0: it is ready); speculation then switches on only if the time it saves
        over the ``remaining`` passes repays that prefill (``record_prefill``'s measured cost per token).
        ``context``: the active rows' mean committed tokens, where the costs are compared (None: as
        measured, whatever the context; ``ContextSlope``)."""
        self._context = context
        budgets = self._choose(active, remaining, prefill)
        if remaining is not None and max(budgets, default=0) >= remaining:
            budgets = [min(b, max(remaining - 1, 0)) for b in budgets]
        return budgets

    def _choose(self, active: Sequence[bool], remaining: Optional[int], prefill: int) -> List[int]:
        """``plan``'s choice before the cap by ``remaining``."""
        key = tuple(active)
        explore = bool(self.explore_every and (self.explore_k or self.looks)
                       and (remaining is None or remaining >= (LOOK_REMAINING * self.explore_every if self.looks
                                                               else self._longest_interval())))
        if self._last_cap != 0:
            every = REPLAN_STEPS
        elif self.looks and self.plain_passes and not self._speculating:
            every = math.inf  # only a look switches speculation on again: plan after it (or a row change)
        else:
            every = OFF_REPLAN_CALLS
        looked, self._looked, self.look_due = self._looked, False, False
        if (self._last_plan is not None and self._repeats + 1 < every and key == self._last_active
                and not self._exploring_any and not self.follow_up_any and not self._refreshing
                and not looked and not (explore and self.step >= self._next_explore)):
            self._repeats += 1
            return list(self._last_plan)
        live = [b for b, alive in enumerate(active) if alive]
        # [K+1]: sum over the active rows of E_b(K)
        expected = column_sums(expected_by_row(self.reached, self.accepted, self.shape, self.prior_strength, live),
                               self.k_max + 1)
        if self._times is None or self.step >= self._times_step + COST_REFRESH_STEPS:
            # [K+1]: the costs move slowly
            self._times, self._times_step = self.step_times(self._context).tolist(), self.step
        times = self._times
        rates = [e / t for e, t in zip(expected, times)]  # [K+1] tokens per second
        current = self._last_cap if key == self._last_active else None  # (other rows: other rates)
        switch_on = SWITCH_ON_MARGIN if not self._speculating else 0.0
        cap = best_cap(rates, LONGER_TOLERANCE, current, SWITCH_MARGIN, switch_on) if live else 0
        if cap > 0 and self.opening:  # the first bet: at a lower bound of the pooled acceptance
            doubtful = self.accepted.copy()
            doubtful[:, 0] = np.maximum(doubtful[:, 0] - OPENING_DOUBT * self.prior_spread * self.reached[:, 0], 0.0)
            lower = column_sums(expected_by_row(self.reached, doubtful, self.shape, self.prior_strength, live),
                                self.k_max + 1)
            cap = best_cap([e / t for e, t in zip(lower, times)], LONGER_TOLERANCE, None, SWITCH_MARGIN, switch_on)
        if cap > 0 and self.looks and not self._speculating and not looked and self.plain_passes:
            # switching on again over greedy rows waits for a look at the tokens just generated (one
            # plain segment, then the drafter's greedy agreement with them)
            if remaining is None or remaining > self.plain_chain:
                return self._look_plan(key)
            cap = 0
        self._refreshing = cap > 0 and self._plain_stale() and max(rates[1:]) < (1.0 + REFRESH_BAND) * rates[0]
        if self._refreshing:  # one plain segment measures P again; the choice is made after it
            return self._segment_plan(key)
        if cap > 0 and prefill > 0 and remaining is not None and not self._repays(
                expected[cap] / len(live), times, cap, remaining, prefill):
            cap = 0
        self._last_cap, self._speculating = cap, cap > 0
        plan = [cap if alive else 0 for alive in active]
        if self._exploring_any:
            self.exploring[:] = False
        due: List[int] = []
        if cap > 0:  # speculating: the explorations of a later switch-off start at the shortest interval
            self._explore_interval = max(self.explore_every, 1)
            self._next_explore = self.step + self._explore_interval
        elif explore and self.looks:
            if self.step >= self._next_explore:
                return self._look_plan(key)
        elif explore:
            scheduled = self.step >= self._next_explore  # all rows at once: one draft pass
            due = [b for b in live if scheduled or self.follow_up[b]]
            if scheduled and not due:
                self._next_explore = self.step + self._explore_interval  # nobody to explore: no backoff
            for b in due:
                plan[b] = self.explore_k
            self.exploring[due] = True
        self._exploring_any = bool(due)
        self._last_plan, self._last_active, self._repeats = plan, key, 0
        return list(plan)

    def _segment_plan(self, key: tuple) -> List[int]:
        """A plan of no drafts for the rows ``key`` (a plain segment), the choice left to the plan after it."""
        plan = [0] * len(key)
        self._last_plan, self._last_active, self._repeats, self._last_cap = plan, key, 0, 0
        self.exploring[:] = False
        self._exploring_any = False
        return plan

    def _look_plan(self, key: tuple) -> List[int]:
        """A plain segment followed by a look (``look_due``; ``observe_look``)."""
        self._speculating = self._refreshing = False
        self.look_due = True
        return self._segment_plan(key)

    def _repays(self, tokens: float, times: List[float], cap: int, remaining: int, prefill: int) -> bool:
        """Whether drafting ``cap`` saves, over the ``remaining`` passes plain decoding would make, more
        than the drafter's prefill of ``prefill`` tokens costs (unmeasured: nothing), at ``tokens``, the
        rows' mean E(cap)."""
        saved = remaining * (times[0] - times[cap] / tokens)  # plain passes' time - the same tokens' speculating
        return saved > prefill * (self.prefill_per_token or 0.0)

    def record_prefill(self, seconds: float, tokens: int) -> None:
        """The drafter's deferred prefill took ``seconds`` for ``tokens`` tokens (``plan``'s ``prefill``); one
        of fewer than MIN_TIMED_PREFILL_TOKENS is not timed (its time is the call's fixed cost)."""
        if tokens >= MIN_TIMED_PREFILL_TOKENS and seconds > 0:
            previous = math.nan if self.prefill_per_token is None else self.prefill_per_token
            self.prefill_per_token = moving_average(previous, seconds / tokens, self.cost_smoothing)

    def observe(self, budget: Sequence[int], outcome: StepOutcome, *, draft_time: float, verify_time: float,
                drafted: int, width: int, host_time: float = 0.0, context: Optional[float] = None) -> None:
        """One step's outcome: the budgets ``plan`` gave, the drafted and accepted counts of the active
        rows (``outcome``), the step's draft and verify times (seconds), the drafts per row the drafter
        ran (0 when it was not called), the verify width (tokens per row), the host time between
        the previous step or segment and this step's draft (seconds; 0: not measured) and the active
        rows' mean committed tokens when the step started (None: unknown)."""
        self.step += 1
        costs = self.costs
        costs.step += 1
        w = self.cost_smoothing
        if host_time > 0:
            costs.host = moving_average(costs.host, host_time, w)
        plain = self.plain_time(context)
        if plain is not None:
            costs.step_plain = plain  # (while off, the steps' costs follow P's moves from here)
            costs.step_plain_context = math.nan if context is None else context
        self.history[width - 1] = self.history.get(width - 1, 0) + 1
        # costs
        caught_up = self._prev_off  # this draft pass also fed the tokens of the skipped steps: not timed
        self._prev_off = drafted == 0
        cold, self._cold = self._cold > 0, max(self._cold - 1, 0)  # (COLD_PASSES: not the decode's costs)
        if drafted > 0 and draft_time > 0 and not caught_up and not cold:
            previous = math.nan if self.draft_per_token is None else self.draft_per_token
            self.draft_per_token = moving_average(previous, draft_time / drafted, w)
            if drafted <= self.k_max:
                old = float(self.draft_obs[drafted])
                if costs.step - self.draft_obs_step[drafted] > COST_MEMORY_STEPS:
                    old = math.nan  # a stale average is left to the probe, not updated
                self.draft_obs[drafted] = moving_average(old, draft_time, w)
                self.draft_obs_step[drafted] = costs.step
                probe = self._draft_probe_at(drafted)
                if probe is not None:  # (capped as the average was: a spike is not the step's cost)
                    timed = draft_time if math.isnan(old) else min(draft_time, SPIKE_CAP * old)
                    self.draft_probe_offset = (1 - w) * self.draft_probe_offset + w * (timed - probe)
        if 1 <= width <= self.k_max + 1 and verify_time > 0 and not cold:
            old = float(costs.obs[width]) if costs.step - costs.obs_step[width] <= COST_MEMORY_STEPS else math.nan
            if not math.isnan(old):
                verify_time = min(verify_time, SPIKE_CAP * old)
            costs.obs[width] = moving_average(old, verify_time, w)
            costs.obs_step[width] = costs.step
            if context is not None:
                at = float(costs.obs_context[width]) if not math.isnan(old) else math.nan
                costs.obs_context[width] = blend(at, context, w)
                costs.slope.add(width, context, verify_time)
            probe = self._probe_at(width)
            if probe is not None:  # (the step's time moved to the probe's context: the offset is the load's)
                at_probe = shifted(verify_time, math.nan if context is None else context, costs.probe_context,
                                   costs.slope.beta())
                costs.offset = (1 - w) * costs.offset + w * (at_probe - probe)
        self.row_k_sum += sum(budget[b] for b in outcome.rows)
        self.row_steps += len(outcome.rows)
        live = [i for i, d in enumerate(outcome.drafted) if d > 0]  # indices into the outcome's rows
        if not live and not self._exploring_any:  # nothing drafted: no acceptance data
            return
        # acceptance by position: a row that drafted d and accepted n reached positions 1..min(n+1, d)
        # and accepted 1..n; every position of such a row decays, reached or not (see above)
        if len(live) == len(outcome.rows):
            rows, reached, accepted = outcome.rows, outcome.reached, outcome.accepted
        else:
            rows = [outcome.rows[i] for i in live]
            reached, accepted = [outcome.reached[i] for i in live], [outcome.accepted[i] for i in live]
        if live:
            self._drafted_steps += 1
            g, prefix = self.forgetting, self._prefix_ones  # prefix[j] = j ones, then zeros
            if len(rows) == self.batch_size:  # every row (in order): in place, no gather
                self.reached *= g
                self.reached += prefix[reached]
                self.accepted *= g
                self.accepted += prefix[accepted]
            else:
                self.reached[rows] = g * self.reached[rows] + prefix[reached]
                self.accepted[rows] = g * self.accepted[rows] + prefix[accepted]
        if self._exploring_any:
            # a fully accepted exploration explores again next step; an episode that ends (nothing
            # fully accepted) with speculation still off doubles the interval
            full = [outcome.rows[i] for i in live
                    if self.exploring[outcome.rows[i]] and outcome.accepted[i] >= outcome.drafted[i]]
            self.follow_up[:] = False
            self.follow_up[full] = True
            if not full:
                self._explore_interval = min(2 * self._explore_interval, self._longest_interval())
                self._next_explore = self.step - 1 + self._explore_interval
            self.follow_up_any = bool(full)
        elif self.follow_up_any:
            self.follow_up[:] = False
            self.follow_up_any = False

    def observe_plain(self, passes: int, seconds: float, active: Sequence[bool],
                      context: Optional[float] = None, counted: Optional[int] = None) -> None:
        """A plain chain segment the loop ran because ``plan`` gave every row 0: ``passes`` one-token
        passes of the batch in ``seconds`` (the host time since the previous step or segment
        included), ``active`` the rows that were unfinished at its start, ``context`` their mean committed
        tokens halfway through it (None: unknown). Counts ``passes`` steps (the exploration schedule, the
        staleness of the costs) and updates P where the segment ran a whole chain (``plain_chain``
        passes: see the module docstring); no acceptance data. ``counted``: the passes the stats count as steps
        (those before every row had finished; default all), which the summary's step counts follow."""
        if passes <= 0:
            return
        self.step += passes
        costs = self.costs
        costs.step += passes
        w = self.cost_smoothing
        per_pass = seconds / passes
        cold, self._cold = self._cold > 0, max(self._cold - passes, 0)  # (COLD_PASSES)
        if per_pass > 0 and not cold and passes >= self.plain_chain:
            if context is None:
                costs.plain_obs_context = math.nan
            else:
                at = costs.plain_obs_context if not math.isnan(costs.plain_obs) else math.nan
                costs.plain_obs_context = blend(at, context, w)
                costs.slope.add(0, context, per_pass)
            costs.plain_obs = moving_average(costs.plain_obs, per_pass, w)
            costs.plain_obs_step = costs.step
        self._prev_off = True  # the next draft pass also feeds the segment's tokens: not timed
        self.history[0] = self.history.get(0, 0) + (passes if counted is None else counted)
        self.plain_passes += passes
        self.row_steps += passes * sum(1 for a in active if a)
        if self.follow_up_any:
            self.follow_up[:] = False
            self.follow_up_any = False

    def observe_look(self, matches: Sequence[Sequence[bool]], active: Sequence[bool]) -> None:
        """A look the last plan asked for (``look_due``), after its plain segment: ``matches[b]`` says, for
        row b's last generated positions oldest first, whether a first draft from there equals the
        committed token (greedy verification would accept it); ``active`` the rows the plan covered.

        A chain of drafts from position j is accepted up to the first mismatch: the run r of matches from j
        accepts positions 1..r and reaches 1..r+1, or, where the run reaches the look's end (n - j positions
        seen), reaches and accepts 1..n-j (what lies beyond is unseen). The look replays the steps a loop
        drafting k_max would have made over the n positions (a step from j, the next from j + accepted + 1),
        from each starting phase p = 0..k_max (later phases repeat these), a phase that sees n - p positions
        weighing n / ((n - p) x phases): about as many observations as the loop's steps over those positions.
        Counting a chain from every position instead weighed each agreeing stretch once per position inside
        it where a loop crosses it in a step or two: the first drafts read accepted as often as positions
        match, and deep positions reached from every start within the stretch (csv's looks read 0.8-0.85 at
        positions 2-4 where its steps accepted about half; BENCHMARKS.md, "The look's chains"). Each
        observation decays the counts by its weight (a step's: 1). The next plan chooses with them
        (``_looked``), and the next scheduled look is an interval later, doubled up to EXPLORE_BACKOFF x
        explore_every until speculation switches on."""
        self.look_due = False
        self._looked = True
        self.looks_observed += 1
        self._explore_interval = min(2 * self._explore_interval, self._longest_interval())
        self._next_explore = self.step + self._explore_interval
        g, prefix, K = self.forgetting, self._prefix_ones, self.k_max
        for b, seen in enumerate(matches):
            if b >= len(active) or not active[b] or not seen:
                continue
            n = len(seen)
            run = [0] * (n + 1)  # run[j]: consecutive matches from j
            for j in range(n - 1, -1, -1):
                run[j] = run[j + 1] + 1 if seen[j] else 0
            phases = min(K + 1, n)  # (a step moves at most K + 1 positions: later phases repeat these)
            for phase in range(phases):
                weight = n / ((n - phase) * phases)  # (a phase sees n - phase positions: as many steps per position)
                decay = g ** weight
                j = phase
                while j < n:
                    accepted = min(run[j], K)
                    reached = accepted if run[j] >= n - j else min(accepted + 1, K)
                    self.reached[b] = decay * self.reached[b] + weight * prefix[reached]
                    self.accepted[b] = decay * self.accepted[b] + weight * prefix[accepted]
                    j += accepted + 1

    def _probe_at(self, width: int) -> Optional[float]:
        """The probe's forward time at ``width``, interpolated between the probed widths (cached)."""
        costs = self.costs
        if costs.probe_curve is None:
            probed = np.nonzero(~np.isnan(costs.probe))[0]
            if len(probed) == 0:
                return None
            costs.probe_curve = np.interp(np.arange(self.k_max + 2), probed, costs.probe[probed])
        return float(costs.probe_curve[width])

    def _draft_probe_at(self, count: int) -> Optional[float]:
        """The drafter's probe at ``count`` drafted tokens, interpolated between the probed counts (None
        without a probe)."""
        probe = self.draft_probe.tolist()
        probed = [i for i in range(1, len(probe)) if not math.isnan(probe[i])]
        if not probed:
            return None
        below = max((i for i in probed if i <= count), default=probed[0])
        above = min((i for i in probed if i >= count), default=probed[-1])
        if below == above:
            return probe[below]
        return probe[below] + (probe[above] - probe[below]) * (count - below) / (above - below)

    # ------------------------------------------------------------------ start, probe, finish
    def start(self, batch_size: int, target_key, drafter_key, *, probe: bool = True,
              plain_chain: int = 0, looks: bool = False) -> "ProbeRequest":
        """The loop's call after prefill: forget the rows (``reset``) and pick up what earlier
        generations with this target (``target_key``: the target model) / drafter / batch size
        measured. ``plain_chain``: the passes per call of the loop's greedy plain chains where it can
        run them when no row drafts (0: it cannot; time(0) is then its one-token step). ``looks``: the
        loop can follow such a chain by a look (``observe_look``), which then stands in for every
        exploration and precedes every switch on. Returns the
        start-up probes still needed (none when they were shared, or with ``probe`` False); the loop
        runs them and hands the times to ``record_probes``."""
        self.reset(batch_size)
        self._cold = COLD_PASSES  # (the loop starts after the prompts' prefill)
        self.plain_chain = max(int(plain_chain), 0)
        self.looks = bool(looks) and self.plain_chain > 0
        if self.looks:  # the first look follows the first plain segment
            self._next_explore = self.plain_chain
        self._memory = None
        table = None
        if self.share_costs and target_key is not None:
            try:
                table = _SHARED.setdefault(target_key, {})
            except TypeError:  # not weakly referenceable: nothing shared
                table = None
        counts = tuple(sorted({t - 1 for t in self.probe_widths if t >= 2}))
        if table is None:
            return ProbeRequest(tuple(self.probe_widths), counts, self.plain_chain) if probe else ProbeRequest((), ())
        costs = table.setdefault(("costs", batch_size, self.k_max), self.costs)
        self.costs = costs
        # (not whether this controller made the table: one made by a generation that finished at its prefill,
        # probe False, holds no probe, and every later one then ran on unmeasured verify costs)
        unprobed = bool(np.isnan(costs.probe).all())
        plain = self.plain_chain if math.isnan(costs.plain_probe) else 0  # (an earlier one may not have chained)
        self._memory = table.setdefault(("drafter", batch_size, self.k_max, drafter_key), DrafterMemory())
        if self._memory.draft_per_token is not None:
            self.draft_per_token = self._memory.draft_per_token
            self.draft_obs = self._memory.draft_obs.copy()
            self.draft_obs_step = self._memory.draft_obs_step.copy()
        if self._memory.prefill_per_token is not None:
            self.prefill_per_token = self._memory.prefill_per_token
        if self._memory.acceptance is not None:
            self.set_prior(self._memory.acceptance)
        if self._memory.spread is not None:
            self.prior_spread = math.sqrt(self._memory.spread)
        if self._memory.draft_probe is not None:
            self.draft_probe = self._memory.draft_probe.copy()
            self.draft_probe_offset = self._memory.draft_probe_offset
        if not probe:
            return ProbeRequest((), ())
        return ProbeRequest(tuple(self.probe_widths) if unprobed else (),
                            counts if self._memory.draft_probe is None else (), plain)

    def record_probes(self, verify_times: Dict[int, float], draft_times: Dict[int, float],
                      plain_time: Optional[float] = None, context: Optional[float] = None) -> None:
        """The start-up probes' medians: {width t: seconds} of target forwards over [B, t], {count s:
        seconds} of draft steps of s tokens per row (empty where not probed) and the seconds per pass
        of greedy plain chains (None where not probed), at ``context`` tokens per row (None: unknown)."""
        at = math.nan if context is None else float(context)
        if plain_time is not None:
            self.costs.plain_probe = float(plain_time)
            self.costs.plain_probe_context = at
        for t, seconds in verify_times.items():
            self.costs.probe[t] = seconds
        if verify_times:
            self.costs.probe_curve = None
            self.costs.probe_context = at
        for count, seconds in draft_times.items():
            self.draft_probe[count] = seconds
        if self._memory is not None and self._memory.draft_probe is None and draft_times:
            self._memory.draft_probe = self.draft_probe.copy()

    def set_prior(self, acceptance: Sequence[float]) -> None:
        """Every row's prior from ``acceptance`` [k_max]: m pseudo-observations of a_1 at position 1 and
        the shape s_i = a_i / a_{i-1} (the estimate is ``acceptance`` until the rows have data)."""
        a = np.clip(np.asarray(acceptance, dtype=np.float64), 0.0, 1.0)
        m = self.prior_strength
        self.reached[:] = 0.0
        self.accepted[:] = 0.0
        self.reached[:, 0] = m
        self.accepted[:, 0] = m * a[0]
        self.shape = np.ones(self.k_max)
        self.shape[1:] = np.where(a[:-1] > 0, a[1:] / np.maximum(a[:-1], 1e-12), 1.0)

    @property
    def opening(self) -> bool:
        """Whether the next plan is the generation's first that may draft: no drafting step, plain segment
        or look of its own yet, the counts the prior's alone (it bets on the pooled acceptance:
        ``OPENING_DOUBT``)."""
        return (not self._drafted_steps and not self.plain_passes and not self.looks_observed
                and float(self.reached[:, 0].max(initial=0.0)) <= self.prior_strength)  # (the counts: the prior's)

    @property
    def looking(self) -> bool:
        """Whether the last plan's drafts are a look at the prompt: explorations (speculation is off), or
        among the generation's first LOOK_STEPS steps that drafted."""
        return not self._speculating or self._drafted_steps < LOOK_STEPS

    def finish(self) -> Dict[str, object]:
        """The loop's call at the end: leave the draft costs (per token, per count, the prefill's) and the
        pooled acceptance for the next generation (``share_costs``) and return ``summary()``."""
        if self._memory is not None and self.row_steps:
            self._memory.draft_per_token = self.draft_per_token
            self._memory.draft_obs = self.draft_obs.copy()
            self._memory.draft_obs_step = self.draft_obs_step.copy()
            self._memory.draft_probe_offset = self.draft_probe_offset
            # a generation that drafted nothing has no news: the prior relaxes towards p0 (so that a
            # workload that switched speculation off for every prompt comes to try it again)
            pooled = (self.acceptance().mean(axis=0) if self._drafted_steps or self.looks_observed
                      else np.full(self.k_max, self.prior_acceptance))
            old = self._memory.acceptance
            if old is not None and (self._drafted_steps or self.looks_observed):
                stray = float(pooled[0] - old[0]) ** 2
                spread = self._memory.spread
                self._memory.spread = stray if spread is None else (
                    (1 - GENERATION_SMOOTHING) * spread + GENERATION_SMOOTHING * stray)
            self._memory.acceptance = pooled if old is None else (
                (1 - GENERATION_SMOOTHING) * old + GENERATION_SMOOTHING * pooled)
        if self._memory is not None and self.prefill_per_token is not None:
            self._memory.prefill_per_token = self.prefill_per_token
        return self.summary()

    # ------------------------------------------------------------------ reporting
    def summary(self) -> Dict[str, object]:
        """What the controller measured and chose (for GenerationStats.adaptive)."""
        verify = self.verify_times()
        return {
            "k_max": self.k_max,
            "steps_by_width": {k + 1: n for k, n in sorted(self.history.items())},
            "mean_row_k": self.row_k_sum / self.row_steps if self.row_steps else float("nan"),
            "speculation_off_steps": self.history.get(0, 0),
            "verify_time_by_width_s": None if np.isnan(verify).any() else [float(v) for v in verify],
            "draft_time_per_token_s": self.draft_per_token,
            "host_time_per_step_s": None if math.isnan(self.costs.host) else self.costs.host,
            "plain_time_per_pass_s": self.plain_time(),
            "plain_chain_passes": self.plain_passes,
            "looks": self.looks_observed,
            "acceptance_by_position": [float(a) for a in self.acceptance().mean(axis=0)],
        }


def resolve(k, default_k_max: int = DEFAULT_K_MAX):
    """generate()'s ``k`` -> (static k, controller or None): "auto" -> (k_max, AdaptiveK(k_max)),
    an AdaptiveK -> (its k_max, it), an int >= 1 -> (k, None)."""
    if isinstance(k, str):
        if k != "auto":
            raise ValueError(f"k (draft tokens per step) must be an int >= 1, 'auto' or an AdaptiveK, got {k!r}")
        return default_k_max, AdaptiveK(default_k_max)
    if isinstance(k, AdaptiveK):
        return k.k_max, k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per step) must be an int >= 1, 'auto' or an AdaptiveK, got {k!r}")
    return k, None
