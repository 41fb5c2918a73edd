"""ModelDrafter: a small HF causal LM proposes k tokens per row over its own model runner.

Per step (shapes: B rows, k drafts, V the target's vocabulary, V_d the draft model's):

1. feed the committed tokens the draft has not seen (1 or 2 per row: the recovered/bonus token, and
   the last draft token when all k were accepted; after steps adaptive k skipped, ``catch_up`` first
   feeds each row all but its last one, row by row where one block would not fit every row's cache)
   -> logits at the last fed position   [B, V_d]
2. k times: filter like the target (softmax(l / T), top-k, top-p, renormalised) -> q   [B, V]
   sample with Philox uniforms u[:, i] by inverse CDF (greedy: argmax, q not needed)
   feed the sampled token (except after the last one)
3. commit (after verification): truncate the draft cache to the tokens it fed that were committed.

A windowed prefill (``prefill_window``, adaptive k's first look at a prompt, decode.py ``DrafterPrefill``)
gives the draft model only the last ``window`` tokens of each prompt: row b's cache then starts at
committed position ``offsets[b]`` (its positions count from 0 there: a rotary model sees the same
relative positions), and every comparison of the cache's length with the committed length adds it.

A context window (``context_window`` W: a draft model trained on W-token sequences, whose config says so as
``specdec_draft_window``, ``draft_window_of``) keeps every row's draft cache within W tokens: its prefill
(and a serving row's start) feeds the last W // 2 committed tokens, and a row whose cache could pass W in
the next step is prefilled again from its last W // 2 committed tokens, between steps (``_keep_windows``,
and ``catch_up`` / ``look`` after plain stretches, where that is cheaper than feeding the arrears).
Beyond its trained length a rotary draft extrapolates and its acceptance falls (the bundled draft, trained
on 256 tokens: 1.9 against 2.9 tokens per pass at k = 4 on a 464-token prompt, BENCHMARKS.md), and
the window bounds the draft prefill that switching speculation on costs (adaptive k) to W // 2 tokens a row.
A re-windowed row proposes exactly what a drafter prefilled with those tokens would. Device steps
(serving under CUDA graphs: between ``reserve_step`` and ``sync_host``) never re-window; there a row
keeps the window it started with and grows past it, but for the catch-ups between steps.

Vocabularies padded to different sizes are reconciled here: draft logits beyond the target's V are
dropped, missing ones are -inf (never proposed). A target id past the draft's embedding (a padding id the
target emitted) is fed to the draft as another id (build.py wraps the runner: runners/in_range.py).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from ..processing import ProcessingState
from ..runners import ModelRunner
from .base import Drafter

MAX_DRAFT_FEED = 2  # committed tokens a model drafter may not have seen: the bonus/recovered token and,
# when every draft was accepted, the last draft token (which it proposed but never fed)

RunnerFactory = Callable[..., ModelRunner]  # (max_batch_size=, max_seq_len=) -> the draft model's runner

# The draft model's config attribute that declares its context window (the sequence length it was trained on)
DRAFT_WINDOW_ATTRIBUTE = "specdec_draft_window"


def draft_window_of(model) -> Optional[int]:
    """The context window a draft model declares (``config.specdec_draft_window``), or None (the whole
    context). The bundled draft declares the 256 tokens it was trained on (default_pair)."""
    value = getattr(getattr(model, "config", None), DRAFT_WINDOW_ATTRIBUTE, None)
    return _checked_window(value, f"the draft model's config.{DRAFT_WINDOW_ATTRIBUTE} must be an int >= 2 (the "
                                  f"tokens it was trained on)")


def _checked_window(value, requirement: str) -> Optional[int]:
    """``value`` (None, or an int >= 2), else ValueError(``requirement``, got value)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
        raise ValueError(f"{requirement}, got {value!r}")
    return value


