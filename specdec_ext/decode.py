"""The speculative decode loop, readable in one sitting.

    prefill   target.start(prompts) -> logits at each prompt's last position [B, V]; the first new
              token is sampled from them; the drafter prefills its own state
    repeat    budget  adaptive k (host): drafts per row this step, or None (the static width)
              step    step.Stepper.step: draft -> verify -> read -> commit -> stats -> stops (step.py)
              observe adaptive k learns the step's costs and acceptance

B rows, n draft slots, V vocabulary, S cache positions. The *pending* token of a row is its last emitted
token: committed to the token buffer but not yet to the target cache (the next verify pass feeds it
first, so its logits score draft 1). A step with no drafts (no drafter, or adaptive k switched
speculation off) verifies ``meta.no_drafts``: a one-token pass, i.e. plain decoding; where every row
is greedy on a target runner with the greedy-chain capability (``LoopConfig.greedy_chains``, from the
plan), plain decoding runs as greedy chains instead (``plain_chains`` without a drafter,
``plain_segment`` when adaptive k switched speculation off for every row). Every per-step tensor is
allocated once (metadata.py); with CUDA graphs the draft, verify and commit parts are captured
(step.DecodeSteps) and replayed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from .adaptive import AdaptiveK, drafter_key
from .distributed import RankSync, rank_sync
from .drafters import Drafter
from .metadata import SpecDecodeMetadata, Verdict
from .plan import DecodePlan
from .processing import Processing, ProcessingState
from .probes import probe_costs, probe_plain_chain, recent_target_step
from .profiling import nvtx_range
from .runners import ModelRunner
from .sampling import SamplingParams
from .stats import GenerationStats, StepOutcome, Timer
from .step import StepOptions, Stepper, Verifier, append_tokens, emit, lossless_verify, read_logprobs, sample_plain
from .stops import RowState, StopCriteria, apply_stops

FIRST_DECODE_STEP = 1  # Philox step 0 samples the first token from the prefill logits
# Greedy plain decoding on a runner that chains (the CPU kernels): one-token passes per greedy_chain
# call, the stops checked between calls; the passes past a row's stop are wasted, at most this many - 1.
PLAIN_CHAIN_TOKENS = 8
# Adaptive k's first look at a prompt (an exploration before the drafter was prefilled) prefills the draft
# model with this many of the prompt's last tokens only (``DrafterPrefill``): on prompts that do not pay,
# the look is what k="auto" loses to plain decoding, and the draft's prefill was most of it
LOOK_WINDOW = 32
# ... and adaptive k's look over greedy rows (``DrafterPrefill.greedy_look``) reads the draft's agreement
# with at most this many of the last generated tokens (the draft's LM head runs on each of them)
LOOK_TOKENS = 16


@dataclass(frozen=True)
class LoopConfig:
    """What ``decode`` runs: the plan's choices for the loop (``LoopConfig.of(plan)``; tests build one)."""

    slots: int  # n: draft slots per step (adaptive: k_max; a tree: its nodes; 0: plain decoding)
    sampling: SamplingParams
    max_seq_len: int  # S: token-buffer positions per row
    adaptive: Optional[AdaptiveK] = None  # adaptive k's controller (a chain drafter only)
    greedy_chains: bool = False  # the target runner's greedy_chain capability (plan.target_capabilities)
    cost_probe: bool = True  # time a few plain target passes after prefill for the cost-model stats
    sync: Optional[RankSync] = None  # a tensor-parallel target: every rank takes rank 0's decisions
    step: StepOptions = field(default_factory=StepOptions)  # the verifier, CUDA graphs
    processing: Optional[Processing] = None  # logits processors of every row (processing.py); None: none
    top_logprobs: Optional[int] = None  # logprobs of the emitted tokens with this many top tokens; None: off
    grammar_of: Optional[Callable[[int], object]] = None  # row -> its grammar matcher (processing.grammar)

    @classmethod
    def of(cls, plan: DecodePlan, *, verifier: Verifier = lossless_verify, cost_probe: bool = True,
           grammar_of: Optional[Callable[[int], object]] = None) -> "LoopConfig":
        # the token buffer holds the last emitted token too, which no pass feeds (plan.loop_cache_len)
        return cls(slots=plan.slots, sampling=plan.sampling, max_seq_len=plan.max_seq_len + 1,
                   adaptive=plan.controller, greedy_chains=plan.target_capabilities.greedy_chain,
                   cost_probe=cost_probe, sync=rank_sync(plan.tensor_parallel, plan.tp_check),
                   step=StepOptions(verifier=verifier, graphs=plan.cuda_graphs),
                   processing=plan.processing, top_logprobs=plan.top_logprobs, grammar_of=grammar_of)

    @property
    def every_token_sampled(self) -> bool:
        """Whether each token goes through the verifier's sampling (no greedy chains): processors change
        the logits and logprobs read them, which a chain of argmaxes in the kernels does not."""
        return (self.processing is not None and self.processing.active) or self.top_logprobs is not None


