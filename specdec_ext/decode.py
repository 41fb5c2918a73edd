"""The speculative decode loop, readable in one sitting.

    prefill   target.start(prompts) -> logits at each prompt's last position [B, V]; the first new
              token is sampled from them; the drafter prefills its own state
    repeat    budget  adaptive k (host): drafts per row this step, or None (the static width)
              draft   drafter.propose(meta, budget)      -> Proposal: token ids [B, n], q [B, n, V] or
                                                            None, num_draft [B], tree parents [B, n]
              verify  target.forward([pending, drafts])  -> logits [B, n+1, V]; chain_verify or
                                                            tree_verify -> Verdict: tokens [B, n+1],
                                                            num_accepted [B], tree path [B, n]
              read    one device->host copy: accepted and drafted counts, the emitted tokens
              commit  the target keeps the pending token and the accepted drafts (a tree: its accepted
                      path, moved next to the prefix); the emitted tokens join the token buffer; the
                      drafter rolls back what was rejected
              stop    per row on the host (stops.py): EOS, max_new_tokens, stop strings; finished rows
                      are frozen (commit nothing)

B rows, n draft slots, V vocabulary, S cache positions. The *pending* token of a row is its last emitted
token: committed to the token buffer but not yet to the target cache (the next verify pass feeds it
first, so its logits score draft 1). A step with no drafts (no drafter, or adaptive k switched
speculation off) verifies ``meta.no_drafts``: a one-token pass, i.e. plain decoding; where every row
is greedy on a runner that chains, plain decoding runs as greedy chains instead (``plain_chains``
without a drafter, ``plain_segment`` when adaptive k switched speculation off for every row). Every
per-step tensor is allocated once (metadata.py); with CUDA graphs the draft, verify and commit steps
are captured (cuda_graphs.StepGraph) and replayed.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import ops
from ._status import raise_for_row_status
from .adaptive import AdaptiveK, ProbeRequest, drafter_key
from .cuda_graphs import StepGraph
from .distributed import RankSync
from .drafters import Drafter
from .metadata import SCRATCH_COLUMNS, Proposal, SpecDecodeMetadata, Verdict
from .profiling import nvtx_range
from .runners import ModelRunner
from .sampling import SamplingParams
from .stats import GenerationStats, StepOutcome, Timer, median_time
from .stops import RowState, StopCriteria, apply_stops

FIRST_DECODE_STEP = 1  # Philox step 0 samples the first token from the prefill logits
COST_PROBE_PASSES = 3  # plain one-token target passes timed after prefill for the cost model
# Greedy plain decoding on a runner that chains (the CPU kernels): one-token passes per greedy_chain
# call, the stops checked between calls; the passes past a row's stop are wasted, at most this many - 1.
PLAIN_CHAIN_TOKENS = 8

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
        ops.chain_verify(target_logits, proposal.token_ids, proposal.probs, num_draft=proposal.num_draft,
                         out=(meta.output_tokens, meta.num_accepted), **sampling)
        return Verdict(meta.output_tokens, meta.num_accepted)
    ops.tree_verify(target_logits, proposal.token_ids, proposal.parents, proposal.probs, num_nodes=proposal.num_draft,
                    out=(meta.tree_path, meta.output_tokens, meta.num_accepted), **sampling)
    return Verdict(meta.output_tokens, meta.num_accepted, meta.tree_path)


def sample_plain(logits: torch.Tensor, meta: SpecDecodeMetadata, tokens: torch.Tensor, status: torch.Tensor,
                 check: bool) -> None:
    """One token per row from one position of logits (a verify pass with no drafts): the prefill's first
    token and the cost probe's plain step. logits [B, 1, V] -> tokens [B, 1], status [B]."""
    no_drafts = meta.no_drafts.token_ids[:, :0]  # [B, 0]
    ops.chain_verify(logits, no_drafts, None, temperature=meta.temperature, top_k=meta.top_k, top_p=meta.top_p,
                     seed=meta.seed, offset=meta.verify_offset, out=(tokens, status), check_status=check)


