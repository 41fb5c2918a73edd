"""ContinuousBatcher: continuous batching over the decode step (step.py), the one generate() runs.

A fixed number of slots (the most rows that run at once): slot b is row b of the loop's metadata, of
the target's runner and of the drafter. Between steps requests join (``admit``: the target's start_rows
prefills their slots while the other rows keep their caches, decode.join_rows samples each one's first
token, which is delivered before the drafter prefills the rows) and
rows leave (``end``: the runner and the drafter free the slot and its cache at once). ``step`` runs one
``Stepper.step`` (draft -> verify -> read -> commit -> stats -> stops) over rows 0..width-1, the width being one past the highest slot in use
(slots are taken lowest first); a free slot inside it is a frozen one-token dummy that commits nothing.

Per row: its own filter (the verifier kernels take temperature / top-k / top-p per row, and the model
drafter filters each row with its own: metadata.row_sampling), its own seed and Philox step count
(metadata.set_row_steps: a row's draws depend on its seed and its own steps only, never on the batch or
on when it joined), and its own stop checks (stops.apply_stops with its StopCriteria). A request's
tokens are therefore those generate() gives it alone with the same k, up to the batch invariance of the
floating-point kernels (a different batch can round a logit differently; only a near-tie could flip).

Draft length (``draft_length``, a LoadGatedK; None: every row drafts the server's k): each step's k
comes from the step costs measured at the running width and each row's acceptance, 0 (a plain step)
where speculation does not pay at this load (serve/draft_length.py); seeded requests draft a fixed k.
Under graphs every row of a step drafts the same length, one of the few the Steppers capture.

Chunked prefill (``prefill_chunk`` > 0, a target runner with ``extend_rows``): a joining request takes its
slot at once but is prefilled a chunk per step (``prefill``: start_rows of the first chunk, extend_rows of
the next ones, up to ``prefill_chunk`` tokens less the running rows' verify tokens, at least
MIN_PREFILL_CHUNK, first come first served), so the running rows keep emitting while a long prompt joins.
Until its last chunk the row is frozen in the steps (it commits nothing) and the drafter holds it
without its tokens (``Drafter.hold_rows``, no draft forward: both runners span the same width); after
the last chunk its first token is sampled as a whole-prompt prefill samples it (decode.join_rows) and
the drafter gets the prompt.
Each step appends a ``StepRecord`` (width, k and why, prefill chunks, tokens per row) to ``step_log``.

CUDA graphs by batch-size bucket (``graphs=True``: the plan's rule, on a CUDA device with the paged
runners and a draft model, an EAGLE-3 head or no drafter). A step covers ``plan.bucket_size(width)`` rows (at most
max_rows) instead of ``width``; the draft, verify and commit steps of each (bucket, filter) pair are
captured once (step.DecodeSteps) and replayed for the server's life; the filter part of the key is
whether every row is greedy and whether any row truncates (top-k / top-p), the two host decisions a
step makes, and the key holds the step's draft length (a plain step's draft part, the drafter's skip,
stays on the host; before a drafting step after plain ones ``Drafter.catch_up`` feeds the draft model
what they committed, so the captured draft pass has its captured feed width). Pages cannot be handed out inside a graph, so before each replay the host gives every
running row the pages the step can write (runners/paged.py ``reserve_step``: length + k + 1) and after
it reads the lengths back (``sync_host``, the pages past them are freed): the runners' and the draft
model's ``device_steps`` capability, which the server plan (plan.plan_server) requires for graphs; everything a step reads per
row (filters, seeds, Philox offsets, active flags) sits in the metadata's device tensors. A step whose
rows include one with logits processors, a grammar or logprobs runs its parts eagerly (the same key with
``eager``; the runners stay in device mode): the grammar masks and the logprobs are host work inside the
step, which a capture cannot hold; the other steps keep replaying. Eager steps (``graphs=False``) run the
same step functions over ``width`` rows in the runners' host mode.

No threads here: engine.py runs a batcher in its own thread and feeds it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .._status import ROW_STATUS_MESSAGES
from ..decode import FIRST_DECODE_STEP, join_rows
from ..drafters import Drafter
from ..logprobs import prompt_logprobs
from ..metadata import SpecDecodeMetadata
from ..plan import MIN_PREFILL_CHUNK, bucket_size
from ..processing import ProcessingState
from ..runners import ModelRunner
from ..sampling import SamplingParams
from ..step import StepOptions, Stepper
from ..stops import RowState, apply_stops
from .budget import CacheBudget
from .draft_length import FIXED, DraftChoice, LoadGatedK
from .slo import TpotSlo
from .metrics import ServeMetrics
from .request import FAILED, EventSink, GenerationRequest, RequestRejected, RowEvent

log = logging.getLogger("specdec_ext.serve")

GREEDY = SamplingParams()  # the filter of a free slot
FREE_SLOT_TOKEN = 0  # the one token of a free slot's dummy row (any valid id would do)

Admission = Tuple[GenerationRequest, EventSink, float]  # (request, where its events go, when it was submitted)
STEP_LOG_LENGTH = 4096  # StepRecords kept (the newest)


@dataclass(eq=False)
class PromptGroup:
    """The choices of one request that share its prompt (n > 1): the leader's prompt is prefilled once and
    the others fork its cache (runner.fork_rows: the paged runner shares the prompt's full pages)."""

    leader: "Row"  # the row whose prefill serves the group (the next waiting one if it leaves before that)
    waiting: List["Row"]  # the followers not forked yet (chunked prefill: until the leader's last chunk)
    units: int  # the shared pages' budget units, held until the last member leaves
    members: int  # rows of the group still running


@dataclass
class Row:
    """A request running in a slot."""

    request: GenerationRequest
    sink: EventSink
    slot: int
    units: int  # what it holds of the cache budget
    submitted_at: float
    state: RowState = field(default_factory=RowState)
    steps: int = FIRST_DECODE_STEP  # the Philox step index of its next decode step (0 drew its first token)
    first_token_at: Optional[float] = None
    prefilled: int = 0  # prompt tokens in the target's cache (chunked prefill; the prompt's length once decoding)
    group: Optional[PromptGroup] = None  # n choices: the rows that share this one's prompt
    prompt_logprobs: Optional[list] = None  # echo with logprobs: sent with the row's first event
    draft_held: bool = False  # the drafter holds the row without its tokens (hold_rows: chunked prefill, deferral)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt)

    @property
    def draft_pending(self) -> bool:
        """A decoding row the drafter holds without its tokens: it gets them before a step drafts."""
        return self.draft_held and self.decoding


@dataclass(frozen=True)
class Scheduling:
    """How the batcher schedules its steps (the server plan's choices)."""

    draft_length: Optional[LoadGatedK] = None  # k by load; None: every row drafts the server's k
    prefill_chunk: int = 0  # prompt tokens prefilled per step (0: whole prompts at admission)
    tpot_slo: Optional[float] = None  # seconds per output token to meet (serve/slo.py); None: no target


@dataclass
class StepRecord:
    """What one step of the batcher did (``ContinuousBatcher.step_log``)."""

    width: int  # rows the step covered (0: no decode step ran, only prefill)
    k: int  # drafts per row of the widest budget (0: a plain step)
    reason: str  # why that k (serve/draft_length.REASONS)
    prefilled: Dict[int, int]  # slot -> prompt tokens prefilled before the step
    emitted: Dict[int, int]  # slot -> tokens the step gave the row
    rates: Optional[Tuple[float, float]] = None  # k by load: (plain's, the chosen k's) estimated tokens/s


class ContinuousBatcher:
    """Slots, admission and one decode step over the running rows (see the module docstring)."""

    def __init__(self, target: ModelRunner, drafter: Optional[Drafter], *, max_rows: int, slots: int,
                 max_seq_len: int, metrics: Optional[ServeMetrics] = None,
                 clock: Callable[[], float] = time.perf_counter, graphs: bool = False, graph_backend=None,
                 scheduling: Scheduling = Scheduling()):
        if drafter is not None and drafter.is_tree:
            raise ValueError(f"continuous batching runs chain drafters (a draft model, one with another tokenizer, "
                             f"ngram, eagle) or none, not "
                             f"{type(drafter).__name__} (a tree)")
        if graphs and not target.capabilities.device_steps:
            raise ValueError(f"CUDA graphs in continuous batching need the paged target runner, not "
                             f"{type(target).__name__}")
        if graphs and drafter is not None and not drafter.device_steps:
            raise ValueError(f"CUDA graphs in continuous batching need a draft model, an EAGLE-3 head or no drafter: "
                             f"{type(drafter).__name__} proposes on the host")
        draft_length, prefill_chunk = scheduling.draft_length, scheduling.prefill_chunk
        if prefill_chunk and not target.capabilities.chunked_prefill:
            raise ValueError(f"chunked prefill needs a target runner with extend_rows, not {type(target).__name__}")
        if graphs and prefill_chunk:
            raise ValueError("CUDA-graph steps run after whole-prompt prefill: chunked prefill needs eager steps")
        self.target, self.drafter = target, drafter
        self.draft_length, self.prefill_chunk = draft_length, int(prefill_chunk)
        self.slo = None if scheduling.tpot_slo is None else TpotSlo(scheduling.tpot_slo)
        self.step_log: Deque[StepRecord] = deque(maxlen=STEP_LOG_LENGTH)
        self._last_k = slots
        self._joined_tokens = 0  # prompt tokens of the rows that joined since the last decode step (LoadGatedK J)
        self._emit_s = 0.0  # the last step's emission (events to the sinks): host time of a step, H in the draft length's costs
        self.graphs, self.graph_backend = bool(graphs), graph_backend
        self._steps: Dict[tuple, Stepper] = {}  # step key -> the Stepper of its rows view
        self.max_rows, self.max_seq_len = int(max_rows), int(max_seq_len)
        self.budget = CacheBudget(target, max_rows=max_rows, slots=slots, max_seq_len=max_seq_len)
        self.metrics = metrics if metrics is not None else ServeMetrics(slots)
        self.clock = clock
        device = target.device
        self.meta = SpecDecodeMetadata.allocate(batch_size=max_rows, slots=slots, max_seq_len=max_seq_len,
                                                sampling=GREEDY, seeds=torch.zeros((max_rows,), dtype=torch.int64,
                                                                                   device=device))
        self.meta.set_row_sampling([GREEDY] * max_rows)
        self.meta.processing = ProcessingState.allocate(max_rows, target.vocab_size, device)
        if slots:  # a verify pass narrower than slots + 1 (ngram) is widened into it: no allocation per step
            self.meta.reserve_verify_logits(target.vocab_size)
        self.rows: List[Optional[Row]] = [None] * max_rows
        self._clear_slots(range(max_rows))

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> List[Row]:
        """Every request holding a slot (decoding or still prefilling)."""
        return [row for row in self.rows if row is not None]

    @property
    def prefilling(self) -> List[Row]:
        """Requests whose prompts are still being prefilled (chunked prefill), first come first."""
        return sorted((row for row in self.rows if row is not None and not row.decoding),
                      key=lambda row: row.submitted_at)

    @property
    def free_slots(self) -> int:
        return sum(row is None for row in self.rows)

    @property
    def open_slots(self) -> int:
        """Free slots requests may take now: with a TPOT target, only while the width they would make is
        expected to meet it (serve/slo.py; one row always joins an empty batch)."""
        free = self.free_slots
        if self.slo is None:
            return free
        running = len(self.running)
        opened = 0
        while opened < free and (running + opened == 0 or self.slo.admits(running + opened + 1)):
            opened += 1
        return opened

    # ------------------------------------------------------------------ joining and leaving
    def check_request(self, request: GenerationRequest) -> None:
        """RequestRejected (a 400 naming the field) for what this batcher cannot run, before any work."""
        processing = request.processing
        if processing is not None:
            try:
                processing.validate(self.target.vocab_size)
            except ValueError as error:
                raise RequestRejected(str(error), param=str(error).split()[0].split("[")[0]) from None

    @torch.no_grad()  # grad mode is per thread: the engine's thread needs its own
    def admit(self, admissions: Sequence[Admission]) -> None:
        """Requests take the lowest free slots. Whole-prompt prefill: their prompts are prefilled now and
        each one's first token delivered; chunked prefill: ``prefill`` feeds them chunk by chunk. The
        caller checked that they fit (``free_slots``, ``budget.fits`` of their ``budget.units``)."""
        slots = [b for b, row in enumerate(self.rows) if row is None][: len(admissions)]
        if len(slots) < len(admissions):
            raise RuntimeError(f"admit: {len(admissions)} requests for {len(slots)} free slots")
        joining = []
        for slot, (request, sink, submitted_at) in zip(slots, admissions):
            units = self.budget.units(len(request.prompt), request.max_new_tokens)
            row = Row(request, sink, slot, units, submitted_at)
            try:
                self.meta.set_row(slot, request.sampling, request.seed)
            except Exception as error:  # this request's own values (one its row's tensors cannot hold): it fails
                self._fail_admission(row, error)  # alone, the others join (a raise here would fail the whole step)
                continue
            self.rows[slot] = row
            if self.draft_length is not None:
                self.draft_length.join(slot)
            joining.append(row)
        self._group(joining)
        for row in joining:
            self.budget.take(row.units)
        if self.prefill_chunk or not joining:
            return
        starters = [row for row in joining if row.group is None or row.group.leader is row]
        begin = self.clock()
        logits = self.target.start_rows([row.slot for row in starters], [row.request.prompt for row in starters])
        if self.draft_length is not None and len(starters) == 1:  # (prompts prefilled together are padded)
            self.draft_length.observe_prefill(len(starters[0].request.prompt), self.clock() - begin)
        for row in starters:
            row.prefilled = len(row.request.prompt)
        self._join(*self._fork_followers(starters, logits))

    def _fail_admission(self, row: Row, error: Exception) -> None:
        """A request whose filter or seed its row cannot take ends as FAILED before it holds the slot (which
        is cleared again) or any of the cache budget."""
        log.error("specdec serve: request %s could not join", row.request.request_id, exc_info=error)
        self._clear_slots([row.slot])
        self._send(row, RowEvent([], finished=True, finish_reason=FAILED,
                                 message=f"its sampling parameters could not be set ({type(error).__name__}: {error})"))
        self.metrics.record_end(FAILED, len(row.request.prompt), 0, self.clock() - row.submitted_at, None, None)

    def _group(self, joining: Sequence[Row]) -> None:
        """The choices of one request among ``joining`` (``shares_prompt_with`` its first's id) form a
        PromptGroup: each member's units are then its own pages, and the shared prompt pages are taken once."""
        by_id = {row.request.request_id: row for row in joining}
        for row in joining:
            leader = by_id.get(row.request.shares_prompt_with)
            if leader is None or leader is row:
                continue
            if leader.group is None:
                shared = self.budget.shared_units(len(leader.request.prompt))
                leader.group = PromptGroup(leader, [], shared, 1)
                leader.units -= shared
                self.budget.take(shared)
            group = row.group = leader.group
            group.waiting.append(row)
            group.members += 1
            row.units -= group.units

    def _fork_followers(self, starters: Sequence[Row], logits: torch.Tensor) -> Tuple[List[Row], torch.Tensor]:
        """Rows whose prompts were just prefilled (``logits`` [n, V] at their last tokens), and the waiting
        followers of those that lead a group, forked from them now: (rows, their logits) to join."""
        rows, index = [], []
        for i, row in enumerate(starters):
            rows.append(row)
            index.append(i)
            group = row.group
            if group is None or group.leader is not row or not group.waiting:
                continue
            followers, group.waiting = group.waiting, []
            self.target.fork_rows(row.slot, [follower.slot for follower in followers])
            for follower in followers:
                follower.prefilled = len(follower.request.prompt)
                rows.append(follower)
                index.append(i)
        return rows, logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]

    @torch.no_grad()
    def prefill(self) -> Dict[int, int]:
        """Chunked prefill: the next chunks of the prefilling rows, first come first, within this step's
        token budget; rows whose last chunk this was get their first token. Returns slot -> tokens fed."""
        rows = [row for row in self.prefilling if row.group is None or row.group.leader is row]
        if not rows:
            return {}
        decoding = sum(1 for row in self.rows if row is not None and row.decoding)
        left = max(self.prefill_chunk - decoding * (self._last_k + 1), MIN_PREFILL_CHUNK)
        if self.slo is not None:
            left = self.slo.chunk_budget(left, MIN_PREFILL_CHUNK, decoding > 0)
        fed: Dict[int, int] = {}
        done: List[Tuple[Row, torch.Tensor]] = []
        for row in rows:
            if left <= 0:
                break
            prompt = row.request.prompt
            chunk = prompt[row.prefilled: row.prefilled + left]
            begin = self.clock()
            try:
                logits = self._feed_chunk(row, chunk)
            except Exception as error:  # this request's prompt only: the other rows go on
                log.exception("specdec serve: prefilling request %s failed", row.request.request_id)
                self.end(row, FAILED, message=f"its prefill failed ({type(error).__name__}: {error})")
                continue
            seconds = self.clock() - begin
            if self.slo is not None:
                self.slo.observe_prefill(len(chunk), seconds)
            if self.draft_length is not None:
                self.draft_length.observe_prefill(len(chunk), seconds)
            row.prefilled += len(chunk)
            fed[row.slot] = len(chunk)
            left -= len(chunk)
            if row.decoding:
                done.append((row, logits))
        if done:
            starters = [row for row, _ in done]
            self._join(*self._fork_followers(starters, torch.cat([logits for _, logits in done])))
        return fed

    def _feed_chunk(self, row: Row, chunk: List[int]) -> torch.Tensor:
        """One chunk of ``row``'s prompt into the target's cache; at its first chunk the drafter holds the
        row (a frozen one-token row in the metadata). Logits at the chunk's last token [1, V]."""
        if row.prefilled:
            return self.target.extend_rows([row.slot], [chunk])
        logits = self.target.start_rows([row.slot], [chunk])
        if self.drafter is not None:
            self.meta.hold_rows([row.slot], FREE_SLOT_TOKEN)
            self.drafter.hold_rows([row.slot], self.meta)
            row.draft_held = True
        return logits

    def _join(self, rows: Sequence[Row], logits: torch.Tensor) -> None:
        """Rows whose prompts are in the target's cache (``logits`` [n, V] at their last tokens): deliver
        each first token (or end a row whose logits failed), then prefill the drafter for those still
        running (the client need not wait for the draft's prefill); a row whose draft prefill is deferred
        is held by the drafter (``Drafter.hold_rows``: no draft forward, where a one-token stand-in prompt,
        a draft forward per joining row, was the speculative server's extra with every step plain)."""
        self._prompt_logprobs(rows)
        scoring = [i for i, row in enumerate(rows) if row.request.max_new_tokens == 0]
        if scoring:  # max_tokens=0 (a prompt scored with echo and logprobs): no token is drawn
            for i in scoring:
                self.end(rows[i], "length")
            kept = [i for i, row in enumerate(rows) if row.request.max_new_tokens > 0]
            if not kept:
                return
            rows, logits = [rows[i] for i in kept], logits[kept]
        for row in rows:  # (after any chunked prefill's frozen one-token row: the counts start here)
            self.meta.processing.set_row(row.slot, row.request.processing, row.request.prompt, row.request.grammar)
        self.meta.top_logprobs = _widest_logprobs(rows)
        first, status, logprobs = join_rows([row.slot for row in rows], [row.request.prompt for row in rows],
                                            logits, self.meta)
        now = self.clock()
        for row, token, code, entries in zip(rows, first, status, logprobs):
            if code < 0:
                self.end(row, FAILED, message=_status_message(code, row.slot))
                continue
            row.first_token_at = now
            tokens = apply_stops(row.state, [token], row.request.stop, entries)
            grammar_end = self.meta.processing.grammar_end(row.slot)
            if grammar_end is not None and not row.state.finished:
                row.state.finished, row.state.finish_reason = True, grammar_end
            self._emit(row, tokens)
        staying = [row for row in rows if self.rows[row.slot] is row]
        if self.drafter is None or not staying:
            return
        self._joined_tokens += sum(len(row.request.prompt) for row in staying)
        deferred = [row for row in staying if self._defers_draft(row)]
        started = [row for row in staying if row not in deferred]
        if started:
            replaced = [row.slot for row in started if row.draft_held]
            if replaced:
                self.drafter.free_rows(replaced)
            begin = self.clock()
            self.drafter.start_rows([row.slot for row in started], [row.request.prompt for row in started], self.meta)
            if self.draft_length is not None:
                self.draft_length.record_draft_prefill(sum(len(row.request.prompt) for row in started),
                                                       self.clock() - begin)
            for row in started:
                row.draft_held = False
        holding = [row for row in deferred if not row.draft_held]
        if holding:
            self.drafter.hold_rows([row.slot for row in holding], self.meta)
        for row in deferred:
            row.draft_held = True

    def _defers_draft(self, row: Row) -> bool:
        """Whether a joining row's draft prefill waits for the first step that drafts: while speculation is
        off (k by load), for a drafter that can start a row from token ids later, not for a seeded row
        (it drafts every step)."""
        return (self.draft_length is not None and not self.draft_length.speculating
                and self.drafter.deferrable_start and not row.request.seeded)

    def _start_pending_drafts(self) -> None:
        """Before a step that drafts: the drafter gets every running row it holds without its tokens, with the
        row's committed tokens but the last (which the next proposal feeds, as after any step)."""
        pending = [row for row in self.running if row.draft_pending]
        if not pending:
            return
        begin = self.clock()
        slots = [row.slot for row in pending]
        lengths = self.meta.seq_lens[slots].tolist()
        tokens = [self.meta.token_buffer[slot, : length - 1].tolist() for slot, length in zip(slots, lengths)]
        self.drafter.free_rows(slots)
        self.drafter.start_rows(slots, tokens, self.meta)
        for row in pending:
            row.draft_held = False
        if self.draft_length is not None:  # what switching speculation on costs, measured
            self.draft_length.record_draft_prefill(self.drafter.prefill_tokens(list(map(len, tokens))),
                                                   self.clock() - begin)

    def _pending_draft_tokens(self) -> int:
        """Tokens the drafter must take in before it can draft for the decoding rows it holds (host
        counts: the prompt and the tokens returned so far)."""
        return self.drafter.prefill_tokens([len(row.request.prompt) + len(row.state.tokens) for row in self.rows
                                            if row is not None and row.draft_pending])

    def _prompt_logprobs(self, rows: Sequence[Row]) -> None:
        """echo with logprobs: the prompt's logprobs of each row asking (once per prompt among ``rows``: a
        request's n choices), kept for the row's first event."""
        done: Dict[tuple, list] = {}
        for row in rows:
            request = row.request
            if not request.prompt_logprobs:
                continue
            key = (tuple(request.prompt), request.top_logprobs or 0)
            if key not in done:
                done[key] = prompt_logprobs(self.target.model, request.prompt, request.top_logprobs or 0)
            row.prompt_logprobs = done[key]

    def end(self, row: Row, reason: str, *, message: Optional[str] = None, tokens: Sequence[int] = ()) -> None:
        """The row leaves: its last event (``tokens`` and why it ended), then its slot and cache are freed."""
        self._send(row, RowEvent(list(tokens), finished=True, finish_reason=reason,
                                 stop_text_end=row.state.stop_text_end, message=message,
                                 logprobs=_last_logprobs(row, len(tokens))))
        self._release(row)
        if self.draft_length is not None:
            self.draft_length.leave(row.slot)
        now = self.clock()
        count = len(row.state.tokens)
        first = None if row.first_token_at is None else row.first_token_at - row.submitted_at
        per_token = (now - row.first_token_at) / (count - 1) if row.first_token_at is not None and count > 1 else None
        if self.slo is not None and self.slo.missed(per_token):
            self.metrics.record_slo_miss()
        self.metrics.record_end(reason, len(row.request.prompt), count, now - row.submitted_at, first, per_token)

    def end_all(self, reason: str, message: str) -> None:
        for row in self.running:
            self.end(row, reason, message=message)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """The prefill chunks (chunked prefill), then one decode step over the slots in use
        (Stepper.step) if a row is decoding; each decoding row gets its new tokens, and rows that finish
        or fail leave at once. A prefilling row is frozen in the step."""
        start = self.clock()
        prefilled = self.prefill() if self.prefill_chunk else {}
        started = [row for row in self.running if row.prefilled]  # (in both runners: they span these slots)
        if not any(row.decoding for row in started):
            if prefilled:
                self.step_log.append(StepRecord(0, 0, FIXED, prefilled, {}))
            return
        width = max(row.slot for row in started) + 1
        if self.graphs:
            width = min(bucket_size(width), self.max_rows)
        rows = [row if row is not None and row.decoding else None for row in self.rows[:width]]
        decode_begin = self.clock()
        if self.draft_length is not None:
            self.draft_length.record_joins(self._joined_tokens,
                                           sum(len(row.request.prompt) for row in self.prefilling))
            self._joined_tokens = 0
        choice = self._choose(width, rows, after_prefill=bool(prefilled))
        catch_up_begin = self.clock()
        if choice.k > 0:
            self._start_pending_drafts()
            if self.graphs:  # a captured draft pass feeds as few tokens as one after a drafting step
                self.drafter.catch_up(self.meta)
        catch_up_s = self.clock() - catch_up_begin  # (the draft prefills' own cost: record_draft_prefill)
        stepper = self._stepper_for(width, choice.k)
        stepper.meta.set_row_steps(torch.tensor([row.steps if row is not None else 0 for row in rows]))
        stepper.meta.top_logprobs = _widest_logprobs([row for row in rows if row is not None])
        begin = self.clock()
        result = stepper.step([None if row is None else row.state for row in rows],
                              [None if row is None else row.request.stop for row in rows],
                              None if self.draft_length is None else choice.budget)
        if self.draft_length is not None:  # host: the whole step's but its draft and verify parts (the choice, the
            #   step's own bookkeeping, the last step's emission), which a step of any k pays once
            host = self.clock() - decode_begin - catch_up_s - result.draft_time - result.verify_time + self._emit_s
            self.draft_length.observe(width, choice, result.outcome, verify_width=result.width,
                                      draft_time=result.draft_time, verify_time=result.verify_time, host_time=host,
                                      after_prefill=bool(prefilled))
        self._last_k = choice.k
        self.metrics.record_draft_length(choice.k, choice.reason)
        emitted: Dict[int, int] = {}
        emit_begin = self.clock()
        for b, row in enumerate(rows):
            if row is None:
                continue
            if b in result.failed:
                self.end(row, FAILED, message=_status_message(result.failed[b], b))
                continue
            row.steps += 1
            emitted[b] = len(result.new_tokens[b])
            self._emit(row, result.new_tokens[b])
        self._emit_s = self.clock() - emit_begin
        self.step_log.append(StepRecord(width, choice.k, choice.reason, prefilled, emitted, choice.rates))
        if self.slo is not None and emitted:
            self.slo.observe_step(width, self.clock() - begin, begin - start, sum(emitted.values()) / len(emitted))

    def _choose(self, width: int, rows: Sequence[Optional[Row]], after_prefill: bool = False) -> DraftChoice:
        """This step's draft lengths: the LoadGatedK's choice, or the server's k for every row."""
        running = [b for b, row in enumerate(rows) if row is not None]
        if self.draft_length is None:
            k = self.meta.slots
            return DraftChoice(k, FIXED, [k if row is not None else 0 for row in rows])
        seeded = [b for b in running if rows[b].request.seeded]
        steps_left = max((rows[b].request.max_new_tokens - len(rows[b].state.tokens) for b in running), default=None)
        return self.draft_length.choose(width, running, seeded, pending_tokens=self._pending_draft_tokens(),
                                        uniform=self.graphs, steps_left=steps_left, after_prefill=after_prefill)

    @property
    def graphs_captured(self) -> int:
        """Step graphs captured so far (0 without CUDA graphs); read from other threads (/metrics)."""
        return sum(sum(stepper.parts.captured.values()) for stepper in list(self._steps.values()))

    # ------------------------------------------------------------------ helpers
    def _stepper_for(self, width: int, k: int) -> Stepper:
        """The Stepper over the view of rows 0..width-1, made once per key: the width, and under graphs
        the host decisions baked into a capture (all rows greedy, any row truncating, the draft length
        ``k`` of every row) and whether a row's processors or logprobs make the step eager (module
        docstring)."""
        sampling = self.meta.row_sampling[:width]
        key: tuple = (width,)
        eager = False
        if self.graphs:
            eager = any(row is not None and _host_work(row.request) for row in self.rows[:width])
            key += (all(p.greedy for p in sampling), any(p.top_k > 0 or p.top_p < 1.0 for p in sampling), eager, k)
        if key not in self._steps:
            options = StepOptions(graphs=self.graphs and not eager, device_steps=self.graphs, isolate_failures=True,
                                  graph_backend=self.graph_backend, plain=self.graphs and k == 0)
            self._steps[key] = Stepper(self.target, self.drafter, self.meta.rows(width), options,
                                          recorder=self.metrics)
        stepper = self._steps[key]
        stepper.meta.set_row_sampling(sampling)  # the views share the tensors; the host filters are refreshed
        stepper.meta.processing.refresh_host(self.meta.processing)
        return stepper

    def _emit(self, row: Row, tokens: List[int]) -> None:
        self.metrics.record_tokens(len(tokens))
        if row.state.finished:
            self.end(row, row.state.finish_reason, tokens=tokens)
        elif tokens:
            self._send(row, RowEvent(tokens, logprobs=_last_logprobs(row, len(tokens))))

    def _send(self, row: Row, event: RowEvent) -> None:
        if row.prompt_logprobs is not None:
            event.prompt_logprobs, row.prompt_logprobs = row.prompt_logprobs, None
        try:
            row.sink(event)
        except Exception:  # a client's sink must not stop the other rows
            log.exception("specdec serve: delivering an event of request %s failed", row.request.request_id)

    def _release(self, row: Row) -> None:
        """Free the row's slot in the runner and the drafter, give its budget back, clear its buffers."""
        for part in (self.target, self.drafter):
            if part is None:
                continue
            try:
                part.free_rows([row.slot])
            except ValueError:  # the slot never started there (its prefill failed part-way)
                log.debug("specdec serve: slot %d was not in use in %s", row.slot, type(part).__name__)
        self.budget.release(row.units)
        self._leave_group(row)
        self.rows[row.slot] = None
        self._clear_slots([row.slot])

    def _leave_group(self, row: Row) -> None:
        """A member leaves its PromptGroup: the shared pages' units go back with the last member, and a
        leader that leaves before its followers forked hands the prefill to the first of them."""
        group = row.group
        if group is None:
            return
        group.members -= 1
        if row in group.waiting:
            group.waiting.remove(row)
        if group.leader is row and group.waiting:
            group.leader = group.waiting.pop(0)
        if group.members == 0:
            self.budget.release(group.units)

    def _clear_slots(self, slots: Sequence[int]) -> None:
        """Free slots as frozen one-token greedy rows (metadata.clear_rows)."""
        self.meta.clear_rows(slots, FREE_SLOT_TOKEN, GREEDY)


def _host_work(request: GenerationRequest) -> bool:
    """Whether a request's steps do host work inside the step (processors, a grammar, logprobs)."""
    processing = request.processing
    return (processing is not None and processing.active) or request.top_logprobs is not None


def _widest_logprobs(rows: Sequence[Row]) -> Optional[int]:
    """The most alternatives any of ``rows`` asks for (None: no row asks for logprobs)."""
    asked = [row.request.top_logprobs for row in rows if row.request.top_logprobs is not None]
    return max(asked) if asked else None


def _last_logprobs(row: Row, count: int) -> Optional[list]:
    """The logprobs of the row's last ``count`` tokens, cut to the alternatives it asked for."""
    top = row.request.top_logprobs
    if top is None or row.state.logprobs is None:
        return None
    end = len(row.state.tokens)
    return [dataclasses.replace(entry, top=entry.top[:top]) for entry in row.state.logprobs[end - count: end]]


def _status_message(code: int, slot: int) -> str:
    detail = ROW_STATUS_MESSAGES.get(code, f"row {{row}} failed with status {code}").format(row=slot)
    return f"the decode step failed for this request ({detail}); other requests are unaffected"