# ------------------------------------------------------------------------------------------ prefill
def prefill(target: ModelRunner, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]],
            meta: SpecDecodeMetadata, sync: Optional[RankSync] = None) -> None:
    """Fill both caches with the prompts and sample the first new token (the first pending token).
    ``sync``: every rank takes rank 0's prompts and first tokens."""
    B = len(prompts)
    with nvtx_range("prefill"):
        logits = target.start(prompts)  # [B, V]
        meta.set_prompts(range(B), prompts)
        meta.set_step(0)
        first = torch.empty((B, 1), dtype=torch.int64, device=logits.device)  # [B, 1]
        status = torch.empty((B,), dtype=torch.int32, device=logits.device)  # [B]
        sample_plain(logits.unsqueeze(1).contiguous(), meta, first, status, check=True)
        every = torch.arange(B, device=meta.device)  # [B]
        meta.set_first_tokens(every, first[:, 0])
        if sync is not None:
            sync.tokens(meta.token_buffer)
            meta.set_first_tokens(every, meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0])
        if drafter is not None:
            drafter.prefill(prompts, meta)


def join_rows(rows: Sequence[int], prompts: Sequence[Sequence[int]], logits: torch.Tensor,
              meta: SpecDecodeMetadata) -> Tuple[List[int], List[int], List[Optional[list]]]:
    """Continuous batching: what ``prefill`` does for a whole batch, for rows (slots) whose prompts are
    now in the target's cache (``start_rows``, or chunk by chunk with ``extend_rows``: serve/batcher.py)
    while the other rows keep theirs: ``logits`` [n, V] at each prompt's last token. ``meta`` covers
    every slot and already holds the joining rows' sampling parameters and seeds (``meta.set_row``);
    each row's first token is drawn with its own filter at its own Philox step 0, so it is the token
    ``prefill`` would give it in a batch of its own. The caller prefills the drafter after it has
    delivered the first tokens.

    Returns (the first token, the RowStatus, its logprobs or None) of each joining row; a status < 0
    means its prompt's logits were invalid (e.g. NaN), and the caller frees it. The rows' processors
    (``meta.processing``) are set before; each row's grammar then takes its first token."""
    n = len(rows)
    index = torch.tensor(list(rows), dtype=torch.int64, device=meta.device)  # [n]
    meta.set_prompts(rows, prompts)
    joining = meta.select(index)  # the rows' own filters and seeds
    joining.set_row_steps(torch.zeros((n,), dtype=torch.int64))
    first = torch.empty((n, 1), dtype=torch.int64, device=logits.device)  # [n, 1]
    status = torch.empty((n,), dtype=torch.int32, device=logits.device)  # [n]
    sample_plain(logits.unsqueeze(1).contiguous(), joining, first, status, check=False)
    first = first[:, 0].clamp(min=0)  # (a failed row's token is never used)
    meta.set_first_tokens(index, first)
    tokens, codes = first.tolist(), status.tolist()
    emitted = {i: [tokens[i]] for i in range(n) if codes[i] >= 0}
    if joining.processing is not None and joining.processing.has_grammar:
        joining.processing.commit_host(emitted)  # (one token: always the grammar's)
    return tokens, codes, read_logprobs(joining, emitted, n)