def window_for(context_window: Optional[int], k: int) -> Optional[int]:
    """The window a drafter of ``k`` drafts keeps (None: none): at least 2 (k + MAX_DRAFT_FEED) tokens, so
    that a re-windowed row (W // 2 tokens) drafts some steps before it needs the next one."""
    if _checked_window(context_window, "context_window must be None or an int >= 2") is None:
        return None
    return max(context_window, 2 * (k + MAX_DRAFT_FEED))


class ModelDrafter(Drafter):
    """A HF draft model behind a model runner made by ``runner_factory(max_batch_size=, max_seq_len=)``."""

    device_steps = True  # proposes on the device (needs a runner with device steps: the paged one in host mode)
    deferrable_start = True
    windowed_prefill = True
    greedy_looks = True

    def __init__(self, model, runner_factory: RunnerFactory, *, k: int, vocab_size: int,
                 confidence_threshold: float = 0.0, context_window: Optional[int] = None):
        self.model = model
        # A row stops drafting after a token the draft itself gives probability below this (its own
        # distribution q, or softmax(l) when greedy): such tokens are usually rejected, so the draft
        # forwards after them are mostly wasted. 0 = off (always k). The rows' num_draft then differ;
        # the decision depends on the draft alone, so verification stays lossless.
        self.confidence_threshold = float(confidence_threshold)
        self.runner_factory = runner_factory
        self.slots = int(k)
        self.vocab_size = int(vocab_size)  # the target's V: proposals and q rows live in it
        self.runner: Optional[ModelRunner] = None
        self.greedy_chains = False  # the draft runner drafts a greedy chain in one call (greedy_chain)
        self.extends_rows = False  # the draft runner appends tokens to chosen rows (extend_rows: catch_up)
        self.token_ids: Optional[torch.Tensor] = None  # the proposal buffers, made for the loop's rows
        self._fed_drafts = 0  # draft tokens fed to the draft cache in the last propose (<= k - 1)
        self._skipped = False  # adaptive k skipped a step since the last feed: catch_up feeds what it committed
        self._skipped_step = False  # the last step was skipped (commit leaves the cache as it is)
        # the tokens a row's draft cache may hold (None: all; module docstring), and those it keeps
        self.context_window = window_for(context_window, self.slots)
        self.window_keep = None if self.context_window is None else self.context_window // 2
        self._window_check_in = 0  # proposes before a row's cache can come near the window (no read till then)
        self._probing = False  # between checkpoint() and its undo: no re-windowing
        self._device_step = False  # between reserve_step and sync_host: the pages are reserved, no re-windowing

    # ------------------------------------------------------------------ lifecycle
    def _ensure_runner(self, batch: int, seq_len: int) -> None:
        if self.runner is None or self.runner.max_batch_size < batch or self.runner.max_seq_len < seq_len:
            self.runner = self.runner_factory(max_batch_size=batch, max_seq_len=seq_len)
            # the runner's declared capabilities (the plan's draft_capabilities), read once
            self.greedy_chains = self.runner.capabilities.greedy_chain
            self.extends_rows = self.runner.capabilities.chunked_prefill

    def prepare(self, meta: SpecDecodeMetadata) -> None:
        self._ensure_runner(*meta.token_buffer.shape)

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        if self.window_keep is not None and max(map(len, prompts), default=0) > self.window_keep:
            return self.prefill_window(prompts, meta, self.window_keep)
        self._prepare(meta)
        self.runner.start([list(p) for p in prompts])  # the draft's prompt logits are not needed

    def prefill_tokens(self, lengths: Sequence[int]) -> int:
        """(``Drafter.prefill_tokens``) The whole prefill feeds a row its window's last half at most."""
        if self.window_keep is None:
            return sum(lengths)
        return sum(min(n, self.window_keep) for n in lengths)

    def prefill_window(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata, window: int) -> None:
        """``prefill`` with the last ``window`` tokens of each prompt (at least one); the earlier ones are
        never fed (module docstring)."""
        if window < 1:
            raise ValueError(f"prefill_window: window must be >= 1, got {window}")
        self._prepare(meta)
        cut = [list(p)[-window:] for p in prompts]
        self.runner.start(cut)
        self._offsets[: len(cut)] = torch.tensor([len(p) - len(c) for p, c in zip(prompts, cut)], dtype=torch.int64)
        self._windowed = True
        self._window_check_in = 0

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """Continuous batching: rows join (``meta`` covers every slot; the buffers are made once), with
        the last ``window_keep`` tokens of their prompts where the drafter has a window."""
        if self.token_ids is None or self.token_ids.shape[0] != meta.batch_size:
            self._prepare(meta)
        cut = [list(p) if self.window_keep is None else list(p)[-self.window_keep:] for p in prompts]
        self.runner.start_rows(rows, cut)
        self._offsets[list(rows)] = torch.tensor([len(p) - len(c) for p, c in zip(prompts, cut)], dtype=torch.int64,
                                                 device=self._offsets.device)
        self._window_check_in = 0

    def hold_rows(self, rows: Sequence[int], meta: SpecDecodeMetadata) -> None:
        """(``Drafter.hold_rows``) The draft runner spans ``rows`` with empty caches, no draft forward (one
        per joining row was the speculative server's cost with every step plain)."""
        if self.token_ids is None or self.token_ids.shape[0] != meta.batch_size:
            self._prepare(meta)
        self.runner.hold_rows(rows)
        self._offsets[list(rows)] = 0

    def free_rows(self, rows: Sequence[int]) -> None:
        if self.runner is None:  # (no row has joined the draft yet: a server's first row ended at its prefill)
            return
        self.runner.free_rows(rows)
        self._offsets[list(rows)] = 0  # (a free slot inside the batch feeds as an empty cache)

    def _prepare(self, meta: SpecDecodeMetadata) -> None:
        """The draft runner and the step buffers for the loop's rows."""
        B, S = meta.token_buffer.shape
        device = meta.device
        self._ensure_runner(B, S)
        self._allocate(meta)
        self._feed_columns = torch.arange(MAX_DRAFT_FEED, dtype=torch.int64, device=device)  # [2]
        self._ones = torch.ones((B,), dtype=torch.int64, device=device)  # [B]
        self._rows = torch.arange(B, dtype=torch.int64, device=device)  # [B]
        self._offsets = torch.zeros((B,), dtype=torch.int64, device=device)  # [B] committed position of cache slot 0
        # some offset may be > 0 (prefill_window, a context window): else the steps never read them (a captured
        # step reads them from the start where a window may move them)
        self._windowed = self.context_window is not None
        self._window_check_in = 0
        self._skipped, self._skipped_step = False, False

    def _allocate(self, meta: SpecDecodeMetadata) -> None:
        """The proposal buffers (static: the same storage every step)."""
        B, n, device = meta.batch_size, self.slots, meta.device
        self.token_ids = torch.zeros((B, n), dtype=torch.int64, device=device)  # [B, n]
        self.num_draft = torch.full((B,), n, dtype=torch.int32, device=device)  # [B]
        self.probs = None if meta.all_greedy else self._probs_buffer(B)  # [B, n, V]

    def _probs_buffer(self, batch: int) -> torch.Tensor:
        return torch.zeros((batch, self.slots, self.vocab_size), dtype=torch.float32,
                           device=self.token_ids.device)  # [B, n, V]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] -> [..., V] in the target's vocabulary."""
        v_draft = logits.shape[-1]
        if v_draft == self.vocab_size:
            return logits
        if v_draft > self.vocab_size:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - v_draft), value=-float("inf"))

    def _unseen(self, meta: SpecDecodeMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
        """The committed tokens not yet in the draft cache: (feed [B, W], num_feed [B])."""
        seen = self.runner.lengths.to(meta.device)  # [B] committed positions
        if self._windowed:
            seen = seen + self._offsets[: seen.shape[0]]
        num_feed = meta.seq_lens - seen  # [B], 1..MAX_DRAFT_FEED (catch_up ran after skipped steps)
        columns = self._feed_columns
        # padding columns repeat the last committed token: past it the buffer holds no committed ids
        positions = torch.minimum(seen[:, None] + columns, (meta.seq_lens - 1)[:, None])  # [B, W]
        return torch.gather(meta.token_buffer, 1, positions), num_feed

    def _feed_unseen(self, meta: SpecDecodeMetadata) -> torch.Tensor:
        """Feed the committed tokens not yet in the draft cache; logits at the last one [B, V_d]."""
        feed, num_feed = self._unseen(meta)  # [B, W], [B]
        logits = self.runner.forward(feed, num_feed)  # [B, W, V_d]
        self.runner.commit(num_feed)
        last = (num_feed - 1).clamp(min=0)
        return logits[self._rows[: meta.batch_size], last]

    # ------------------------------------------------------------------ the step
    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        self.catch_up(meta)  # (after skipped steps only: a captured propose never sees any)
        self._keep_windows(meta)
        k, B, greedy = self.slots, meta.batch_size, meta.all_greedy
        steps = k if budget is None else min(k, max(budget, default=0))
        # the loop's rows are the first B of the buffers' (all of them, except under continuous batching)
        token_ids, num_draft, ones = self.token_ids[:B], self.num_draft[:B], self._ones[:B]
        if not greedy and self.probs is None:
            self.probs = self._probs_buffer(self.token_ids.shape[0])
        probs = None if greedy else self.probs[:B]  # [B, k, V]
        if budget is None:
            num_draft.fill_(k)
        elif len(set(budget)) == 1:  # one length for every row: no host data (what a capture can hold)
            num_draft.fill_(min(k, budget[0]))
        else:
            num_draft.copy_(torch.tensor([min(k, b) for b in budget], dtype=torch.int32))
        drafting = torch.ones_like(meta.active) if self.confidence_threshold > 0 else None  # [B] bool
        self._fed_drafts, self._skipped_step = 0, False
        processing = active_processing(meta)
        if greedy and drafting is None and steps >= 1 and self.greedy_chains and processing is None:
            # the lean CPU runner feeds the unseen tokens and drafts the whole chain in one op call, bit
            # for bit the loop below
            feed, num_feed = self._unseen(meta)  # [B, W], [B]
            self.runner.greedy_chain(token_ids, steps, vocab_limit=min(self.runner.vocab_size, self.vocab_size),
                                     feed=feed, feed_counts=num_feed)
            self._fed_drafts = steps - 1
            return Proposal(token_ids, probs, num_draft, longest=None if budget is None else steps)
        logits = self._fit_vocab(self._feed_unseen(meta))  # [B, V]
        uniforms = None if greedy else draft_uniforms(meta, k)  # [k, B, 1]
        counts = processing.draft_counts() if processing is not None else None
        for i in range(steps):
            if processing is not None:  # the draft proposes from its processed q', as the target verifies p'
                logits = processing.apply_draft_step(logits, token_ids[:, :i], meta.temperature, counts)
            if greedy:
                token = logits.argmax(-1)  # [B]
                if drafting is not None:
                    confidence = torch.softmax(logits.float(), -1).amax(-1)  # [B]
            else:
                token = sample_draft(logits, meta, uniforms[i], probs[:, i])  # [B]
                if drafting is not None:
                    confidence = probs[:, i].gather(1, token[:, None])[:, 0]  # [B]
            token_ids[:, i].copy_(token)
            ProcessingState.add_drafted(counts, token)
            if drafting is not None:
                stop = drafting & (confidence < self.confidence_threshold) & meta.active  # [B]
                num_draft.masked_fill_(stop & (num_draft > i + 1), i + 1)
                drafting &= ~stop
                if not bool((drafting & meta.active).any()):  # every live row has stopped drafting
                    break
            if i + 1 < steps:
                logits = self._fit_vocab(self.runner.forward(token[:, None], ones)[:, 0])
                self.runner.commit(ones)
                self._fed_drafts += 1
        return Proposal(token_ids, probs, num_draft, longest=None if budget is None else steps)

    def skip(self, meta: SpecDecodeMetadata) -> None:
        """No draft this step (adaptive k): the next propose feeds the tokens committed meanwhile."""
        self._skipped = True
        self._skipped_step = True

    def _arrears(self, meta: SpecDecodeMetadata) -> Tuple[int, List[int], List[int], List[int]]:
        """(B, each row's draft-cache length, the committed positions it holds, its committed length) of
        the runner's rows: host lists (one read each)."""
        B = self.runner.batch_size
        cached = self.runner.lengths[:B].tolist()
        offsets = self._offsets[:B].tolist() if self._windowed else [0] * B
        return B, cached, [c + o for c, o in zip(cached, offsets)], meta.seq_lens[:B].tolist()

    def catch_up(self, meta: SpecDecodeMetadata) -> None:
        """After skipped steps, feed each row's committed tokens that the draft cache lacks except the last
        one, so that the next propose feeds one token per row, as wide as a propose after a drafting step
        (MAX_DRAFT_FEED columns): what a captured draft pass needs (its feed width is fixed at capture),
        and what keeps a feed as wide as the rows' own arrears, not as the steps skipped (a feed of
        2 + skipped columns outgrew the cache after ~1000 plain steps in serving). Host mode: between
        steps, or at the start of an eager propose (``meta`` covers the runner's rows and more)."""
        if not self._skipped:
            return
        self._skipped = False
        self._window_check_in = 0  # (the skipped steps committed more than a step's worth)
        B, cached, seen, ends = self._arrears(meta)
        rows = [b for b in range(B) if ends[b] - 1 > seen[b]]
        rows = self._rewindow(meta, rows, cached, seen, ends, [0] * B)
        if rows:
            self._append(rows, [meta.token_buffer[b, seen[b]: ends[b] - 1].tolist() for b in rows], cached, meta)

    # ------------------------------------------------------------------ the context window
    def _rewindow(self, meta: SpecDecodeMetadata, rows: List[int], cached: List[int], seen: List[int],
                  ends: List[int], shown: List[int]) -> List[int]:
        """Of ``rows`` about to be fed their committed tokens up to ends[b] - 1 (exclusive; the last
        ``shown[b]`` of them by a look, the others by ``_append``), prefill again those whose cache would
        then leave less than a step's room in the window: with the window_keep committed tokens before
        ends[b] - 1 (the shown ones excluded: the caller feeds those). ``cached``, ``seen`` and ``ends`` are
        ``_arrears``' lists (a row's offset is seen - cached); ``cached`` and ``seen`` are updated for the
        rows prefilled again. Returns the rows left to feed as they are."""
        if self.context_window is None or self._probing or not rows:
            return rows
        room = self.slots + MAX_DRAFT_FEED - 1  # what one step can add to a row's cache
        active = meta.active.tolist()  # (a free or held slot is not active)
        again = [b for b in rows if active[b] and ends[b] - 1 - (seen[b] - cached[b]) + room > self.context_window]
        if not again:
            return rows
        # (at least one token before the shown ones: a prompt is never empty)
        starts = [max(min(ends[b] - 1 - self.window_keep, ends[b] - 2 - shown[b]), 0) for b in again]
        chunks = [meta.token_buffer[b, start: ends[b] - 1 - shown[b]].tolist() for b, start in zip(again, starts)]
        self.runner.free_rows(again)
        self.runner.start_rows(again, chunks)
        self._offsets[again] = torch.tensor(starts, dtype=torch.int64, device=self._offsets.device)
        self._windowed = True
        for b, start, chunk in zip(again, starts, chunks):
            cached[b], seen[b] = len(chunk), start + len(chunk)
        self._window_check_in = 0
        return [b for b in rows if b not in again]

    def _keep_windows(self, meta: SpecDecodeMetadata) -> None:
        """Before a step's draft (eager steps only): prefill again each row whose cache could pass the
        window in this step (``_rewindow``). The rows' lengths are read only when one may be near it: a
        step adds at most k + 1 committed tokens to a row."""
        if self.context_window is None or self._device_step or _capturing(meta):
            return
        if self._window_check_in > 0:
            self._window_check_in -= 1
            return
        B, cached, seen, ends = self._arrears(meta)
        self._rewindow(meta, list(range(B)), cached, seen, ends, [0] * B)
        active = meta.active[:B].tolist()
        longest = max((ends[b] - (seen[b] - cached[b]) for b in range(B) if active[b]), default=0)  # past a cache's start
        step = self.slots + 1
        self._window_check_in = max((self.context_window - (self.slots + MAX_DRAFT_FEED - 1) - longest) // step, 0)

    def look(self, meta: SpecDecodeMetadata, tokens: Sequence[int]) -> List[List[bool]]:
        """(``Drafter.look``) The unseen tokens before the last ``tokens[b]`` are fed as ``catch_up`` feeds
        them, those in one forward whose logits are kept: a first draft from committed position p is the
        argmax of the logits after token p (in the target's vocabulary), which greedy verification accepts
        exactly when it is token p + 1; so a look reads, on the committed text, what drafting from each
        position would have been accepted without a target pass. Needs a prefilled draft (whole or window)."""
        self._skipped = False  # (the look feeds what catch_up would)
        self._window_check_in = 0
        B, cached, seen, ends = self._arrears(meta)
        unseen = [max(ends[b] - 1 - seen[b], 0) for b in range(B)]  # (the pending token is never fed)
        shown = [min(max(int(tokens[b]), 0), unseen[b]) for b in range(B)]
        self._rewindow(meta, [b for b in range(B) if unseen[b] > 0], cached, seen, ends, shown)
        early = [b for b in range(B) if ends[b] - 1 - seen[b] > shown[b]]
        if early:
            self._append(early, [meta.token_buffer[b, seen[b]: ends[b] - 1 - shown[b]].tolist() for b in early],
                         cached, meta)
        width = max(shown, default=0)
        if width == 0:
            return [[] for _ in range(B)]
        feed = torch.zeros((B, width), dtype=torch.int64)  # [B, W]: positions ends - 1 - shown .. ends - 2
        following: List[List[int]] = []  # per row: the committed token after each fed one
        for b in range(B):
            if shown[b]:
                span = meta.token_buffer[b, ends[b] - 1 - shown[b]: ends[b]].tolist()
                feed[b, : shown[b]] = torch.as_tensor(span[:-1], dtype=torch.int64)
                following.append(span[1:])
            else:
                following.append([])
        counts = torch.tensor(shown, dtype=torch.int64, device=meta.device)  # [B]
        logits = self.runner.forward(feed.to(meta.device), counts)  # [B, W, V_d]
        self.runner.commit(counts)
        drafted = self._fit_vocab(logits).argmax(-1).tolist()  # [B][W]
        return [[drafted[b][j] == following[b][j] for j in range(shown[b])] for b in range(B)]

    def _append(self, rows: List[int], chunks: List[List[int]], seen: List[int], meta: SpecDecodeMetadata) -> None:
        """Committed tokens ``chunks[i]`` into the draft cache of ``rows[i]`` (``seen[b]``: row b's cache
        length): extend_rows where the runner has it (in one call where one block fits every row's cache,
        else row by row: a block is as wide as its longest chunk in every row), else one forward with
        per-row counts (the paged runner reserves each row's pages by its count)."""
        if self.extends_rows:
            if max(seen[b] for b in rows) + max(map(len, chunks)) <= self.runner.max_seq_len:
                self.runner.extend_rows(rows, chunks)
            else:
                for row, chunk in zip(rows, chunks):
                    self.runner.extend_rows([row], [chunk])
            return
        B = self.runner.batch_size
        feed = torch.zeros((B, max(map(len, chunks))), dtype=torch.int64)
        counts = torch.zeros((B,), dtype=torch.int64)
        for row, chunk in zip(rows, chunks):
            feed[row, : len(chunk)] = torch.as_tensor(chunk, dtype=torch.int64)
            counts[row] = len(chunk)
        self.runner.forward(feed.to(meta.device), counts.to(meta.device))
        self.runner.commit(counts.to(meta.device))

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Roll the draft cache back to the committed tokens it has fed.

        Before this step the draft had fed seq_len_old tokens plus drafts 1.._fed_drafts; the first
        num_accepted drafts were committed. At least one committed token is always left unfed, so
        the next step has something to feed (frozen rows re-feed their last token). After a skipped
        step (adaptive k) the cache is left as it is.
        """
        if self._skipped_step:
            return
        seq_old = meta.seq_lens - meta.num_kept  # [B]
        accepted = verdict.num_accepted.to(torch.int64).clamp(min=0, max=self._fed_drafts)  # [B]
        valid = torch.minimum(seq_old + accepted, meta.seq_lens - 1)  # [B] committed positions
        self.runner.truncate(valid - self._offsets[: valid.shape[0]] if self._windowed else valid)

    # ------------------------------------------------------------------ device steps (serve/batcher.py)
    def reserve_step(self, width: int, drafts: int) -> None:
        """Continuous batching under CUDA graphs: the draft runner gets the pages one step can write (the
        unseen tokens and drafts - 1 more per row) and runs the step on the device over rows 0..width-1
        (runners/paged.py ``reserve_step``); ``sync_host`` ends it."""
        if not self.runner.capabilities.device_steps:
            raise ValueError(f"device steps need the paged draft runner in host mode, not {type(self.runner).__name__}")
        self.runner.reserve_step(width, MAX_DRAFT_FEED + min(drafts, self.slots) - 1)
        self._device_step = True

    def sync_host(self) -> None:
        self.runner.sync_host()
        self._device_step = False

    def checkpoint(self):
        """Undo for the cost probes: the draft cache back to its current lengths. Until then no row is
        re-windowed (its new window could not be cut back to them)."""
        lengths = self.runner.lengths.clone()  # [B]
        self._probing = True

        def undo() -> None:
            self.runner.truncate(lengths)
            self._fed_drafts = 0
            self._probing = False

        return undo


def _capturing(meta: SpecDecodeMetadata) -> bool:
    """Whether a CUDA graph is being captured (no host reads then)."""
    return meta.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def sample_draft(logits: torch.Tensor, meta: SpecDecodeMetadata, uniforms: torch.Tensor,
                 probs: torch.Tensor) -> torch.Tensor:
    """Each row's draft token, drawn from its filtered q with the filter the verifier applies to the
    target's logits (the loop's, or each row's own under continuous batching: ``meta.temperature``,
    ``top_k``, ``top_p`` hold either); q is written into ``probs``. A greedy row's q is one-hot at its
    argmax, which is what the verifier assumes of a greedy draft. One op call (ops.sample_filtered), no
    host read: a row whose logits are invalid (NaN) gets token 0 and an all-NaN q, which the verifier
    reports as that row's invalid draft probabilities.

    logits [B, V]; uniforms [B, 1] fp32; probs [B, V] fp32 out (a column of a [B, k, V] buffer)
    -> tokens [B] int64
    """
    B = meta.batch_size
    tokens = torch.empty((B,), dtype=torch.int64, device=logits.device)
    ops.sample_filtered(logits.contiguous(), temperature=meta.temperature[:B], top_k=meta.top_k[:B],
                        top_p=meta.top_p[:B], uniforms=uniforms, out=(probs, tokens), check_status=False)
    return tokens.clamp_(min=0)


def active_processing(meta: SpecDecodeMetadata) -> Optional[ProcessingState]:
    """``meta.processing`` where some row has a processor that changes its logits, else None: what a drafter
    applies to its own logits (here, beside the step's other drafter helpers: a greedy step stays within the
    files it crosses, python_tests/test_step_trace.py)."""
    return meta.processing if meta.processing is not None and meta.processing.any_active else None


def draft_uniforms(meta: SpecDecodeMetadata, steps: int) -> torch.Tensor:
    """The draft's Philox uniforms of this step, one [B, 1] column per draft position (``sample_draft``'s
    ``uniforms``): philox(seed, draft_offset, i) for position i. -> [steps, B, 1] fp32"""
    return ops.philox_uniforms(meta.seed, meta.draft_offset, steps).t().contiguous()[:, :, None]