# ------------------------------------------------------------------------------------------ steps
def prefill(target: ModelRunner, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]],
            meta: SpecDecodeMetadata) -> None:
    """Fill both caches with the prompts and sample the first new token (the first pending token)."""
    B = len(prompts)
    logits = target.start(prompts)  # [B, V]
    meta.prompt_lens.copy_(torch.tensor([len(p) for p in prompts], dtype=torch.int64))
    for b, p in enumerate(prompts):
        meta.token_buffer[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
    meta.set_step(0)
    first = torch.empty((B, 1), dtype=torch.int64, device=logits.device)  # [B, 1]
    status = torch.empty((B,), dtype=torch.int32, device=logits.device)  # [B]
    sample_plain(logits.unsqueeze(1).contiguous(), meta, first, status, check=True)
    meta.token_buffer.scatter_(1, meta.prompt_lens[:, None], first)
    meta.seq_lens.copy_(meta.prompt_lens + 1)
    if drafter is not None:
        drafter.prefill(prompts, meta)


def prefill_rows(target: ModelRunner, drafter: Optional[Drafter], rows: Sequence[int],
                 prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> Tuple[List[int], List[int]]:
    """Continuous batching: what ``prefill`` does for a whole batch, for some free rows (slots) while
    the other rows keep their caches. ``meta`` covers every slot and already holds the joining rows'
    sampling parameters and seeds; each row's first token is drawn with its own filter at its own
    Philox step 0, so it is the token ``prefill`` would give it in a batch of its own.

    Returns (the first token, the RowStatus) of each joining row; a status < 0 means its prompt's
    logits were invalid (e.g. NaN), and the caller frees it."""
    n = len(rows)
    index = torch.tensor(list(rows), dtype=torch.int64, device=meta.device)  # [n]
    logits = target.start_rows(rows, prompts)  # [n, V]
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=meta.device)  # [n]
    for row, p in zip(rows, prompts):
        meta.token_buffer[row, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
    meta.prompt_lens[index] = lengths
    joining = meta.select(index)  # the rows' own filters and seeds
    joining.set_row_steps(torch.zeros((n,), dtype=torch.int64))
    first = torch.empty((n, 1), dtype=torch.int64, device=logits.device)  # [n, 1]
    status = torch.empty((n,), dtype=torch.int32, device=logits.device)  # [n]
    sample_plain(logits.unsqueeze(1).contiguous(), joining, first, status, check=False)
    first = first[:, 0].clamp(min=0)  # (a failed row's token is never used)
    meta.token_buffer[index, lengths] = first
    meta.seq_lens[index] = lengths + 1
    if drafter is not None:
        drafter.start_rows(rows, prompts, meta)
    return first.tolist(), status.tolist()


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
    verifier reads positions 0..num_draft[b] of row b only, so the stale columns are never read)."""
    width = proposal.verify_width()
    meta.target_input[:, :1].copy_(meta.pending_tokens())
    meta.target_input[:, 1:].copy_(proposal.token_ids)
    meta.target_num_tokens.copy_(proposal.num_draft.to(torch.int64) + 1)
    logits = target.forward(meta.target_input[:, :width], meta.target_num_tokens,
                            tree_parents=proposal.parents)  # [B, width, V]
    if width < meta.slots + 1:
        logits = widen_logits(meta, logits)  # [B, n+1, V]
    with nvtx_range("rejection_sampling"):
        return verifier(meta, proposal, logits)


def widen_logits(meta: SpecDecodeMetadata, logits: torch.Tensor) -> torch.Tensor:
    """A narrower verify pass [B, t, V] -> meta.verify_logits [B, n+1, V] (allocated on first use)."""
    B, t, V = logits.shape
    buffer = meta.verify_logits
    if buffer is None or buffer.dtype != logits.dtype or buffer.shape != (B, meta.slots + 1, V):
        buffer = meta.verify_logits = torch.zeros((B, meta.slots + 1, V), dtype=logits.dtype, device=logits.device)
    buffer[:, :t].copy_(logits)
    return buffer


def commit(target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata, verdict: Verdict) -> None:
    """The target keeps pending + accepted tokens of the active rows (frozen rows keep nothing), the
    emitted tokens join the token buffer, the drafter rolls back what was rejected."""
    emitted = verdict.num_accepted.to(torch.int64) + 1  # [B]
    meta.num_kept.copy_(torch.where(meta.active, emitted, torch.zeros_like(emitted)))
    if verdict.path is None:
        target.commit(meta.num_kept)
    else:  # a tree: keep pending + the accepted path (kv_compact), then roll frozen rows back
        before = target.lengths.clone()  # [B]
        target.commit_tree(verdict.path, verdict.num_accepted)
        target.truncate(before + meta.num_kept.to(before.device))
    append_tokens(meta, verdict.tokens)
    if drafter is not None:
        drafter.commit(meta, verdict)


def append_tokens(meta: SpecDecodeMetadata, tokens: torch.Tensor) -> None:
    """The first meta.num_kept[b] of tokens [B, w] join row b's token buffer (the rest go to its
    scratch column); seq_lens += num_kept."""
    S = meta.token_buffer.shape[1]
    columns = torch.arange(tokens.shape[1], device=meta.device)  # [w]
    write = columns[None, :] < meta.num_kept[:, None]  # [B, w]
    positions = torch.where(write, meta.seq_lens[:, None] + columns, S - SCRATCH_COLUMNS)  # [B, w]
    meta.token_buffer.scatter_(1, positions, tokens)
    meta.seq_lens.add_(meta.num_kept)


def read_step(proposal: Proposal, verdict: Verdict) -> Tuple[List[List[int]], List[int], List[int]]:
    """The step's one host read: per row [num_accepted, num_draft, tokens...] ([B, 2 + n+1]), and the
    accepted and drafted counts as lists. Row b emits host[b][2: 3 + num_accepted[b]]."""
    host = torch.cat([verdict.num_accepted[:, None].long(), proposal.num_draft[:, None].long(), verdict.tokens],
                     dim=1).tolist()
    return host, [r[0] for r in host], [r[1] for r in host]


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


class DecodeSteps:
    """The draft, verify and commit steps of one decode call: CUDA graphs (cuda_graphs.StepGraph) when
    ``graphs``, plain calls otherwise. Under graphs the proposal and the verdict are the same static
    buffers at every replay; ``budget`` (adaptive k, eager only) is read when the draft step runs.
    ``backend`` is for tests (a fake CUDAGraph on the CPU)."""

    def __init__(self, target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata,
                 verifier: Verifier, *, graphs: bool, backend=None):
        self.budget: Optional[List[int]] = None
        self.proposal: Proposal = meta.no_drafts
        self.verdict: Optional[Verdict] = None

        def draft_step():
            self.proposal = draft(drafter, meta, self.budget)

        def verify_step():
            self.verdict = verify(target, meta, self.proposal, verifier)

        def commit_step():
            commit(target, drafter, meta, self.verdict)

        def graph(fn, name, enabled):
            return StepGraph(fn, name=name, enabled=graphs and enabled, backend=backend)

        self.draft = graph(draft_step, "draft", drafter is not None)
        self.verify = graph(verify_step, "verify", True)
        self.commit = graph(commit_step, "commit", True)

    @property
    def captured(self) -> Dict[str, bool]:
        return {g.name: g.captured for g in (self.draft, self.verify, self.commit)}


def chainable(target: ModelRunner, meta: SpecDecodeMetadata, cuda_graphs: bool, sync: Optional[RankSync]) -> bool:
    """Whether greedy plain decoding can run as chains here: every row greedy, a runner that chains
    (LeanLlamaRunner on the CPU kernels, nothing hooked on its head), eager steps, one rank."""
    return meta.all_greedy and not cuda_graphs and sync is None and getattr(target, "chains_greedy", False)


def chains_plain(target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata, cuda_graphs: bool,
                 sync: Optional[RankSync]) -> bool:
    """Whether plain decoding runs as greedy chains (``plain_chains``): no drafter, and ``chainable``."""
    return drafter is None and chainable(target, meta, cuda_graphs, sync)


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


def plain_segment(target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata,
                  rows: List[RowState], stop: StopCriteria) -> Tuple[List[List[int]], int]:
    """Adaptive k switched speculation off for every row where the loop can chain (``chainable``): one
    ``greedy_chain`` call of ``chain_length`` one-token passes from each row's pending token, as
    ``plain_chains`` runs them; the unfinished rows keep every pass's token, in the target cache and in
    the token buffer, as a step's commit keeps them, and the frozen rows keep nothing; the drafter
    skipped those steps (``skip_drafter``). Returns (the argmaxes [B][n] before the stop checks, n);
    n = 0 (nothing run) when the cache has no room for a pass."""
    B = len(rows)
    active = [not r.finished for r in rows]
    n = chain_length(target, rows, stop)
    if n < 1:
        return [], 0
    lengths = None if all(active) else target.lengths.clone()  # [B]
    chain = torch.empty((B, n + 1), dtype=torch.int64)  # [B, 1 + n]: pending, then n argmaxes
    chain[:, 0] = meta.pending_tokens()[:, 0].cpu()
    target.greedy_chain(chain, n + 1, check_logits=True)
    if lengths is None:
        meta.num_kept.fill_(n)
    else:
        meta.num_kept.copy_(torch.tensor([n if a else 0 for a in active], dtype=torch.int64))
        target.truncate(lengths + meta.num_kept.to(lengths.device))
    append_tokens(meta, chain[:, 1:].to(meta.device))
    if drafter is not None:
        skip_drafter(drafter, meta, n)
    return chain[:, 1:].tolist(), n


def timed_segment(target: ModelRunner, drafter: Optional[Drafter], meta: SpecDecodeMetadata, rows: List[RowState],
                  stop: StopCriteria, stats: GenerationStats, adaptive: AdaptiveK,
                  host: HostTime) -> Tuple[List[List[int]], int]:
    """``plain_segment``, timed for the stats and for adaptive k (its time per pass, the host time since
    the previous step included), then the stop checks. Returns (each row's new tokens, passes)."""
    active = [not r.finished for r in rows]
    t0 = host.timer.now()
    emitted, passes = plain_segment(target, drafter, meta, rows, stop)
    if not passes:
        return [], 0
    t1 = host.timer.now()
    stats.verify_time += t1 - t0
    adaptive.observe_plain(passes, t1 - t0 + host.since(t0), active)
    host.end(t1)
    return stop_passes(rows, emitted, stop, stats), passes


def skip_drafter(drafter: Drafter, meta: SpecDecodeMetadata, steps: int) -> None:
    """The drafter's side of ``steps`` plain steps that ran without it (meta.num_kept and the token
    buffer already hold their tokens): ``skip`` per step, then one ``commit`` of a verdict that accepted
    nothing (a model drafter leaves its cache as it is and feeds the tokens at its next proposal; the
    n-gram drafter indexes them now)."""
    for _ in range(steps):
        drafter.skip(meta)
    meta.num_accepted.zero_()
    drafter.commit(meta, Verdict(meta.output_tokens, meta.num_accepted))


# ------------------------------------------------------------------------------------------ probes
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


# ------------------------------------------------------------------------------------------ loop
@torch.no_grad()  # applied per resumption of the generator: the caller's grad mode is untouched
def decode(target: ModelRunner, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]], seeds: torch.Tensor,
           stop: StopCriteria, *, slots: int, sampling: SamplingParams, max_seq_len: int, cuda_graphs: bool = False,
           adaptive: Optional[AdaptiveK] = None, verifier: Verifier = lossless_verify,
           stats: Optional[GenerationStats] = None, rows: Optional[List[RowState]] = None, cost_probe: bool = True,
           sync: Optional[RankSync] = None, graph_backend=None) -> Iterator[List[List[int]]]:
    """Run the loop; yields, after the prefill and after every step, the new tokens of each row.

    ``drafter=None`` (``slots=0``) is plain decoding over the same runner and sampler (the baseline).
    ``adaptive`` (``slots`` = its k_max): every step it gives each row a draft budget 0..slots and the
    target pass is only as wide as the largest budget + 1 (steps run eagerly). A tree drafter
    (``drafter.is_tree``) proposes ``slots`` nodes. ``rows`` (one RowState per prompt; rows already
    finished, e.g. the padding of a CUDA-graph bucket, stay frozen and emit nothing) receives the
    returned tokens and finish reasons; ``stats`` the measurements. seeds [B] int64; ``max_seq_len`` is S.
    ``sync`` (a tensor-parallel target, distributed.py): every rank takes rank 0's first tokens, proposals
    and verdicts.
    """
    B = len(prompts)
    timer = Timer(seeds.device)
    stats = stats if stats is not None else GenerationStats(k=slots, batch_size=B)
    rows = rows if rows is not None else [RowState() for _ in range(B)]
    tree = drafter is not None and drafter.is_tree
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=slots, max_seq_len=max_seq_len, sampling=sampling,
                                       seeds=seeds, tree=tree)
    segments = adaptive is not None and drafter is not None and not tree and chainable(target, meta, cuda_graphs, sync)
    drafter_prefill = DrafterPrefill(drafter, meta, timer, stats, deferred=segments, adaptive=adaptive)
    start = timer.now()
    with nvtx_range("prefill"):
        prefill(target, None if segments else drafter, prompts, meta)
    if sync is not None:
        sync.tokens(meta.token_buffer)
    first = meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0].tolist()
    new = [[] if rows[b].finished else apply_stops(rows[b], [first[b]], stop) for b in range(B)]
    stats.prefill_time = timer.now() - start
    stats.new_tokens = sum(len(n) for n in new)
    yield new
    running = not all(r.finished for r in rows)
    if cost_probe and drafter is not None and running:
        probe_start = timer.now()
        stats.target_step_time = probe_target_step(target, meta, timer)
        start += timer.now() - probe_start  # the probes are not part of the run
    if adaptive is not None and drafter is not None and not tree:  # (a tree drafter: fixed budget)
        start += start_adaptive(adaptive, target, drafter, meta, timer, running, segments, drafter_prefill)
    else:
        adaptive = None

    if chains_plain(target, drafter, meta, cuda_graphs, sync):
        yield from plain_chains(target, meta, rows, stop, stats, timer)
        stats.total_time = timer.now() - start
        return

    steps = DecodeSteps(target, drafter, meta, verifier, graphs=cuda_graphs, backend=graph_backend)
    step = FIRST_DECODE_STEP
    host = HostTime(timer if adaptive is not None else None)
    while not all(r.finished for r in rows):
        active = [not r.finished for r in rows]
        meta.active.copy_(torch.tensor(active))
        meta.set_step(step)
        steps.budget = (adaptive.plan(active, tokens_left(rows, stop), drafter_prefill.pending())
                        if adaptive is not None else None)
        if segments and max(steps.budget) == 0:
            new, passes = timed_segment(target, drafter if drafter_prefill.done else None, meta, rows, stop,
                                        stats, adaptive, host)
            if passes:
                step += passes
                yield from host.hand_over(new)
                continue
        if not drafter_prefill.done:
            host.held_since(drafter_prefill.run())  # (the drafter's prefill is not host work between steps)
        t0 = timer.now()
        with nvtx_range("draft"):
            steps.draft()
            if sync is not None:
                sync.proposal(steps.proposal)
        t1 = timer.now()
        with nvtx_range("verify"):
            steps.verify()
            if sync is not None:
                sync.verdict(steps.verdict)
        proposal, verdict = steps.proposal, steps.verdict
        read, num_accepted, num_draft = read_step(proposal, verdict)
        if min(num_accepted) < 0:
            raise_for_row_status("tree_verify" if tree else "chain_verify", verdict.num_accepted)
        with nvtx_range("commit"):
            steps.commit()
        t2 = timer.now()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        outcome = StepOutcome.of(num_accepted, num_draft, active)
        stats.record_step(outcome)
        if adaptive is not None:
            adaptive.observe(steps.budget, outcome, draft_time=t1 - t0, verify_time=t2 - t1,
                             drafted=max(steps.budget, default=0), width=proposal.verify_width(),
                             host_time=host.since(t0))
            host.end(t2)
        new = [apply_stops(rows[b], read[b][2: 3 + num_accepted[b]], stop) if active[b] else [] for b in range(B)]
        stats.new_tokens += sum(len(n) for n in new)
        step += 1
        yield from host.hand_over(new)
    stats.total_time = timer.now() - start
    if adaptive is not None:
        stats.adaptive = adaptive.finish()