# ------------------------------------------------------------------------------------------ host time
class HostTime:
    """Adaptive k's H: the host time between the timed parts of two loop iterations (stop checks, stats,
    ``observe``, ``plan``), the time the loop's consumer held it between a yield and the resumption
    left out. ``timer`` None: nothing measured (no adaptive k; no extra timer reads, which synchronise
    a GPU)."""

    def __init__(self, timer: Optional[Timer]):
        self.timer = timer
        self.mark = timer.now() if timer is not None else 0.0  # end of the last timed part
        self.held = 0.0  # time since then that was not the loop's host work

    def since(self, now: float) -> float:
        """Host seconds from the last timed part's end to ``now``."""
        return max(now - self.mark - self.held, 0.0)

    def end(self, now: float) -> None:
        """A timed part ended at ``now``."""
        self.mark, self.held = now, 0.0

    def held_since(self, start: float) -> None:
        """From ``start`` until now the loop did something else (its consumer held it, a one-off)."""
        self.held += self.timer.now() - start

    def hand_over(self, new: List[List[int]]) -> Iterator[List[List[int]]]:
        """Yield ``new`` to the loop's consumer; the time it holds the loop is not host work."""
        if self.timer is None:
            yield new
            return
        start = self.timer.now()
        yield new
        self.held_since(start)



# ------------------------------------------------------------------------------------------ greedy chains
def chainable(config: LoopConfig, meta: SpecDecodeMetadata) -> bool:
    """Whether greedy plain decoding can run as chains here: every row greedy, a target runner with the
    greedy-chain capability (the plan resolved it: LeanLlamaRunner on the CPU kernels, nothing hooked on
    its head), eager steps, one rank."""
    return (meta.all_greedy and config.greedy_chains and not config.step.graphs and config.sync is None
            and not config.every_token_sampled)


def chains_plain(drafter: Optional[Drafter], config: LoopConfig, meta: SpecDecodeMetadata) -> bool:
    """Whether plain decoding runs as greedy chains (``plain_chains``): no drafter, and ``chainable``."""
    return drafter is None and chainable(config, meta)


def plain_chains(target: ModelRunner, meta: SpecDecodeMetadata, rows: List[RowState], stop: StopCriteria,
                 stats: GenerationStats, timer: Timer) -> Iterator[List[List[int]]]:
    """Greedy plain decoding, PLAIN_CHAIN_TOKENS passes a call: the runner's ``greedy_chain`` feeds each
    row's pending token and its argmaxes (bit for bit the one-token passes and the greedy verifier's
    choice, the logits checked as chain_verify checks them), then the stops cut each row's tokens. Every
    row is fed (a finished one's passes are ignored, its cache never read again); a call is at most as
    long as the longest unfinished row still needs. Yields each call's new tokens per row; the stats
    count the passes the step loop would have made."""
    B = len(rows)
    chain = torch.empty((B, PLAIN_CHAIN_TOKENS + 1), dtype=torch.int64)  # [B, 1 + n]: pending, then n argmaxes
    chain[:, 0] = meta.pending_tokens()[:, 0].cpu()
    while not all(r.finished for r in rows):
        n = chain_length(target, rows, stop)
        t0 = timer.now()
        target.greedy_chain(chain, n + 1, check_logits=True)
        stats.verify_time += timer.now() - t0
        new = stop_passes(rows, chain[:, 1: n + 1].tolist(), stop, stats)
        chain[:, 0] = chain[:, n]
        yield new


def chain_length(target: ModelRunner, rows: List[RowState], stop: StopCriteria) -> int:
    """Passes of the next plain chain call: PLAIN_CHAIN_TOKENS, at most what the longest unfinished row
    still needs and what the cache can still hold."""
    room = target.max_seq_len - max(target.lengths.tolist())
    return min(PLAIN_CHAIN_TOKENS, tokens_left(rows, stop), room)


