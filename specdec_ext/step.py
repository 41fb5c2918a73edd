"""One decode step, the same for generate()'s loop (decode.py) and the server's batcher (serve/batcher.py).

    draft    drafter.propose(meta, budget)        -> Proposal: token ids [B, n], q [B, n, V] or None,
                                                     num_draft [B], tree parents [B, n]
    verify   target.forward([pending, drafts])    -> logits [B, w, V]; the verifier (chain_verify or
                                                     tree_verify) -> Verdict: tokens [B, n+1],
                                                     num_accepted [B], tree path [B, n]
    read     one device->host copy: accepted and drafted counts, the emitted tokens
    commit   the target keeps the pending token and the accepted drafts (a tree: its path, moved next
             to the prefix); the emitted tokens join the token buffer and the last one becomes the
             next pending token; the drafter rolls back what was rejected
    stats    the step's StepOutcome goes to the caller's recorder (GenerationStats, ServeMetrics)
    stops    per row on the host (stops.py): EOS, max_new_tokens, stop strings; a finished row is
             frozen from the next step on (it commits nothing)

B rows, n draft slots, V vocabulary. ``Stepper.step`` is the only place where these run; the loop
around it decides the Philox step (``meta.set_step`` / ``set_row_steps``) and the draft budget
(adaptive k) before it, and what to do with the new tokens after it. The per-step tensors are the
metadata's, allocated once; with CUDA graphs the draft, verify and commit parts are captured
(cuda_graphs.StepGraph, ``StepOptions.graphs``) and replayed.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import ops
from ._status import raise_for_row_status
from .cuda_graphs import StepGraph
from .distributed import RankSync
from .drafters import Drafter
from .logprobs import host_logprobs, step_logprobs
from .metadata import Proposal, SpecDecodeMetadata, Verdict
from .profiling import nvtx_enabled, nvtx_range
from .runners import ModelRunner
from .stats import StepOutcome
from .stops import RowState, StopCriteria, apply_stops

Verifier = Callable[[SpecDecodeMetadata, Proposal, torch.Tensor], Verdict]


# ------------------------------------------------------------------------------------------ verifier
def lossless_verify(meta: SpecDecodeMetadata, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
    """chain_verify (a chain) or tree_verify (a tree: recursive rejection sampling with the proposal's
    q, the deterministic-candidate rule without) into the loop's verdict buffers.

    target_logits [B, n+1, V]
    """
    sampling = dict(temperature=meta.temperature, top_k=meta.top_k, top_p=meta.top_p, seed=meta.seed,
                    offset=meta.verify_offset, check_status=False)
    if proposal.parents is None:
        tokens = meta.plain_tokens if proposal.token_ids.shape[1] == 0 else meta.output_tokens  # (step.verify)
        ops.chain_verify(target_logits, proposal.token_ids, proposal.probs, num_draft=proposal.num_draft,
                         out=(tokens, meta.num_accepted), **sampling)
        return Verdict(tokens, meta.num_accepted)
    ops.tree_verify(target_logits, proposal.token_ids, proposal.parents, proposal.probs, num_nodes=proposal.num_draft,
                    out=(meta.tree_path, meta.output_tokens, meta.num_accepted), **sampling)
    return Verdict(meta.output_tokens, meta.num_accepted, meta.tree_path)


# ------------------------------------------------------------------------------------------ parts
def verify_width(proposal: Proposal) -> int:
    """Tokens per row of the target pass that verifies ``proposal``: [pending, drafts], as wide as its
    longest row when the drafter knows it (``Proposal.longest``), else n + 1."""
    slots = proposal.token_ids.shape[1]
    return (slots if proposal.longest is None else min(proposal.longest, slots)) + 1


def draft(drafter: Optional[Drafter], meta: SpecDecodeMetadata, budget: Optional[List[int]]) -> Proposal:
    """This step's proposal; ``meta.no_drafts`` without a drafter, or when adaptive k gives every row a
    budget of 0 (the drafter is told to ``skip``)."""
    if drafter is None:
        return meta.no_drafts
    if budget is not None and max(budget, default=0) == 0:
        drafter.skip(meta)
        return meta.no_drafts
    return drafter.propose(meta, budget)


def verify(target: ModelRunner, meta: SpecDecodeMetadata, proposal: Proposal, verifier: Verifier) -> Verdict:
    """One target pass over [pending, drafts] and the verifier. The pass is only as wide as the
    proposal's longest row + 1; narrower logits are widened into a static [B, n+1, V] buffer (the
    verifier reads positions 0..num_draft[b] of row b only, so the stale columns are never read), but
    a pass without drafts: its one position is verified as it is, against [B, 0] drafts (widening a
    server's [16, 1, V] logits into fp32 [16, 9, V] cost 0.1 ms of a 6 ms plain step). A sampling row's
    recovered or bonus token comes from Philox column num_draft[b] whatever the buffers' width, so its
    tokens do not depend on whether the rows beside it drafted. ``meta.target_input[:, 0]`` already
    holds each row's pending token."""
    width = verify_width(proposal)
    meta.target_input[:, 1:].copy_(proposal.token_ids)
    meta.target_num_tokens.copy_(proposal.num_draft.to(torch.int64) + 1)
    logits = target.forward(meta.target_input[:, :width], meta.target_num_tokens,
                            tree_parents=proposal.parents)  # [B, width, V]
    if width == 1 and proposal.parents is None:  # no row drafted: [B, 0] drafts, [B, 1, V]
        probs = None if proposal.probs is None else proposal.probs[:, :0]
        proposal = dataclasses.replace(proposal, token_ids=proposal.token_ids[:, :0], probs=probs)
        logits = logits.contiguous()  # (a runner may return a view of a wider pass)
    elif width < meta.slots + 1:
        logits = widen_logits(meta, logits)  # [B, n+1, V]
    logits = process(meta, logits, proposal)
    verdict = verifier(meta, proposal, logits)
    if meta.top_logprobs is not None:
        meta.step_logprobs = step_logprobs(logits, verdict.tokens, verdict.path, meta.temperature, meta.top_logprobs)
    return verdict


def process(meta: SpecDecodeMetadata, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """The rows' logits processors (processing.py) on the target's logits [B, n+1, V], in place, each
    column with its own prefix of drafts; unchanged when no row is processed."""
    processing = meta.processing
    if processing is None or not processing.any_active:
        return logits
    logits = logits.contiguous()
    processing.apply(logits, proposal.token_ids, proposal.num_draft, meta.temperature, parents=proposal.parents)
    return logits


def widen_logits(meta: SpecDecodeMetadata, logits: torch.Tensor) -> torch.Tensor:
    """A narrower verify pass [B, t, V] -> meta.verify_logits [B, n+1, V] (allocated on first use)."""
    B, t, V = logits.shape
    buffer = meta.verify_logits
    if buffer is None or buffer.dtype != logits.dtype or buffer.shape != (B, meta.slots + 1, V):
        buffer = meta.verify_logits = torch.zeros((B, meta.slots + 1, V), dtype=logits.dtype, device=logits.device)
    buffer[:, :t].copy_(logits)
    return buffer


def commit(target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata, verdict: Verdict) -> None:
    """The emitted tokens join the token buffer (``append_tokens``), the target keeps pending + accepted
    tokens of the active rows (frozen rows keep nothing), the drafter rolls back what was rejected."""
    append_tokens(meta, verdict.tokens, verdict.num_accepted)
    if verdict.path is None:
        target.commit(meta.num_kept)
    else:  # a tree: keep pending + the accepted path (kv_compact), then roll frozen rows back
        before = target.lengths.clone()  # [B]
        target.commit_tree(verdict.path, verdict.num_accepted)
        target.truncate(before + meta.num_kept.to(before.device))
    if drafter is not None:
        drafter.commit(meta, verdict)


def append_tokens(meta: SpecDecodeMetadata, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Each active row keeps num_accepted[b] + 1 of tokens [B, w] (meta.num_kept; a frozen row none):
    they join its token buffer, seq_lens += num_kept, and its last token is its next pending token, in
    one op call (ops.commit_tokens; the dozen torch calls it replaced cost 0.07 ms a step on the CPU)."""
    ops.commit_tokens(tokens, num_accepted, meta.active, meta.token_buffer, meta.seq_lens, meta.num_kept,
                      meta.target_input)
    if meta.processing is not None:
        meta.processing.record(tokens, meta.num_kept)


def read_step(proposal: Proposal, verdict: Verdict) -> Tuple[List[List[int]], List[int], List[int]]:
    """The step's one host read: per row [num_accepted, num_draft, tokens...] ([B, 2 + n+1]), and the
    accepted and drafted counts as lists. Row b emits host[b][2: 3 + num_accepted[b]]."""
    if verdict.tokens.device.type == "cpu":  # nothing to gather into one copy: three reads, no cat
        accepted, drafted = verdict.num_accepted.tolist(), proposal.num_draft.tolist()
        return [[a, d, *t] for a, d, t in zip(accepted, drafted, verdict.tokens.tolist())], accepted, drafted
    host = torch.cat([verdict.num_accepted[:, None].long(), proposal.num_draft[:, None].long(), verdict.tokens],
                     dim=1).tolist()
    return host, [r[0] for r in host], [r[1] for r in host]


def ended_at_leaf(proposal: Proposal, verdict: Verdict, num_accepted: List[int]) -> List[bool]:
    """A tree step, per row: whether its accepted path ends at a node without children (a host read of the
    parents [B, N] and the path [B, N]; trees run eagerly)."""
    parents, path, counts = proposal.parents.tolist(), verdict.path.tolist(), proposal.num_draft.tolist()
    ends = []
    for b, accepted in enumerate(num_accepted):
        last = path[b][accepted - 1] if accepted > 0 else -1  # (-1: the root)
        ends.append(last not in parents[b][:counts[b]])
    return ends


# ------------------------------------------------------------------------------------------ the step
@dataclass
class _Handed:
    """What the parts of a step hand on: the budget to the draft, its proposal to the verify, its verdict to
    the commit."""

    budget: Optional[List[int]]  # [B] host ints, or None (every row drafts k)
    proposal: Proposal
    verdict: Optional[Verdict]


class DecodeSteps:
    """The draft, verify and commit parts over one metadata: CUDA graphs (cuda_graphs.StepGraph) when
    ``graphs``, plain calls otherwise (NVTX ranges around them where NVTX is on when they are built).
    Under graphs the proposal and the verdict are the same static buffers at every replay; ``budget``
    (adaptive k) is read when the draft part runs, so under graphs it must be the same at every step
    (the server's steps under graphs: one length for every row, one Stepper per length); ``plain``: every
    step drafts nothing, and the draft part (the drafter's ``skip``, host bookkeeping) is not captured.
    ``backend`` is for tests (a fake CUDAGraph on the CPU)."""

    def __init__(self, target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata,
                 verifier: Verifier, *, graphs: bool, plain: bool = False, backend=None):
        # (the parts are closures over this holder, not over self, which holds them: that reference cycle kept
        # the runners and their caches alive after a generation until the next collection pass)
        handed = self._handed = _Handed(budget=None, proposal=meta.no_drafts, verdict=None)
        self.graphs: List[StepGraph] = []
        ranges = nvtx_enabled()
        if ranges:
            verifier = _ranged("rejection_sampling", verifier)

        def draft_part():
            handed.proposal = draft(drafter, meta, handed.budget)

        def verify_part():
            handed.verdict = verify(target, meta, handed.proposal, verifier)

        def commit_part():
            commit(target, drafter, meta, handed.verdict)

        def part(fn, name, capturable):
            if graphs and capturable:
                self.graphs.append(StepGraph(fn, name=name, enabled=True, backend=backend))
                fn = self.graphs[-1]
            return _ranged(name, fn) if ranges else fn

        self.draft = part(draft_part, "draft", drafter is not None and not plain)
        self.verify = part(verify_part, "verify", True)
        self.commit = part(commit_part, "commit", True)

    @property
    def budget(self) -> Optional[List[int]]:
        """This step's draft budgets (adaptive k), read by the draft part."""
        return self._handed.budget

    @budget.setter
    def budget(self, budget: Optional[List[int]]) -> None:
        self._handed.budget = budget

    @property
    def proposal(self) -> Proposal:
        """The draft part's proposal."""
        return self._handed.proposal

    @property
    def verdict(self) -> Optional[Verdict]:
        """The verify part's verdict."""
        return self._handed.verdict

    @property
    def captured(self) -> Dict[str, bool]:
        """Per part (draft, verify, commit): whether it is a captured graph."""
        graphs = {g.name: g.captured for g in self.graphs}
        return {name: graphs.get(name, False) for name in ("draft", "verify", "commit")}


def _ranged(name: str, fn: Callable) -> Callable:
    """``fn`` inside an NVTX range ``name``."""
    def run(*args):
        with nvtx_range(name):
            return fn(*args)
    return run


@dataclass(frozen=True)
class StepOptions:
    """How a Stepper runs its steps."""

    verifier: Verifier = lossless_verify
    graphs: bool = False  # draft / verify / commit captured as CUDA graphs (static shapes)
    device_steps: bool = False  # serving under graphs: the runners reserve a step's pages before it
    #                             (reserve_step) and hand the lengths back to the host after it (sync_host)
    isolate_failures: bool = False  # a row whose verification fails is frozen and reported (serving);
    #                                 False: the step raises (generate)
    graph_backend: object = None  # tests: a fake CUDAGraph on the CPU
    plain: bool = False  # every step is given a budget of 0 (a server's plain steps under graphs): the draft
    #                      part stays on the host


@dataclass
class StepResult:
    """What one step gave each row (host)."""

    new_tokens: List[List[int]]  # [B][*]: each row's tokens after its stop checks; [] for a frozen row
    failed: Dict[int, int]  # row -> its RowStatus (< 0): verification failed, the row committed nothing
    outcome: StepOutcome  # accepted and drafted counts of the rows that ran
    width: int  # tokens per row of the verify pass
    started: float  # clock at the step's start
    draft_time: float  # seconds drafting
    verify_time: float  # seconds verifying and committing


class Stepper:
    """Runs steps over one metadata (see the module docstring). ``sync`` (a tensor-parallel target,
    distributed.py): every rank takes rank 0's proposals and verdicts. ``clock``: what times the parts
    (decode.py passes a Timer's ``now``, which synchronises a GPU); ``recorder``: anything with
    ``record_step(StepOutcome)``."""

    def __init__(self, target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata,
                 options: StepOptions = StepOptions(), *, sync: Optional[RankSync] = None,
                 clock: Callable[[], float] = time.perf_counter, recorder=None):
        self.target, self.drafter, self.meta, self.options = target, drafter, meta, options
        self.sync, self.clock, self.recorder = sync, clock, recorder
        self.parts = DecodeSteps(target, drafter, meta, options.verifier, graphs=options.graphs, plain=options.plain,
                                 backend=options.graph_backend)

    def step(self, rows: Sequence[Optional[RowState]], stops: Sequence[Optional[StopCriteria]],
             budget: Optional[List[int]] = None) -> StepResult:
        """One step over the metadata's rows: ``rows[b]`` None (a free slot) or finished is frozen;
        ``stops[b]`` row b's stop checks; ``budget`` (adaptive k) caps each row's drafts."""
        meta, parts, sync = self.meta, self.parts, self.sync
        active = [row is not None and not row.finished for row in rows]
        meta.active.copy_(torch.tensor(active))
        drafts = meta.slots if budget is None else min(max(budget, default=0), meta.slots)  # the longest row's
        if self.options.device_steps:
            self._reserve(drafts)
        started = self.clock()
        parts.budget = budget
        parts.draft()
        if sync is not None:
            sync.proposal(parts.proposal)
        drafted = self.clock()
        parts.verify()
        if sync is not None:
            sync.verdict(parts.verdict)
        proposal, verdict = parts.proposal, parts.verdict
        host, num_accepted, num_draft = read_step(proposal, verdict)
        failed = self._failures(active, num_accepted, verdict)
        if failed:
            active = [live and b not in failed for b, live in enumerate(active)]
            meta.active.copy_(torch.tensor(active))
        parts.commit()
        if self.options.device_steps:
            self._hand_back(drafts)
        ended = self.clock()
        outcome = StepOutcome.of(num_accepted, num_draft, active,
                                 None if proposal.parents is None else ended_at_leaf(proposal, verdict, num_accepted))
        if self.recorder is not None:
            self.recorder.record_step(outcome)
        emitted = {b: host[b][2: 3 + num_accepted[b]] for b in range(len(rows)) if active[b]}
        new = emit(meta, rows, stops, emitted)
        return StepResult(new, failed, outcome, verify_width(proposal), started, drafted - started, ended - drafted)

    def _failures(self, active: List[bool], num_accepted: List[int], verdict: Verdict) -> Dict[int, int]:
        """Rows whose verification failed (a RowStatus < 0: NaN logits, ...): raised, or with
        ``isolate_failures`` the running ones returned (the others commit nothing anyway)."""
        # (a finished row is verified too, over whatever its buffers hold, and commits nothing: only the running
        # rows' statuses count)
        failed = {b: code for b, code in enumerate(num_accepted) if active[b] and code < 0}
        if failed and not self.options.isolate_failures:
            live = torch.tensor([failed.get(b, 0) for b in range(len(num_accepted))], dtype=torch.int32)
            raise_for_row_status("chain_verify" if verdict.path is None else "tree_verify", live)
        return failed

    def _reserve(self, drafts: int) -> None:
        """Device steps: every running row gets the pages this step can write, ``drafts`` per row at most
        (a plain step: the pending token's page alone, and nothing of the drafter, which does not run)."""
        width = self.meta.batch_size
        self.target.reserve_step(width, drafts + 1)
        if self.drafter is not None and drafts > 0:
            self.drafter.reserve_step(width, drafts)

    def _hand_back(self, drafts: int) -> None:
        """Device steps: the lengths back to the host allocators (pages past them are freed)."""
        self.target.sync_host()
        if self.drafter is not None and drafts > 0:
            self.drafter.sync_host()


def sample_plain(logits: torch.Tensor, meta: SpecDecodeMetadata, tokens: torch.Tensor, status: torch.Tensor,
                 check: bool) -> None:
    """One token per row from one position of logits (a verify pass with no drafts): the prefill's first
    token and the cost probe's plain step, processed as a step's column 0 is (``meta.step_logprobs`` set
    when logprobs are asked for). logits [B, 1, V] -> tokens [B, 1], status [B]."""
    no_drafts = meta.no_drafts.token_ids[:, :0]  # [B, 0]
    logits = process(meta, logits, dataclasses.replace(meta.no_drafts, token_ids=no_drafts, parents=None))
    ops.chain_verify(logits, no_drafts, None, temperature=meta.temperature, top_k=meta.top_k, top_p=meta.top_p,
                     seed=meta.seed, offset=meta.verify_offset, out=(tokens, status), check_status=check)
    if meta.top_logprobs is not None:
        meta.step_logprobs = step_logprobs(logits, tokens, None, meta.temperature, meta.top_logprobs)


def read_logprobs(meta: SpecDecodeMetadata, emitted: Dict[int, List[int]], batch: int) -> List[Optional[list]]:
    """Per row, the logprobs.TokenLogprob of its emitted tokens (None where not asked for or frozen)."""
    if meta.top_logprobs is None or meta.step_logprobs is None:
        return [None] * batch
    tokens = [emitted.get(b, []) for b in range(batch)]
    per_row = host_logprobs(tokens, *meta.step_logprobs)
    return [per_row[b] if b in emitted else None for b in range(batch)]


def emit(meta: SpecDecodeMetadata, rows: Sequence[Optional[RowState]], stops: Sequence[Optional[StopCriteria]],
         emitted: Dict[int, List[int]]) -> List[List[int]]:
    """The rows' emitted tokens (row -> tokens, the running rows) into their grammars (cut where a grammar
    ends), with their logprobs, through their stop checks; a row whose grammar now lets nothing follow
    ends. Returns each row's new tokens ([] for the others)."""
    if meta.processing is not None and meta.processing.has_grammar:
        emitted = meta.processing.commit_host(emitted)
    logprobs = read_logprobs(meta, emitted, len(rows))
    new = [apply_stops(rows[b], emitted[b], stops[b], logprobs[b]) if b in emitted else [] for b in range(len(rows))]
    end_dead_grammars(meta, rows)
    return new


def end_dead_grammars(meta: SpecDecodeMetadata, rows: Sequence[Optional[RowState]]) -> None:
    """A running row whose grammar lets nothing follow ends now (processing.grammar_ends: "stop" after a
    complete match, "grammar_dead_end" otherwise)."""
    if meta.processing is None or not meta.processing.has_grammar:
        return
    for b, reason in meta.processing.grammar_ends().items():
        row = rows[b]
        if row is not None and not row.finished:
            row.finished, row.finish_reason = True, reason
