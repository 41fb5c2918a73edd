"""The HTTP app: a FastAPI app over an Engine (``create_app``); serve/server.py runs it with uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template; 400 when it has
none), GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics (Prometheus text); HEAD beside
every GET.

Errors have OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 for malformed JSON and
bad fields (``param`` names the field; strict types) and for a request that can never fit the cache (with
the numbers; code context_length_exceeded where the prompt and max_tokens pass the context, a text prompt
refused by its length before it is tokenized where it cannot fit), 404 for another model name, 429 with
Retry-After when every row runs and the queue is full, 503 while shutting down, 500 when the request's row
failed.

Streaming is server-sent events of OpenAI chunks ending with ``data: [DONE]``; a row that is aborted
(shutdown) or fails sends an error event in place of its last chunk. A client that goes away cancels its
row, which frees its cache at the next step boundary (streaming: as soon as the connection drops;
non-streaming: checked every ``DISCONNECT_POLL_S``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
from typing import Any, AsyncIterator, Callable, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..grammar import GrammarError, GrammarSpec, grammar_spec
from ..processing import Processing
from ..sampling import SamplingParams
from ..stops import FINISH_STOP_STRING, StopCriteria
from . import protocol
from .engine import RUNNING, Engine
from .protocol import ChatRequest, CompletionRequest
from .request import ABORTED, FAILED, GenerationRequest, QueueFullError, RequestRejected, RowEvent
from .text import SharedTokenizer, TextOffsets, TextStream

log = logging.getLogger("specdec_ext.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
SEED_BITS = 62  # a request without a seed draws one in [0, 2^62)
CHOICE_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # choice_seed: an odd 64-bit constant (the golden ratio's)
# A text prompt's bytes per token are at most the longest token piece's times this: a normaliser may shorten a
# character before it is tokenized (NFKC maps a 3-byte full-width letter to 1 byte), never by more than 4 to 1
NORMALISED_BYTES = 4


class ApiError(Exception):
    """An error response with OpenAI's body."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code, self.headers = status, error_type, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(self), self.error_type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