def stop_passes(rows: List[RowState], emitted: List[List[int]], stop: StopCriteria,
                stats: GenerationStats) -> List[List[int]]:
    """The stop checks of chained one-token passes, pass by pass as the step loop makes them: emitted
    [B][n], each row's argmax at each pass; each pass counts as a step of the rows still unfinished at
    it. Returns each row's new tokens."""
    B = len(rows)
    new: List[List[int]] = [[] for _ in range(B)]
    for j in range(len(emitted[0]) if emitted else 0):
        active = [not r.finished for r in rows]
        if not any(active):
            break
        stats.record_step(StepOutcome.of([0] * B, [0] * B, active))
        for b in range(B):
            if active[b]:
                new[b] += apply_stops(rows[b], [emitted[b][j]], stop)
    stats.new_tokens += sum(len(t) for t in new)
    return new


def plain_segment(loop: "LoopState", drafter: Optional[Drafter]) -> Tuple[List[List[int]], int]:
    """Adaptive k switched speculation off for every row where the loop can chain (``chainable``): one
    ``greedy_chain`` call of ``chain_length`` one-token passes from each row's pending token, as
    ``plain_chains`` runs them; the unfinished rows keep every pass's token, in the target cache and in
    the token buffer, as a step's commit keeps them, and the frozen rows keep nothing; the drafter
    skipped those steps (``skip_drafter``). Returns (the argmaxes [B][n] before the stop checks, n);
    n = 0 (nothing run) when the cache has no room for a pass. Between two segments the host work is
    what plain decoding's chains do and little more: the chain's buffer is the loop's, and meta.active is
    written only when a row finished since (a torch call between two passes costs 5-50 us: 0.18 ms a
    segment beyond plain decoding's before, 1-2% of a generation that never speculates)."""
    target, meta, rows = loop.target, loop.meta, loop.rows
    active = tuple(not r.finished for r in rows)
    n = chain_length(target, rows, loop.stop)
    if n < 1:
        return [], 0
    lengths = None if all(active) else target.lengths.clone()  # [B]
    if loop.chain is None or loop.chain.shape[1] != n + 1:  # (the op takes it contiguous)
        loop.chain = torch.empty((len(rows), n + 1), dtype=torch.int64)  # [B, 1 + n]: pending, then n argmaxes
    chain = loop.chain
    chain[:, 0] = meta.target_input[:, 0].cpu()  # (the pending tokens)
    target.greedy_chain(chain, n + 1, check_logits=True)
    if active != loop.active_written:
        meta.active.copy_(torch.tensor(active))
        loop.active_written = active
    append_chain(meta, chain, n)
    if lengths is not None:
        target.truncate(lengths + meta.num_kept.to(lengths.device))
    if drafter is not None:
        skip_drafter(drafter, meta, n)
    return chain[:, 1:].tolist(), n


def append_chain(meta: SpecDecodeMetadata, chain: torch.Tensor, n: int) -> None:
    """A plain segment's tokens into the token buffer: each active row (``meta.active``) keeps the n
    argmaxes chain[b, 1:] (host [B, 1 + n]), as ``append_tokens`` keeps a step's (a step that accepted
    n - 1 drafts), in one op call (a segment runs between two passes that stream the weights through
    the caches, where every op call is dear: the host-indexed copies this replaced cost 0.19 ms a segment)."""
    meta.num_accepted.fill_(n - 1)
    append_tokens(meta, chain[:, 1:].to(meta.device), meta.num_accepted)


def timed_segment(loop: "LoopState", drafter: Optional[Drafter], adaptive: AdaptiveK,
                  host: HostTime, context: float) -> Tuple[List[List[int]], int]:
    """``plain_segment`` (``drafter``: the loop's, or None while its prefill is deferred), timed for the
    stats and for adaptive k (its time per pass, the host time since the previous step included, at the
    rows' mean context halfway through it: ``context`` at its start), then the stop checks. Returns (each
    row's new tokens, passes)."""
    active = [not r.finished for r in loop.rows]
    t0 = host.timer.now()
    emitted, passes = plain_segment(loop, drafter)
    if not passes:
        return [], 0
    t1 = host.timer.now()
    loop.stats.verify_time += t1 - t0
    steps = loop.stats.steps
    new = stop_passes(loop.rows, emitted, loop.stop, loop.stats)
    adaptive.observe_plain(passes, t1 - t0 + host.since(t0), active, context + passes / 2,
                           counted=loop.stats.steps - steps)
    host.end(t1)
    return new, passes