def tokens_left(rows: List[RowState], stop: StopCriteria) -> int:
    """The most tokens an unfinished row may still emit (max_new_tokens bounds them)."""
    return max(stop.max_new_tokens - len(r.tokens) for r in rows if not r.finished)


class DrafterPrefill:
    """The drafter's prefill, run by ``prefill`` at the start, or ``deferred`` (adaptive k where it runs
    plain chain segments) until the loop first needs the drafter, so that a generation that never
    speculates never pays for it. A deferred prefill feeds every committed token but the pending one,
    what ``prefill`` gives it at the start; its time counts as prefill time, and adaptive k learns its
    cost per token (``AdaptiveK.record_prefill``)."""

    def __init__(self, drafter: Optional[Drafter], meta: SpecDecodeMetadata, timer: Timer,
                 stats: GenerationStats, deferred: bool, adaptive: Optional[AdaptiveK]):
        self.drafter, self.meta, self.timer, self.stats, self.adaptive = drafter, meta, timer, stats, adaptive
        self.done = not deferred

    def pending(self) -> int:
        """Tokens a prefill now would feed (0 once done)."""
        return 0 if self.done else int(self.meta.seq_lens.sum()) - self.meta.batch_size

    def run(self) -> float:
        """Prefill the drafter now (at most once); returns when it started (``timer.now()``)."""
        begin = self.timer.now()
        if not self.done:
            tokens = self.pending()
            self.done = True
            lengths = self.meta.seq_lens.tolist()
            buffer = self.meta.token_buffer.cpu()  # [B, S]
            with nvtx_range("prefill"):
                self.drafter.prefill([buffer[b, : lengths[b] - 1].tolist() for b in range(len(lengths))], self.meta)
            seconds = self.timer.now() - begin
            self.stats.prefill_time += seconds
            if self.adaptive is not None:
                self.adaptive.record_prefill(seconds, tokens)
        return begin


def start_adaptive(adaptive: AdaptiveK, target: ModelRunner, drafter: Drafter, meta: SpecDecodeMetadata,
                   timer: Timer, running: bool, segments: bool, drafter_prefill: DrafterPrefill) -> float:
    """adaptive.start (``segments``: the loop runs plain chain segments when no row drafts) and the
    start-up probes it asks for (``probe_costs``, ``probe_plain_chain``); a draft probe proposes, so the
    drafter's deferred prefill runs first. Returns the probes' seconds (not part of the run)."""
    begin = timer.now()
    request = adaptive.start(meta.batch_size, getattr(target, "model", None), drafter_key(drafter), probe=running,
                             plain_chain=PLAIN_CHAIN_TOKENS if segments else 0)
    if request.draft_counts and not drafter_prefill.done:
        prefill_start = drafter_prefill.run()
        begin += timer.now() - prefill_start  # (part of the run)
    verify_times, draft_times = probe_costs(target, drafter, meta, request, timer, adaptive.probe_passes)
    plain = (probe_plain_chain(target, meta, request.plain_passes, timer, adaptive.probe_passes)
             if request.plain_passes else None)
    adaptive.record_probes(verify_times, draft_times, plain)
    return timer.now() - begin


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