class OpenAIService:
    """Turns OpenAI requests into engine requests and engine events into OpenAI responses."""

    def __init__(self, engine: Engine, tokenizer, *, model_name: str, eos_token_ids: Sequence[int]):
        if tokenizer is None:
            raise ValueError("specdec serve needs the target's tokenizer (text in, text out)")
        self.engine, self.tokenizer, self.model_name = engine, SharedTokenizer(tokenizer), model_name
        self.eos_token_ids = list(eos_token_ids)
        self.created = protocol.now()
        self.vocab_size = engine.batcher.target.vocab_size
        self.context = engine.batcher.budget.context_len
        self.bytes_per_token = self.tokenizer.longest_piece_bytes() * NORMALISED_BYTES  # (at most)

    # ------------------------------------------------------------------ requests
    async def completion(self, body: CompletionRequest, http: Request):
        self._check_model(body.model)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        if isinstance(body.prompt, str):
            prompt = await self._tokens(body.prompt, "prompt")
        else:
            prompt = list(body.prompt)
            self._check_context(len(prompt), 0, "prompt")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token ids outside [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        self._check_context(len(prompt), max_tokens, "prompt")
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt)
        return await self._respond(body, prompt, max_tokens, http, chat=False, echo=echo)

    async def chat(self, body: ChatRequest, http: Request):
        self._check_model(body.model)
        if not self.tokenizer.chat_template:
            raise ApiError(400, f"the tokenizer of {self.model_name!r} has no chat template, so chat messages "
                                "cannot be turned into a prompt: use /v1/completions with a prompt",
                           param="messages", code="no_chat_template")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.chat_prompt(messages)
        except Exception as error:  # a template may refuse a conversation (e.g. roles out of order)
            raise ApiError(400, f"messages: the chat template refused them: {error}", param="messages") from None
        prompt = await self._tokens(text, "messages", add_special_tokens=False)  # (the template wrote the specials)
        max_tokens = body.token_limit
        self._check_context(len(prompt), max_tokens or 0, "messages", body.token_limit_field)
        if max_tokens is None:  # as OpenAI: up to the end of the context
            max_tokens = self.context - len(prompt)
        return await self._respond(body, prompt, max_tokens, http, chat=True)

    async def _tokens(self, text: str, param: str, **kwargs) -> List[int]:
        """The tokens of a prompt's text, tokenized off the event loop; a text too long for the context by its
        length alone is refused untokenized (tokenizing 5 MB held every client of the loop for 3 s)."""
        at_least = len(text.encode("utf-8")) // self.bytes_per_token
        if at_least >= self.context:
            raise self._too_long(f"{param}: the prompt has at least {at_least} tokens, past this server's context of "
                                 f"{self.context} (max_model_len): shorten the prompt", param)
        return await asyncio.to_thread(self.tokenizer.encode, text, **kwargs)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str, limit_field: str = "max_tokens") -> None:
        """A 400 with the numbers (OpenAI's code context_length_exceeded) when the prompt leaves no room to
        generate, or the prompt and max_tokens (named ``limit_field`` as the request did) pass the context."""
        if prompt_len >= self.context:
            raise self._too_long(f"{param}: the prompt has {_count(prompt_len, 'token')}, which leaves no room to "
                                 f"generate in this server's context of {self.context} (max_model_len): shorten the "
                                 "prompt", param)
        if prompt_len + max_tokens > self.context:
            raise self._too_long(f"the prompt has {_count(prompt_len, 'token')} and {limit_field}={max_tokens}: "
                                 f"{prompt_len + max_tokens} tokens, past this server's context of {self.context} "
                                 f"(max_model_len): shorten the prompt or lower {limit_field}", limit_field)

    def _too_long(self, message: str, param: str) -> ApiError:
        self.engine.metrics.record_rejected("too_large")
        return ApiError(400, message, param=param, code="context_length_exceeded")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _generation_requests(self, body, prompt: List[int], max_tokens: int) -> List[GenerationRequest]:
        """One engine request per choice (``n``): the same prompt, each choice its own Philox stream (the
        request's seed for choice 0, ``choice_seed`` for the others) and its own grammar matcher."""
        if not prompt:
            raise ApiError(400, "the prompt is empty (no tokens)", param="prompt")
        if body.n > self.engine.batcher.max_rows:
            raise ApiError(400, f"n = {body.n} choices need {body.n} rows but this server runs {self.engine.batcher.max_rows}",
                           param="n")
        if _asks_grammar(body):  # a large schema or regex compiles for up to seconds: not on the event loop
            processing, compiled = await asyncio.to_thread(self._processing, body)
        else:
            processing, compiled = self._processing(body)
        sampling = SamplingParams(DEFAULT_TEMPERATURE if body.temperature is None else float(body.temperature),
                                  max(0, body.top_k or 0), 1.0 if body.top_p is None else float(body.top_p))
        stop = StopCriteria(max_new_tokens=max_tokens, eos_token_ids=[] if body.ignore_eos else self.eos_token_ids,
                            stop_strings=list(body.stop or []), decode_text=self.tokenizer.decode)
        seed = body.seed if body.seed is not None else secrets.randbits(SEED_BITS)
        try:
            top_logprobs = body.top_logprobs_asked
        except ValueError as error:
            raise ApiError(400, str(error), param="top_logprobs") from None
        requests = [GenerationRequest(prompt=list(prompt), sampling=sampling, seed=choice_seed(seed, choice),
                                      stop=stop, seeded=body.seed is not None, processing=processing,
                                      grammar=None if compiled is None else compiled.new_row(),
                                      top_logprobs=top_logprobs)
                    for choice in range(body.n)]
        for request in requests[1:]:  # one prefill: the other choices fork the first's prompt cache
            request.shares_prompt_with = requests[0].request_id
        for request in requests:  # echo with logprobs: the prompt's come first
            request.prompt_logprobs = bool(getattr(body, "echo", False)) and top_logprobs is not None
        return requests

    def _processing(self, body) -> Tuple[Optional[Processing], Optional[object]]:
        """The request's logits processors and its compiled grammar (compiled here, before any work): a 400
        naming the field for a value out of range, a logit_bias key that is not a token id, a schema,
        regex or grammar the engine cannot compile."""
        try:
            spec = GrammarSpec.from_response_format(body.response_format)
            extension = grammar_spec(regex=body.regex, grammar=body.grammar)
            if spec is not None and extension is not None:
                raise GrammarError(extension.field, "give either response_format or regex / grammar, not both")
            spec = spec or extension
            processing = Processing.of(
                min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=body.logit_bias, grammar=spec)
            processing.validate(self.vocab_size)
            eos = [] if body.ignore_eos else self.eos_token_ids
            grammar = None if spec is None else self.tokenizer.compile_grammar(spec, self.vocab_size, eos)
        except GrammarError as error:
            param = "response_format" if error.field == "json_schema" else error.field
            raise ApiError(400, str(error), param=param) from None
        except ValueError as error:
            raise ApiError(400, str(error), param=str(error).split()[0].split("[")[0]) from None
        return (processing if processing.active else None), grammar

    # ------------------------------------------------------------------ responses
    async def _respond(self, body, prompt: List[int], max_tokens: int, http: Request, *, chat: bool,
                       echo: str = ""):
        requests = await self._generation_requests(body, prompt, max_tokens)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # (choice, RowEvent)
        sinks = [(lambda event, choice=choice: loop.call_soon_threadsafe(events.put_nowait, (choice, event)))
                 for choice in range(len(requests))]
        try:
            handles = self.engine.submit_group(requests, sinks)  # all choices or none
        except RequestRejected as error:
            headers = {"Retry-After": str(error.retry_after)} if isinstance(error, QueueFullError) else None
            raise ApiError(error.status, str(error), error.error_type, error.param, error.code,
                           headers=headers) from None
        reply = Reply(self, requests, body, chat, echo)

        def cancel() -> None:
            for choice, handle in enumerate(handles):
                if not reply.choices[choice].finished:
                    handle.cancel()

        if body.stream:
            return CancellingStream(reply.chunks(events), on_close=cancel)
        try:
            return await reply.complete(events, http)
        finally:
            cancel()