def skip_drafter(drafter: Drafter, meta: SpecDecodeMetadata, steps: int) -> None:
    """The drafter's side of ``steps`` plain steps that ran without it (meta.num_kept and the token
    buffer already hold their tokens): ``skip`` per step, then one ``commit`` of a verdict that accepted
    nothing (a model drafter leaves its cache as it is and feeds the tokens at its next proposal; the
    n-gram drafter indexes them now)."""
    for _ in range(steps):
        drafter.skip(meta)
    meta.num_accepted.zero_()
    drafter.commit(meta, Verdict(meta.output_tokens, meta.num_accepted))



# ------------------------------------------------------------------------------------------ steps
@dataclass
class LoopState:
    """What the phases of one decode call share."""

    target: ModelRunner
    drafter: Optional[Drafter]
    meta: SpecDecodeMetadata
    rows: List[RowState]
    stop: StopCriteria
    stats: GenerationStats
    timer: Timer
    chain: Optional[torch.Tensor] = None  # [B, 1 + n] int64: the last plain segment's chain buffer (n passes)
    active_written: Optional[Tuple[bool, ...]] = None  # meta.active as the last segment wrote it (None: a step since)


def run_steps(loop: LoopState, config: LoopConfig, adaptive: Optional[AdaptiveK], segments: bool,
              drafter_prefill: "DrafterPrefill") -> Iterator[List[List[int]]]:
    """The decode steps until every row has finished: per step the Philox step, adaptive k's budget, then
    ``Stepper.step`` (or a plain chain segment where adaptive k switched every row off and ``segments``),
    then adaptive k observes the step. Yields each step's new tokens per row."""
    stepper = Stepper(loop.target, loop.drafter, loop.meta, config.step, sync=config.sync, clock=loop.timer.now,
                      recorder=loop.stats)
    stops = [loop.stop] * len(loop.rows)
    host = HostTime(loop.timer if adaptive is not None else None)
    prompt_lens = loop.meta.prompt_lens.tolist() if adaptive is not None else []
    step = FIRST_DECODE_STEP
    while not all(r.finished for r in loop.rows):
        loop.meta.set_step(step)
        budget = None
        if adaptive is not None:
            active = [not r.finished for r in loop.rows]
            context = mean_context(prompt_lens, loop.rows)
            budget = adaptive.plan(active, tokens_left(loop.rows, loop.stop), drafter_prefill.pending(),
                                   context=context)
        if segments and max(budget) == 0:
            new, passes = timed_segment(loop, loop.drafter if drafter_prefill.ready else None, adaptive, host,
                                        context)
            if passes:
                step += passes
                if adaptive.look_due:  # (not host work between steps: a one-off, like a prefill)
                    begin = loop.timer.now()
                    adaptive.observe_look(drafter_prefill.greedy_look(LOOK_TOKENS), active)
                    host.held_since(begin)
                yield from host.hand_over(new)
                continue
        if not drafter_prefill.done:  # (the drafter's prefill is not host work between steps)
            host.held_since(drafter_prefill.run(look=adaptive is not None and adaptive.looking))
        result = stepper.step(loop.rows, stops, budget)
        loop.active_written = None  # (the step wrote meta.active)
        loop.stats.draft_time += result.draft_time
        loop.stats.verify_time += result.verify_time
        if adaptive is not None:
            adaptive.observe(budget, result.outcome, draft_time=result.draft_time, verify_time=result.verify_time,
                             drafted=max(budget, default=0), width=result.width,
                             host_time=host.since(result.started), context=context)
            host.end(result.started + result.draft_time + result.verify_time)
        loop.stats.new_tokens += sum(len(n) for n in result.new_tokens)
        step += 1
        yield from host.hand_over(result.new_tokens)


