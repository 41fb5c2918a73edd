"""One request as the engine sees it, what each step tells it, and why the engine may refuse it."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..logprobs import TokenLogprob
from ..processing import Processing
from ..sampling import SamplingParams
from ..stops import StopCriteria

# how a request ended, besides stops.RowState's "eos", "stop", "length" and grammar.FINISH_DEAD_END
CANCELLED = "cancelled"  # the client went away (or cancelled it)
ABORTED = "abort"  # the server is shutting down
FAILED = "error"  # the row's step failed (e.g. the model gave NaN logits); other rows are unaffected


@dataclass
class GenerationRequest:
    """Token ids in, new token ids out, with the row's own filter, seed and stop checks."""

    prompt: List[int]
    sampling: SamplingParams
    seed: int  # Philox key of the row: its draws depend on (seed, its own step), not on the batch
    stop: StopCriteria  # max_new_tokens, EOS ids, stop strings (and their decode_text)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seeded: bool = False  # the client chose the seed: its tokens must not depend on the load (a fixed k)
    processing: Optional[Processing] = None  # logits processors (checked against the vocabulary by the engine)
    grammar: Optional[object] = None  # its grammar.RowGrammar (structured output), compiled by the caller
    top_logprobs: Optional[int] = None  # logprobs of each new token with this many alternatives; None: off
    prompt_logprobs: bool = False  # echo with logprobs: the prompt tokens' logprobs come with the first event
    shares_prompt_with: Optional[str] = None  # n choices: the request_id of the choice whose prompt cache this
    #                                            one forks (its prompt is the same; Engine.submit_group)

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens


@dataclass
class RowEvent:
    """New tokens of one request after a step (or its prefill), and how it ended."""

    tokens: List[int]
    finished: bool = False
    finish_reason: Optional[str] = None  # "eos", "stop", "length", CANCELLED, ABORTED or FAILED
    stop_text_end: Optional[int] = None  # "stop": the text ends here (the stop string excluded)
    message: Optional[str] = None  # ABORTED / FAILED: why
    logprobs: Optional[List[TokenLogprob]] = None  # one per token, when the request asked for them
    prompt_logprobs: Optional[List[TokenLogprob]] = None  # the first event of a prompt_logprobs request: one
    #                                                       per prompt token (the first one's logprob None)


EventSink = Callable[[RowEvent], None]  # called from the engine thread; must not block


class RequestRejected(Exception):
    """The engine did not take a request; ``status`` is the HTTP status it maps to."""

    status = 400
    error_type = "invalid_request_error"
    code: Optional[str] = None
    param: Optional[str] = None

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class RequestTooLargeError(RequestRejected):
    """The request can never fit the cache (the message has the numbers)."""


class QueueFullError(RequestRejected):
    """Every slot is running and the queue is full: try again after ``retry_after`` seconds."""

    status = 429
    error_type = "requests"  # OpenAI's shape: the limit that was hit in "type", what happened in "code"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(RequestRejected):
    """The server is shutting down (or its engine failed) and takes no new requests."""

    status = 503
    error_type = "service_unavailable"
