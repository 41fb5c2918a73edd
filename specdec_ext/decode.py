"""The speculative decode loop, readable in one sitting.

    prefill   target.start(prompts) -> logits at each prompt's last position; the first new token is
              sampled from them (chain_verify with no drafts); the drafter prefills its own cache
    repeat    draft   drafter.propose(meta)          -> draft_token_ids [B, k], draft_probs [B, k, V]
              verify  target.forward([pending, drafts]) -> logits [B, k+1, V]; chain_verify -> the
                      accepted drafts then the recovered/bonus token, output_tokens [B, k+1]
              commit  target keeps pending + accepted (num_accepted + 1 tokens); the emitted tokens go
                      into token_buffer; the drafter rolls back its cache
              stop    per row on the host: EOS inside the emitted run (the row ends there, inclusive),
                      max_new_tokens (exact), stop strings; finished rows are frozen (commit nothing)

B rows, k drafts, V vocabulary, S cache positions. The *pending* token of a row is its last emitted
token: committed to the token buffer but not yet to the target cache (the next verify pass feeds it
first, so its logits score draft 1). Every per-step tensor lives in ``SpecDecodeMetadata`` and is
allocated once; the loop reads one small host copy per step (accepted counts and tokens, for the
stop checks and the stats).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from . import cuda_graphs, ops
from .adaptive import AdaptiveK, widen_logits
from ._status import raise_for_row_status
from .drafters import Drafter
from .metadata import SamplingParams, SpecDecodeMetadata
from .profiling import nvtx_range
from .stats import GenerationStats, Timer, median_time

FIRST_DECODE_STEP = 1  # Philox step 0 samples the first token from the prefill logits
COST_PROBE_PASSES = 3  # plain one-token target passes timed after prefill for the cost model
SCRATCH_COLUMNS = 1  # token_buffer's last column absorbs masked-out writes of the commit scatter

Verifier = Callable[[SpecDecodeMetadata, torch.Tensor], None]


def chain_verifier(meta: SpecDecodeMetadata, target_logits: torch.Tensor) -> None:
    """The lossless verifier: chain_verify into meta.output_tokens / meta.num_accepted.

    target_logits [B, k+1, V]
    """
    ops.chain_verify(
        target_logits, meta.draft_token_ids, meta.draft_probs,
        num_draft=meta.num_draft, temperature=meta.temperature, top_k=meta.top_k, top_p=meta.top_p,
        seed=meta.seed, offset=meta.verify_offset,
        out=(meta.output_tokens, meta.num_accepted), check_status=False,
    )


def tree_verifier(meta: SpecDecodeMetadata, target_logits: torch.Tensor) -> None:
    """The lossless tree verifier: tree_verify into meta.tree_path / meta.output_tokens /
    meta.num_accepted; with meta.draft_probs (sampled candidates, [B, N, V]) recursive rejection
    sampling, without it (None) the deterministic-candidate rule.

    target_logits [B, N+1, V]
    """
    ops.tree_verify(
        target_logits, meta.draft_token_ids, meta.tree_parents, meta.draft_probs,
        temperature=meta.temperature, top_k=meta.top_k, top_p=meta.top_p,
        seed=meta.seed, offset=meta.verify_offset,
        out=(meta.tree_path, meta.output_tokens, meta.num_accepted), check_status=False,
    )


def required_cache_len(max_prompt_len: int, max_new_tokens: int, k: int) -> int:
    """Cache positions a row needs. A row commits at most k+1 tokens per step, so it ends with at most
    prompt + max_new_tokens + k committed (the excess is cut on the host); once finished it is frozen
    but still takes part in each step with k+1 tentative tokens. Plus the token buffer's scratch column.
    """
    return max_prompt_len + max_new_tokens + 2 * (k + 1) + SCRATCH_COLUMNS


# ------------------------------------------------------------------------------------------ stops
@dataclass
class StopCriteria:
    """Host-side stop checks. ``decode_text`` maps token ids to text (needed for stop strings)."""

    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    decode_text: Optional[Callable[[List[int]], str]] = None


@dataclass
class RowState:
    """What the host knows of one row: its returned tokens and why it stopped."""

    tokens: List[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None  # "eos", "length", "stop"
    stop_text_end: Optional[int] = None  # with "stop": the text ends here (the stop string excluded)


def apply_stops(row: RowState, new_tokens: List[int], stop: StopCriteria) -> List[int]:
    """Append ``new_tokens`` to a row up to the first stop; returns the tokens actually appended."""
    kept: List[int] = []
    for token in new_tokens:
        if len(row.tokens) + len(kept) >= stop.max_new_tokens:
            break
        kept.append(token)
        if token in stop.eos_token_ids:
            row.finished, row.finish_reason = True, "eos"
            break
    start = len(row.tokens)
    row.tokens.extend(kept)
    if stop.stop_strings and kept:
        cut = _find_stop_string(row, start, stop)
        if cut is not None:
            kept = kept[: max(0, cut - start)]
    if not row.finished and len(row.tokens) >= stop.max_new_tokens:
        row.finished, row.finish_reason = True, "length"
    return kept


def _find_stop_string(row: RowState, start: int, stop: StopCriteria) -> Optional[int]:
    """If a stop string now occurs in the row's text: cut the row's tokens after the token that
    completes it, mark the row finished and return the new token count; else None."""
    text = stop.decode_text(row.tokens)
    longest = max(len(s) for s in stop.stop_strings)
    search_from = max(0, len(stop.decode_text(row.tokens[:start])) - longest)
    hits = [(text.find(s, search_from), s) for s in stop.stop_strings]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None
    index, string = min(hits)
    end = index + len(string)
    count = start + 1
    while count < len(row.tokens) and len(stop.decode_text(row.tokens[:count])) < end:
        count += 1
    del row.tokens[count:]
    row.finished, row.finish_reason, row.stop_text_end = True, "stop", index
    return count


# ------------------------------------------------------------------------------------------ steps
def prefill(target, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
    """Fill both caches with the prompts and sample the first new token (the first pending token)."""
    B = len(prompts)
    logits = target.start(prompts)  # [B, V]
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    meta.prompt_lens.copy_(lengths)
    for b, p in enumerate(prompts):
        meta.token_buffer[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
    meta.set_step(0)
    first = torch.empty((B, 1), dtype=torch.int64, device=logits.device)  # [B, 1]
    status = torch.empty((B,), dtype=torch.int32, device=logits.device)  # [B]
    no_drafts = torch.empty((B, 0), dtype=torch.int64, device=logits.device)  # [B, 0]
    ops.chain_verify(logits.unsqueeze(1).contiguous(), no_drafts, None, temperature=meta.temperature,
                     top_k=meta.top_k, top_p=meta.top_p, seed=meta.seed, offset=meta.verify_offset,
                     out=(first, status), check_status=True)
    meta.token_buffer.scatter_(1, meta.prompt_lens[:, None], first)
    meta.seq_lens.copy_(meta.prompt_lens + 1)
    meta.num_generated.fill_(1)
    if drafter is not None:
        drafter.prefill(prompts, meta)


def draft(drafter: Optional[Drafter], meta: SpecDecodeMetadata) -> None:
    """Propose k tokens per row into meta.draft_token_ids [B, k] (and meta.draft_probs [B, k, V]).

    Without a drafter (k = 0) the loop is plain decoding: one sampled token per target pass.
    With adaptive k, meta.draft_budget (host, per row) caps the drafts; a budget of 0 for every row
    skips the drafter (``drafter.skip``) and the step is plain decoding for the batch."""
    if drafter is None:
        return
    if meta.draft_budget is not None and max(meta.draft_budget, default=0) == 0:
        meta.num_draft.zero_()
        drafter.skip(meta)
        return
    drafter.propose(meta)


def verify(target, meta: SpecDecodeMetadata, verifier: Verifier) -> None:
    """One target pass over [pending, drafts] [B, k+1] and the verifier -> meta.output_tokens [B, k+1]."""
    pending = torch.gather(meta.token_buffer, 1, (meta.seq_lens - 1)[:, None])  # [B, 1]
    meta.target_input[:, :1].copy_(pending)
    meta.target_input[:, 1:].copy_(meta.draft_token_ids)
    meta.target_num_tokens.copy_(meta.num_draft.to(torch.int64) + 1)
    tree = {} if meta.tree_parents is None else {"tree_parents": meta.tree_parents}  # [B, N] int32
    # adaptive k (meta.draft_budget set): the pass covers only the first max(draft_budget) + 1 columns
    # (every num_draft[b] <= draft_budget[b]); the logits are widened into a static [B, k+1, V] buffer
    width = meta.verify_width
    logits = target.forward(meta.target_input[:, :width], meta.target_num_tokens, **tree)  # [B, width, V]
    if width < meta.k + 1:
        logits = widen_logits(meta, logits)  # [B, k+1, V]
    verifier(meta, logits)


def commit(target, drafter: Optional[Drafter], meta: SpecDecodeMetadata) -> None:
    """Commit pending + accepted tokens of the active rows; frozen rows keep nothing."""
    S = meta.token_buffer.shape[1]
    emitted = meta.num_accepted.to(torch.int64) + 1  # [B]
    meta.num_kept.copy_(torch.where(meta.active, emitted, torch.zeros_like(emitted)))
    if meta.tree_parents is None:
        target.commit(meta.num_kept)
    else:  # tree: keep pending + the accepted path (kv_compact), then roll frozen rows back
        before = target.lengths.clone()  # [B]
        target.commit_tree(meta.tree_path, meta.num_accepted)
        target.truncate(before + meta.num_kept.to(before.device))
    columns = torch.arange(meta.k + 1, device=meta.seq_lens.device)  # [k+1]
    write = columns[None, :] < meta.num_kept[:, None]  # [B, k+1]
    positions = torch.where(write, meta.seq_lens[:, None] + columns, S - SCRATCH_COLUMNS)  # [B, k+1]
    meta.token_buffer.scatter_(1, positions, meta.output_tokens)
    meta.seq_lens.add_(meta.num_kept)
    meta.num_generated.add_(meta.num_kept)
    if drafter is not None:
        drafter.accept(meta)


def probe_target_step(target, meta: SpecDecodeMetadata, timer: Timer) -> float:
    """Median time of one plain decode step (one-token target pass, sampling, commit): the cost
    model's unit. Each probe step is rolled back (truncate), so the caches are left as they were."""
    B = meta.batch_size
    pending = torch.gather(meta.token_buffer, 1, (meta.seq_lens - 1)[:, None])  # [B, 1]
    lengths = target.lengths.clone()  # [B]
    one = torch.ones_like(meta.seq_lens)  # [B]
    token = torch.empty((B, 1), dtype=torch.int64, device=pending.device)  # [B, 1]
    status = torch.empty((B,), dtype=torch.int32, device=pending.device)  # [B]
    no_drafts = torch.empty((B, 0), dtype=torch.int64, device=pending.device)  # [B, 0]

    def plain_step():
        logits = target.forward(pending)  # [B, 1, V]
        ops.chain_verify(logits, no_drafts, None, temperature=meta.temperature, top_k=meta.top_k,
                         top_p=meta.top_p, seed=meta.seed, offset=meta.verify_offset, out=(token, status),
                         check_status=False)
        token.tolist()
        target.commit(one)

    return median_time(timer, plain_step, lambda: target.truncate(lengths), COST_PROBE_PASSES)