def mean_context(prompt_lens: List[int], rows: List[RowState]) -> float:
    """The unfinished rows' mean committed tokens (prompt and generated; adaptive k compares its costs
    there: a pass's cost grows with the context it reads)."""
    lengths = [p + len(r.tokens) for p, r in zip(prompt_lens, rows) if not r.finished]
    return sum(lengths) / len(lengths) if lengths else 0.0


def tokens_left(rows: List[RowState], stop: StopCriteria) -> int:
    """The most tokens an unfinished row may still emit (max_new_tokens bounds them)."""
    return max(stop.max_new_tokens - len(r.tokens) for r in rows if not r.finished)


class DrafterPrefill:
    """The drafter's prefill, run by ``prefill`` at the start, or ``deferred`` (adaptive k where it runs
    plain chain segments) until the loop first needs the drafter, so that a generation that never
    speculates never pays for it. A deferred prefill feeds every committed token but the pending one,
    what ``prefill`` gives it at the start; its time counts as prefill time, and adaptive k learns its
    cost per token (``AdaptiveK.record_prefill``). A ``look`` (``AdaptiveK.looking``: explorations, or a
    generation's first drafting steps) prefills a drafter that has ``windowed_prefill`` with the last
    LOOK_WINDOW committed tokens of each row: enough to measure the prompt's acceptance, at a fraction of
    the cost where it turns out not to pay; the first step that speculates after the look prefills the
    whole context. ``greedy_look`` runs adaptive k's look without a target pass (``AdaptiveK.look_due``)."""

    def __init__(self, drafter: Optional[Drafter], meta: SpecDecodeMetadata, timer: Timer,
                 stats: GenerationStats, deferred: bool, adaptive: Optional[AdaptiveK]):
        self.drafter, self.meta, self.timer, self.stats, self.adaptive = drafter, meta, timer, stats, adaptive
        self.done = not deferred  # the drafter holds every committed token but the pending ones
        self.windowed = False  # it holds a look's window (it can draft; a switch on prefills all)

    @property
    def ready(self) -> bool:
        """Whether the drafter can propose now (its whole context, or a look's window)."""
        return self.done or self.windowed

    def pending(self) -> int:
        """Tokens the whole prefill would feed (0 once done): what a switch on must repay."""
        return 0 if self.done else self.drafter.prefill_tokens([n - 1 for n in self.meta.seq_lens.tolist()])

    def run(self, look: bool = False) -> float:
        """Prefill the drafter now, unless it is ready for what the step needs (``look``: a window does);
        returns when it started (``timer.now()``)."""
        begin = self.timer.now()
        if self.done or (look and self.windowed):
            return begin
        lengths = self.meta.seq_lens.tolist()
        buffer = self.meta.token_buffer.cpu()  # [B, S]
        self._prefill([buffer[b, : lengths[b] - 1].tolist() for b in range(len(lengths))], look)
        return begin

    def _prefill(self, committed: List[List[int]], look: bool) -> None:
        """Prefill the drafter with ``committed`` (each row's tokens from position 0), only their last
        LOOK_WINDOW for a ``look`` by a drafter that can; timed as prefill (adaptive k learns its cost per
        token from it, the drafter's build left out)."""
        begin = self.timer.now()
        self.drafter.prepare(self.meta)
        built = self.timer.now()
        window = look and self.drafter.windowed_prefill and max(map(len, committed)) > LOOK_WINDOW
        with nvtx_range("prefill"):
            if window:
                self.drafter.prefill_window(committed, self.meta, LOOK_WINDOW)
            else:
                self.drafter.prefill(committed, self.meta)
        self.done, self.windowed = not window, window
        tokens = (sum(min(len(c), LOOK_WINDOW) for c in committed) if window
                  else self.drafter.prefill_tokens([len(c) for c in committed]))
        end = self.timer.now()
        self.stats.prefill_time += end - begin
        if self.adaptive is not None:
            self.adaptive.record_prefill(end - built, tokens)

    def greedy_look(self, tokens: int) -> List[List[bool]]:
        """Adaptive k's look over greedy rows (``Drafter.look``): per row, whether a first draft from each
        of its last ``tokens`` committed positions (generated ones only: a prompt's tokens are not the
        target's) would have been accepted, oldest first. A deferred drafter is prefilled first, with
        the LOOK_WINDOW tokens before those (a look's window). The prefill counts as prefill time, the
        look's draft pass as draft time."""
        meta = self.meta
        lengths, prompt_lens = meta.seq_lens.tolist(), meta.prompt_lens.tolist()
        # position p + 1 in [S - shown, S - 1] is generated; a deferred prefill keeps >= 1 token of context
        shown = [max(0, min(tokens, S - P, S - 2 if not self.ready else S)) for S, P in zip(lengths, prompt_lens)]
        if not self.ready:
            buffer = meta.token_buffer.cpu()  # [B, S]
            self._prefill([buffer[b, : lengths[b] - 1 - shown[b]].tolist() for b in range(len(lengths))], True)
        begin = self.timer.now()
        with nvtx_range("look"):
            matches = self.drafter.look(meta, shown)
        self.stats.draft_time += self.timer.now() - begin
        return matches


