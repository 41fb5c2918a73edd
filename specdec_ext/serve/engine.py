"""Engine: a ContinuousBatcher in its own thread, fed from any thread.

    submit(request, sink) -> RequestHandle   queue a request; RequestRejected when it cannot be taken
                                             (too large for the cache, queue full, shutting down). Its
                                             events go to ``sink``, called from the engine thread
    submit_group(requests, sinks)            the n choices of one request, queued together and admitted
                                             together (one prefill; the others fork its cache)
    handle.cancel()                          the row leaves at the next step boundary, its cache freed
    begin_shutdown(grace_s)                  no new requests; queued ones are aborted now, running ones
                                             get grace_s seconds to finish and are then aborted
    stop()                                   abort what is left and end the thread

The loop: take the cancellations; admit waiting requests that fit (free slots, the cache budget; first
come first served: the head of the queue is never overtaken; at most ``max_prefill_tokens`` prompt
tokens per admission, or one request); one decode step; wait on a condition while there is nothing to
do. The HTTP server's event loop only calls submit / cancel, which hold a lock for microseconds: the
decode loop never blocks it.

An unexpected error inside a step fails the running requests (each gets the message), frees their
rows and the engine goes on; if their rows cannot be freed, the engine refuses everything from then on
(``failure``), and /health says so.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

from ..sampling import SamplingParams
from ..stops import StopCriteria
from .batcher import Admission, ContinuousBatcher
from .metrics import Gauge
from .request import (ABORTED, CANCELLED, FAILED, EventSink, GenerationRequest, QueueFullError, RequestRejected,
                      RequestTooLargeError, RowEvent, ShuttingDownError)

log = logging.getLogger("specdec_ext.serve")

DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens admitted per step (a burst of long prompts would stall decoding)
MAX_RETRY_AFTER_S = 60
IDLE_WAIT_S = 1.0  # the longest the loop sleeps without news (it is woken by submit / cancel / shutdown)

NOT_STARTED, RUNNING, DRAINING, STOPPED, BROKEN = "not started", "running", "draining", "stopped", "broken"


@dataclass
class RequestHandle:
    """A submitted request: its id, and the way to cancel it."""

    request_id: str
    engine: "Engine"

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)


class Engine:
    """See the module docstring."""

    def __init__(self, batcher: ContinuousBatcher, *, max_queue: int,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, clock: Callable[[], float] = time.perf_counter):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.batcher = batcher
        self.metrics = batcher.metrics
        self.max_queue, self.max_prefill_tokens = int(max_queue), int(max_prefill_tokens)
        self.clock = clock
        self._cond = threading.Condition()
        self._waiting: Deque[Admission] = deque()
        self._cancelled: set = set()
        self._running = 0  # rows running after the last step (read by submit and the gauges)
        self._admitting = 0  # requests taken from the queue for the step under way: in no count until it ends
        self._state = NOT_STARTED
        self._deadline = math.inf  # while draining: when the running rows are aborted
        self.failure: Optional[str] = None
        self.description = ""  # what runs, for the server's start-up line (build.build_engine)
        self.plan = None  # the server's DecodePlan (plan.plan_server), set by build.build_engine
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the server's side
    @property
    def state(self) -> str:
        return self._state

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._state = RUNNING
            self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
            self._thread.start()

    def calibrate(self, prompt: List[int]) -> int:
        """Before start(): one greedy request of the server's own, decoded on the calling thread, whose steps
        draft every length in turn (LoadGatedK.start_calibration), so the first clients' steps choose k from
        measured costs. The request's acceptance and the metrics are reset afterwards. Returns the steps it
        ran (0 when the draft length is fixed). ``prompt``: token ids of any ordinary text."""
        controller = self.batcher.draft_length
        if controller is None:
            return 0
        if self._thread is not None:
            raise RuntimeError("Engine.calibrate runs before start()")
        if not prompt:
            raise ValueError("Engine.calibrate needs a non-empty prompt")
        schedule = controller.start_calibration()
        new_tokens = schedule * (controller.k_max + 1) + 1  # the request outlasts the schedule
        request = GenerationRequest(prompt=list(prompt), sampling=SamplingParams(temperature=0.0), seed=0,
                                    stop=StopCriteria(max_new_tokens=new_tokens))
        try:
            self.submit(request, lambda event: None)
        except RequestRejected:  # a cache too small for it: the first clients' steps measure instead
            controller.end_calibration()
            return 0
        steps = 0
        while controller.calibrating and (self._waiting or self.batcher.running) and self._state != BROKEN:
            with self._cond:
                admissions = self._take_admissions()
            self._run_step(set(), False, admissions)
            steps += 1
        self._safely(lambda: self.batcher.end_all(CANCELLED, "calibration over"))
        with self._cond:
            self._waiting.clear()
            self._running = len(self.batcher.running)
        controller.end_calibration()
        self.metrics.reset()
        return steps

    def submit(self, request: GenerationRequest, sink: EventSink) -> RequestHandle:
        """Queue ``request``; RequestRejected (with the HTTP status it maps to) when it cannot be taken."""
        return self.submit_group([request], [sink])[0]

    def submit_group(self, requests: List[GenerationRequest], sinks: List[EventSink]) -> List[RequestHandle]:
        """Queue the choices of one request, all or none, next to each other in the queue: each after the
        first shares its prompt (``shares_prompt_with`` = the first's id), and the group is admitted whole,
        so the first one's prefill serves them all (ContinuousBatcher.admit forks it)."""
        budget = self.batcher.budget
        try:
            for request in requests:
                budget.check(len(request.prompt), request.max_new_tokens)
                self.batcher.check_request(request)
            self._check_group(requests)
            with self._cond:
                if self._state in (DRAINING, STOPPED):
                    raise ShuttingDownError("the server is shutting down and takes no new requests")
                if self._state == BROKEN:
                    raise ShuttingDownError(f"the engine failed and takes no new requests: {self.failure}")
                # (the slots a TPOT target keeps closed are no place to wait in: only open ones count)
                free_slots = min(self.batcher.max_rows - self._running, self.batcher.open_slots) - self._admitting
                if len(self._waiting) + len(requests) - 1 >= self.max_queue + max(0, free_slots):
                    raise QueueFullError(f"all {self.batcher.max_rows} rows are running and {len(self._waiting)} "
                                         f"requests are queued (the most): retry later", self._retry_after())
                now = self.clock()
                self._waiting.extend((request, sink, now) for request, sink in zip(requests, sinks))
                self._cond.notify()
        except RequestRejected as error:
            reason = {RequestTooLargeError: "too_large", QueueFullError: "queue_full",
                      RequestRejected: "invalid"}.get(type(error), "shutting_down")
            self.metrics.record_rejected(reason)
            raise
        return [RequestHandle(request.request_id, self) for request in requests]

    def _check_group(self, requests: List[GenerationRequest]) -> None:
        """The choices of one request: the first one leads, the others share its prompt, and together they
        fit the slots and the cache (RequestTooLargeError otherwise: they would wait for ever)."""
        if len(requests) < 2:
            return
        first = requests[0]
        if any(r.shares_prompt_with != first.request_id or r.prompt != first.prompt for r in requests[1:]):
            raise ValueError("submit_group: every request after the first must share its prompt "
                             "(shares_prompt_with = the first's request_id, the same prompt)")
        budget, count = self.batcher.budget, len(requests)
        if count > self.batcher.max_rows:
            raise RequestTooLargeError(f"n = {count} choices need {count} rows but this server runs "
                                       f"{self.batcher.max_rows}", param="n")
        units = budget.group_units(len(first.prompt), max(r.max_new_tokens for r in requests), count)
        if units > budget.capacity:
            raise RequestTooLargeError(f"n = {count} choices of a {len(first.prompt)}-token prompt need {units} "
                                       f"{budget.unit} of the cache together but it holds {budget.capacity}: lower n "
                                       f"or max_tokens", param="n")

    def cancel(self, request_id: str) -> None:
        """The request leaves: at once if it is still queued, at the next step boundary if it runs."""
        with self._cond:
            for entry in self._waiting:
                if entry[0].request_id == request_id:
                    self._waiting.remove(entry)
                    self._end_waiting(entry, CANCELLED, None)
                    return
            self._cancelled.add(request_id)
            self._cond.notify()

    def begin_shutdown(self, grace_s: float) -> None:
        """Take no new requests; abort the queued ones now and the running ones after ``grace_s`` seconds."""
        with self._cond:
            if self._state in (DRAINING, STOPPED):
                return
            self._state = DRAINING
            self._deadline = self.clock() + max(0.0, grace_s)
            self._abort_waiting("the server is shutting down: the request was not started")
            self._cond.notify()

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """Abort everything left and end the thread (waits for it up to ``timeout_s``)."""
        with self._cond:
            self._abort_waiting("the server stopped before the request was started")
            self._state = STOPPED
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        with self._cond:
            return not self._waiting and self._running == 0

    def gauges(self) -> Dict[str, Gauge]:
        """The engine's state now, for ServeMetrics.render."""
        budget = self.batcher.budget
        with self._cond:
            queued, running = len(self._waiting), self._running
        gauges = {
            "queue_length": ("Requests waiting for a slot.", queued, {}),
            "running_rows": ("Rows decoding now (each holds one slot of the target's and the draft's caches).",
                             running, {}),
            "max_rows": ("Slots: the most rows that run at once.", self.batcher.max_rows, {}),
            "cache_budget_in_use": (f"Cache held by the running rows for their worst case, in {budget.unit}.",
                                    budget.used, {"unit": budget.unit}),
            "cache_budget_total": (f"Cache the running rows may hold, in {budget.unit}.", budget.capacity,
                                   {"unit": budget.unit}),
        }
        gauges["cuda_graphs_captured"] = ("Decode step graphs captured (draft, verify, commit per batch bucket and "
                                          "filter kind; 0 when the steps run eagerly).",
                                          self.batcher.graphs_captured, {})
        if budget.kv is not None:
            gauges["cache_pages_in_use"] = ("Pages of the target's KV pool that rows own now.", budget.pages_in_use, {})
            gauges["cache_pages_total"] = ("Pages of the target's KV pool.", budget.pages_total, {})
            gauges["cache_pages_shared"] = ("Pages held by more than one row: the prompt pages of a request's n "
                                            "choices, counted once in cache_pages_in_use.", budget.kv.num_shared_pages,
                                            {})
        return gauges

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._has_work():
                    self._cond.wait(self._wait_s())
                if self._state == STOPPED:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                drain_over = self._state == DRAINING and self.clock() >= self._deadline
                admissions = [] if drain_over or self._state == BROKEN else self._take_admissions()
                self._admitting = len(admissions)
            self._run_step(cancelled, drain_over, admissions)
        self._safely(lambda: self.batcher.end_all(ABORTED, "the server stopped: generation was aborted"))
        with self._cond:
            self._running = len(self.batcher.running)

    def _has_work(self) -> bool:
        if self._state in (STOPPED, BROKEN):
            return self._state == STOPPED  # a broken engine only waits to be stopped
        return bool(self._cancelled or self.batcher.running or self._waiting)

    def _wait_s(self) -> float:
        if self._state == DRAINING:
            return max(0.0, min(IDLE_WAIT_S, self._deadline - self.clock()))
        return IDLE_WAIT_S

    def _take_admissions(self) -> List[Admission]:
        """Pop the waiting requests that fit now, head first, a request's choices together (under the lock)."""
        budget = self.batcher.budget
        free_slots, free_units, tokens = self.batcher.open_slots, budget.capacity - budget.used, 0
        taken: List[Admission] = []
        while self._waiting:
            request = self._waiting[0][0]
            count = self._group_length()
            units = budget.group_units(len(request.prompt), request.max_new_tokens, count)
            whole = not self.batcher.prefill_chunk  # (chunked prefill bounds each step's prompt tokens itself)
            # an empty batch takes the next request whole, its choices together (a TPOT target opens one slot of
            # an empty batch: n choices would wait for a width that nothing runs to measure)
            slots = self.batcher.free_slots if not taken and not self.batcher.running else free_slots
            if (len(taken) + count > slots or units > free_units
                    or (whole and taken and tokens + len(request.prompt) > self.max_prefill_tokens)):
                break
            taken.extend(self._waiting.popleft() for _ in range(count))
            free_units -= units
            tokens += len(request.prompt)
        return taken

    def _group_length(self) -> int:
        """The head of the queue and the choices after it that share its prompt."""
        head = self._waiting[0][0].request_id
        count = 1
        while count < len(self._waiting) and self._waiting[count][0].shares_prompt_with == head:
            count += 1
        return count

    def _run_step(self, cancelled: set, drain_over: bool, admissions: List[Admission]) -> None:
        batcher = self.batcher
        try:
            for row in batcher.running:
                if row.request.request_id in cancelled:
                    batcher.end(row, CANCELLED)
            if drain_over:
                batcher.end_all(ABORTED, "the server is shutting down: generation was aborted")
            if admissions:
                batcher.admit(admissions)
            batcher.step()
        except Exception as error:  # a bug or an exhausted device: fail these rows, keep serving
            log.exception("specdec serve: a decode step failed")
            message = f"the engine failed during a step ({type(error).__name__}: {error})"
            started = {id(row.request) for row in batcher.running}
            for request, sink, _ in admissions:  # admitted requests that never got a row
                if id(request) not in started:
                    self._notify(sink, RowEvent([], finished=True, finish_reason=FAILED, message=message))
            if not self._safely(lambda: batcher.end_all(FAILED, message)):
                with self._cond:
                    self.failure = message
                    self._state = BROKEN
                    self._abort_waiting(message)
        with self._cond:
            self._running = len(batcher.running)
            self._admitting = 0

    # ------------------------------------------------------------------ helpers
    def _retry_after(self) -> int:
        mean = self.metrics.mean_request_s or 1.0
        waits = (len(self._waiting) + 1) * mean / self.batcher.max_rows
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(waits))))

    def _abort_waiting(self, message: str) -> None:
        while self._waiting:
            self._end_waiting(self._waiting.popleft(), ABORTED, message)

    def _end_waiting(self, entry: Admission, reason: str, message: Optional[str]) -> None:
        request, sink, submitted_at = entry
        self._notify(sink, RowEvent([], finished=True, finish_reason=reason, message=message))
        self.metrics.record_end(reason, len(request.prompt), 0, self.clock() - submitted_at, None, None)

    @staticmethod
    def _notify(sink: EventSink, event: RowEvent) -> None:
        try:
            sink(event)
        except Exception:
            log.exception("specdec serve: delivering an event failed")

    @staticmethod
    def _safely(action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except Exception:
            log.exception("specdec serve: cleaning up after a failure failed")
            return False