# ------------------------------------------------------------------------------------------ loop
@torch.no_grad()  # applied per resumption of the generator: the caller's grad mode is untouched
def decode(target, drafter: Optional[Drafter], prompts: Sequence[Sequence[int]], *, k: int, sampling: SamplingParams,
           seeds: torch.Tensor, stop: StopCriteria, max_seq_len: int, vocab_size: int,
           verifier: Verifier = chain_verifier, stats: Optional[GenerationStats] = None,
           rows: Optional[List[RowState]] = None, cost_probe: bool = True,
           adaptive: Optional[AdaptiveK] = None) -> Iterator[List[List[int]]]:
    """Run the loop; yields, after the prefill and after every step, the new tokens of each row.

    ``drafter=None`` with ``k=0`` is plain decoding over the same runner and sampler (the baseline).
    ``adaptive`` (specdec_ext/adaptive.py, ``k`` = its k_max): each step it gives every row a draft
    budget 0..k and the target pass is only as wide as the largest budget + 1 (steps run eagerly).
    A drafter with ``is_tree = True`` proposes a tree of k nodes (meta.tree_parents); the loop then
    verifies with :func:`tree_verifier` (unless ``verifier`` is given) and commits with commit_tree.
    ``rows`` (one RowState per prompt) receives the returned tokens and finish reasons; ``stats``
    the measurements. seeds [B] int64.
    """
    real = len(prompts)
    device = seeds.device
    timer = Timer(device)
    stats = stats if stats is not None else GenerationStats(k=k, batch_size=real)
    rows = rows if rows is not None else [RowState() for _ in range(real)]
    # CUDA graphs: a static target runner gets the batch padded to its bucket with frozen rows
    prompts, seeds, rows = cuda_graphs.maybe_pad(target, prompts, seeds, rows, row_factory=RowState)
    B = len(prompts)
    meta = SpecDecodeMetadata.allocate(batch_size=B, k=k, max_seq_len=max_seq_len, vocab_size=vocab_size,
                                       sampling=sampling, seeds=seeds, device=device)
    tree = bool(getattr(drafter, "is_tree", False))
    if tree:
        meta.enable_tree()
        verifier = tree_verifier if verifier is chain_verifier else verifier
    start = timer.now()
    with nvtx_range("prefill"):
        prefill(target, drafter, prompts, meta)
    first = meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0].tolist()
    new = [apply_stops(rows[b], [first[b]], stop) if b < real else [] for b in range(B)]
    stats.prefill_time = timer.now() - start
    stats.new_tokens = sum(len(n) for n in new)
    yield new[:real]
    if cost_probe and drafter is not None and not all(r.finished for r in rows):
        probe_start = timer.now()
        stats.target_step_time = probe_target_step(target, meta, timer)
        start += timer.now() - probe_start  # the probe is not part of the run
    if adaptive is not None and drafter is not None and not tree:  # (a tree drafter: fixed budget)
        probe_start = timer.now()  # forget the rows; V(t) probed at a few widths (rolled back) once per process
        adaptive.start(target, drafter, meta, timer, probe=not all(r.finished for r in rows))
        start += timer.now() - probe_start
    else:
        adaptive = None

    # draft / verify / commit: CUDA graphs over meta's static buffers on CUDA, eager elsewhere
    # (trees and adaptive k vary the shapes per step: eager; graphs per width bucket would be next)
    steps = cuda_graphs.DecodeSteps(target, drafter, meta, verifier, draft_step=draft, verify_step=verify,
                                    commit_step=commit, enabled=False if tree or adaptive is not None else None)
    step = FIRST_DECODE_STEP
    while not all(r.finished for r in rows):
        active = [not r.finished for r in rows]
        meta.active.copy_(torch.tensor(active))
        meta.set_step(step)
        budget = meta.draft_budget = adaptive.plan(active) if adaptive is not None else None
        t0 = timer.now()
        with nvtx_range("draft"):
            steps.draft()
        t1 = timer.now()
        with nvtx_range("verify"):
            steps.verify()
        num_accepted = meta.num_accepted.tolist()  # the step's one host read
        if min(num_accepted) < 0:
            raise_for_row_status("tree_verify" if tree else "chain_verify", meta.num_accepted)
        with nvtx_range("rollback"):
            steps.commit()
        emitted = meta.output_tokens.tolist()
        t2 = timer.now()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        num_draft = meta.num_draft.tolist()
        stats.record_step(num_accepted, num_draft, active)
        if adaptive is not None:
            adaptive.observe(budget, num_draft, num_accepted, active, draft_time=t1 - t0, verify_time=t2 - t1,
                             drafted=max(budget, default=0), width=meta.verify_width)
        new = [apply_stops(rows[b], emitted[b][: num_accepted[b] + 1], stop) if active[b] else []
               for b in range(B)]
        stats.new_tokens += sum(len(n) for n in new)
        step += 1
        yield new[:real]
    stats.total_time = timer.now() - start
    steps.finish(target, drafter)
    if adaptive is not None:
        stats.adaptive = adaptive.finish()