class Choice:
    """One choice of a response: its request, its text so far, its logprobs, whether it has finished."""

    def __init__(self, request: GenerationRequest, decode: Callable[[List[int]], str]):
        self.request = request
        self.text = TextStream(decode, request.stop.stop_strings)
        self.logprobs: List = []  # logprobs.TokenLogprob of every token sent so far (when asked for)
        self.prompt_logprobs: Optional[List] = None  # echo with logprobs: the prompt tokens' (the first event's)
        self.logprob_offsets = TextOffsets()  # completions: the characters before the next token's text_offset
        self.finished = False
        self.last: Optional[RowEvent] = None  # its final event
        self._held: List[Tuple[int, object]] = []  # (its first character, entry) of tokens whose text is not shown yet
        self._token_starts = TextOffsets()

    def take_logprobs(self, entries: Sequence, token_bytes: Callable[[int], bytes], event: RowEvent) -> List:
        """Of the tokens so far and ``entries`` (this event's), the logprob entries to send now: a token's goes
        with its text, once shown; when a stop string ends the row, the tokens past the text (the stop string's)
        are left out, so that the logprobs describe the text returned."""
        for entry in entries:
            self._held.append((self._token_starts.take(token_bytes(entry.token)), entry))
        if event.finished and event.finish_reason != FINISH_STOP_STRING:
            shown = math.inf  # (an EOS, which has no text, included)
        else:
            shown = len(self.text.text)
        ready = [entry for start, entry in self._held if start < shown]
        self._held = [] if event.finished else self._held[len(ready):]
        self.logprobs += ready
        return ready