def start_adaptive(adaptive: AdaptiveK, target: ModelRunner, drafter: Drafter, meta: SpecDecodeMetadata,
                   timer: Timer, running: bool, segments: bool, drafter_prefill: DrafterPrefill) -> float:
    """adaptive.start (``segments``: the loop runs plain chain segments when no row drafts) and the
    start-up probes it asks for (``probe_costs``, ``probe_plain_chain``); a draft probe proposes, so the
    drafter's deferred prefill runs first. Returns the probes' seconds (not part of the run)."""
    begin = timer.now()
    request = adaptive.start(meta.batch_size, target.model, drafter_key(drafter), probe=running,
                             plain_chain=PLAIN_CHAIN_TOKENS if segments else 0,
                             looks=segments and drafter.greedy_looks)
    if request.draft_counts and not drafter_prefill.done:
        prefill_start = drafter_prefill.run()
        begin += timer.now() - prefill_start  # (part of the run)
    verify_times, draft_times = probe_costs(target, drafter, meta, request, timer, adaptive.probe_passes)
    plain = (probe_plain_chain(target, meta, request.plain_passes, timer, adaptive.probe_passes)
             if request.plain_passes else None)
    prompt_lens = meta.prompt_lens.tolist()
    adaptive.record_probes(verify_times, draft_times, plain, sum(prompt_lens) / len(prompt_lens))
    return timer.now() - begin