class Reply:
    """One response over its ``n`` choices: the finished body, or the stream of chunks."""

    def __init__(self, service: OpenAIService, requests: Sequence[GenerationRequest], body, chat: bool,
                 echo: str = ""):
        self.service, self.body, self.chat, self.echo = service, body, chat, echo  # echo: completions' prompt text
        self.choices = [Choice(request, service.tokenizer.decode) for request in requests]
        self.ready_logprobs: List[List] = [[] for _ in requests]  # per choice: its last event's entries to send
        self.id = protocol.new_id("chatcmpl" if chat else "cmpl")
        self.created = protocol.now()

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def _object(self, choice, *, chunk: bool, usage=None, choices=None) -> dict:
        body = protocol.completion_object(self.id, self.service.model_name, self.created, choice, chunk=chunk,
                                          chat=self.chat, usage_fields=usage, choices=choices)
        if chunk and usage is None and self.body.include_usage:
            body["usage"] = None  # (OpenAI: with include_usage every chunk but the last has a null usage)
        return body

    def _usage(self) -> dict:
        """The prompt counted once, the completion tokens of every choice."""
        return protocol.usage(len(self.choices[0].request.prompt), sum(len(c.text.tokens) for c in self.choices))

    def _take(self, index: int, event: RowEvent) -> str:
        """Choice ``index`` takes ``event``; returns its new piece of text."""
        choice = self.choices[index]
        piece = choice.text.push(event)
        if event.prompt_logprobs is not None:
            choice.prompt_logprobs = event.prompt_logprobs
        if choice.request.top_logprobs is not None:
            self.ready_logprobs[index] = choice.take_logprobs(event.logprobs or [], self.service.tokenizer.token_bytes,
                                                              event)
        if event.finished:
            choice.finished, choice.last = True, event
        return piece

    async def complete(self, events: asyncio.Queue, http: Request):
        clock = asyncio.get_running_loop().time
        checked = clock()
        while not self.finished:
            try:
                index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if clock() - checked >= DISCONNECT_POLL_S:  # whether events arrive or not
                checked = clock()
                if await http.is_disconnected():
                    return PlainTextResponse("", status_code=499)  # nobody reads it; the rows are cancelled
            if event is not None:
                self._take(index, event)
        for choice in self.choices:
            error = _event_error(choice.last)
            if error is not None:
                return error.response()
        body = [(protocol.chat_choice if self.chat else protocol.text_choice)(
            self.echo + c.text.text, protocol.finish_reason(c.last.finish_reason),
            self._logprobs_object(c, (c.prompt_logprobs or []) + c.logprobs), index=i)
            for i, c in enumerate(self.choices)]
        return JSONResponse(self._object(None, chunk=False, usage=self._usage(), choices=body))

    def _logprobs_object(self, choice: Choice, entries: List) -> Optional[dict]:
        """A choice's ``logprobs`` for ``entries`` (None when the request did not ask for them)."""
        top = choice.request.top_logprobs
        if top is None:
            return None
        token_bytes = self.service.tokenizer.token_bytes
        if self.chat:
            return protocol.chat_logprobs(entries, top, token_bytes)
        return protocol.completion_logprobs(entries, top, token_bytes, choice.logprob_offsets)

    async def chunks(self, events: asyncio.Queue) -> AsyncIterator[str]:
        """The response's server-sent events; a failure while streaming ends them with an error event and
        [DONE] (the status line is sent: a cut body would leave the client a protocol error to guess from)."""
        try:
            async for chunk in self._chunks(events):
                yield chunk
        except Exception as error:  # noqa: BLE001 (whatever it is, the client hears of it)
            log.exception("a streamed response failed")
            yield _sse(protocol.error_body(f"the server failed while streaming: {type(error).__name__}: {error}",
                                           "server_error"))
            yield "data: [DONE]\n\n"

    async def _chunks(self, events: asyncio.Queue) -> AsyncIterator[str]:
        for index in range(len(self.choices)):
            if self.chat:
                yield _sse(self._object(protocol.chat_delta({"role": "assistant", "content": ""}, None, index=index),
                                        chunk=True))
            elif self.echo and not self.choices[index].request.prompt_logprobs:
                yield self._chunk(index, self.echo, None)
        while not self.finished:
            index, event = await events.get()
            piece = self._take(index, event)
            if event.prompt_logprobs is not None:  # echo with logprobs: the prompt's text with its logprobs
                yield self._chunk(index, self.echo, None, self._logprobs_object(self.choices[index],
                                                                                event.prompt_logprobs))
            error = _event_error(event)
            if error is not None:
                if piece:
                    yield self._chunk(index, piece, None)
                yield _sse(protocol.error_body(str(error), error.error_type, code=error.code))
                break
            ready = self.ready_logprobs[index]
            if piece or event.finished or ready:
                yield self._chunk(index, piece, protocol.finish_reason(event.finish_reason) if event.finished else None,
                                  self._logprobs_object(self.choices[index], ready))
        else:
            if self.body.include_usage:
                yield _sse(self._object(None, chunk=True, usage=self._usage(), choices=[]))
        yield "data: [DONE]\n\n"

    def _chunk(self, index: int, piece: str, reason: Optional[str], logprobs: Optional[dict] = None) -> str:
        if self.chat:
            choice = protocol.chat_delta({"content": piece} if piece or reason is None else {}, reason, logprobs,
                                         index=index)
        else:
            choice = protocol.text_choice(piece, reason, logprobs, index=index)
        return _sse(self._object(choice, chunk=True))


def choice_seed(seed: int, choice: int) -> int:
    """The Philox key of a request's choice ``choice``: the request's seed for the first, a distinct key for
    each other (a stream of its own, reproducible from the seed)."""
    return seed if choice == 0 else (seed * CHOICE_SEED_MULTIPLIER + choice) % (protocol.MAX_SEED + 1)


class CancellingStream(StreamingResponse):
    """An event stream that calls ``on_close`` however it ends (finished, failed, or the client left)."""

    def __init__(self, content, on_close: Callable[[], Any]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _event_error(event: RowEvent) -> Optional[ApiError]:
    if event.finish_reason == ABORTED:
        return ApiError(503, event.message or "aborted", "server_shutting_down", code="aborted")
    if event.finish_reason == FAILED:
        return ApiError(500, event.message or "the request failed", "server_error", code="row_failed")
    return None


def _asks_grammar(body) -> bool:
    """Whether the request may compile a grammar (a schema, regex or grammar)."""
    return body.response_format is not None or body.regex is not None or body.grammar is not None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


# ---------------------------------------------------------------------------------------- the app
def create_app(engine: Engine, tokenizer, *, model_name: str, eos_token_ids: Sequence[int] = ()) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine and stops it (see the module docstring)."""
    service = OpenAIService(engine, tokenizer, model_name=model_name, eos_token_ids=eos_token_ids)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="specdec_ext", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(x) for x in first.get("loc", ())[1:]]  # ("body", field, ...): the field first
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", first.get("msg", ""))
            return ApiError(400, f"the body is not valid JSON: {reason} (at character {loc[0] if loc else 0})"
                            ).response()
        if not loc and isinstance(first.get("input"), (bytes, str)):  # e.g. curl -d without the header
            return ApiError(400, "the body must be a JSON object sent with Content-Type: application/json").response()
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid').removeprefix('Value error, ')}"
        if first.get("type") != "value_error" and not isinstance(first.get("input"), (dict, list, type(None))):
            message += f" (got {first['input']!r})"
        return ApiError(400, message, param=loc[0] if loc else None).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        # (a 405's Allow header names the methods the path takes: RFC 9110 asks for it)
        return ApiError(error.status_code, str(error.detail), "invalid_request_error",
                        headers=getattr(error, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        # anything else is this server's bug: still OpenAI's error body (a client parses it), and in the log
        log.error("specdec serve: %s %s failed", request.method, request.url.path, exc_info=error)
        return ApiError(500, f"the server failed on this request ({type(error).__name__}: {error})",
                        "server_error").response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await service.completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await service.chat(body, request)

    # (HEAD beside every GET: a load balancer's health probe may send one)
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return protocol.model_list(model_name, service.created, engine.batcher.budget.context_len)

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str):
        service._check_model(model)
        return protocol.model_card(model_name, service.created, engine.batcher.budget.context_len)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.state == RUNNING:
            return {"status": "ok"}
        detail = engine.failure if engine.failure else f"the engine is {engine.state}"
        return JSONResponse({"status": engine.state, "detail": detail}, status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.gauges()), media_type="text/plain; version=0.0.4")

    return app