# ------------------------------------------------------------------------------------------ loop
@torch.no_grad()  # applied per resumption of the generator: the caller's grad mode is untouched
def decode(target: ModelRunner, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]], seeds: torch.Tensor,
           stop: StopCriteria, config: LoopConfig, *, rows: Optional[List[RowState]] = None,
           stats: Optional[GenerationStats] = None) -> Iterator[List[List[int]]]:
    """Run the loop; yields, after the prefill and after every step, the new tokens of each row.

    ``drafter=None`` (``config.slots=0``) is plain decoding over the same runner and sampler (the
    baseline). ``config.adaptive`` (slots = its k_max): every step it gives each row a draft budget
    0..slots and the target pass is only as wide as the largest budget + 1 (steps run eagerly). A tree
    drafter (``drafter.is_tree``) proposes ``slots`` nodes (no adaptive k). ``rows`` (one RowState per
    prompt; rows already finished, e.g. the padding of a CUDA-graph bucket, stay frozen and emit
    nothing) receives the returned tokens and finish reasons; ``stats`` the measurements. seeds [B] int64.
    """
    B = len(prompts)
    timer = Timer(seeds.device)
    stats = stats if stats is not None else GenerationStats(k=config.slots, batch_size=B)
    rows = rows if rows is not None else [RowState() for _ in range(B)]
    tree = drafter is not None and drafter.is_tree
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=config.slots, max_seq_len=config.max_seq_len,
                                       sampling=config.sampling, seeds=seeds, tree=tree)
    attach_processing(meta, config, prompts, rows, target.vocab_size)
    adaptive = config.adaptive if drafter is not None and not tree else None
    segments = adaptive is not None and chainable(config, meta)
    drafter_prefill = DrafterPrefill(drafter, meta, timer, stats, deferred=segments, adaptive=adaptive)
    start = timer.now()
    prefill(target, None if segments else drafter, prompts, meta, config.sync)
    new = first_tokens(meta, rows, stop)
    stats.prefill_time = timer.now() - start
    stats.new_tokens = sum(len(n) for n in new)
    yield new
    running = not all(r.finished for r in rows)
    if adaptive is not None:
        start += start_adaptive(adaptive, target, drafter, meta, timer, running, segments, drafter_prefill)
    if config.cost_probe and drafter is not None and running:
        # k="auto" measures a plain step already (its V(1) at this batch size); else a recent probe of this
        # target serves (probes.PLAIN_STEP_REUSE_S): probing again cost every call three target passes
        # (~6-9 ms on the bundled pair, one CPU thread) that the caller waited for
        stats.target_step_time = None if adaptive is None else adaptive.plain_step_time()
        if stats.target_step_time is None:
            probe_start = timer.now()
            stats.target_step_time = recent_target_step(target, meta, timer)
            start += timer.now() - probe_start  # the probes are not part of the run
    if chains_plain(drafter, config, meta):
        yield from plain_chains(target, meta, rows, stop, stats, timer)
    else:
        state = LoopState(target, drafter, meta, rows, stop, stats, timer)
        yield from run_steps(state, config, adaptive, segments, drafter_prefill)
    stats.total_time = timer.now() - start
    if adaptive is not None:
        stats.adaptive = adaptive.finish()


def attach_processing(meta: SpecDecodeMetadata, config: LoopConfig, prompts: Sequence[Sequence[int]],
                      rows: List[RowState], vocab_size: int) -> None:
    """The request fields beyond the filter on the loop's metadata: every real row's processors and
    grammar (the padding rows of a CUDA-graph bucket stay unprocessed), and logprobs."""
    meta.top_logprobs = config.top_logprobs
    if config.processing is None or not config.processing.active:
        return
    meta.processing = ProcessingState.allocate(meta.batch_size, vocab_size, meta.device)
    for b, prompt in enumerate(prompts):
        if rows[b].finish_reason != "padding":
            grammar = config.grammar_of(b) if config.grammar_of is not None else None
            meta.processing.set_row(b, config.processing, prompt, grammar)


def first_tokens(meta: SpecDecodeMetadata, rows: List[RowState], stop: StopCriteria) -> List[List[int]]:
    """The first token of each row (sampled by ``prefill``) through the stop checks, with its logprobs
    and into the row's grammar; returns each row's new tokens."""
    B = len(rows)
    first = meta.pending_tokens()[:, 0].tolist()
    return emit(meta, rows, [stop] * B, {b: [first[b]] for b in range(B) if not rows[b].finished})


def pad_batch(prompts: Sequence[Sequence[int]], seeds: torch.Tensor, rows: List[RowState],
              batch: int) -> Tuple[List[List[int]], torch.Tensor, List[RowState]]:
    """Pad a batch to ``batch`` rows (the plan's CUDA-graph bucket) with frozen rows: one-token prompts
    (the first prompt's last token), seed 0, rows already finished (reason "padding"), so the loop
    freezes them from the first step. The real rows come first, unchanged."""
    extra = batch - len(prompts)
    if extra < 0:
        raise ValueError(f"pad_batch: {len(prompts)} prompts do not fit a batch of {batch}")
    padding = [RowState(finished=True, finish_reason="padding") for _ in range(extra)]
    filler = [int(list(prompts[0])[-1])]
    seeds = torch.cat([seeds, torch.zeros((extra,), dtype=seeds.dtype, device=seeds.device)])
    return [list(p) for p in prompts] + [list(filler) for _ in range(extra)], seeds, list(rows) + padding
