"""The OpenAI request bodies (validated by pydantic: a bad field is named in the 400) and response objects.

Supported request fields: prompt / messages, max_tokens (max_completion_tokens for chat; completions take 0:
the prompt scored with echo and logprobs, no token drawn), temperature,
top_p, top_k (an extension: 0 or -1 is off), seed, stop, stream, stream_options.include_usage, n (one row per choice),
ignore_eos (an extension: generate exactly max_tokens); the logits processors presence_penalty,
frequency_penalty, logit_bias and the extensions min_p and repetition_penalty (specdec_ext/processing.py);
structured output: response_format json_object / json_schema (with strict) and the extensions regex and
grammar (a Lark grammar; specdec_ext/grammar.py); logprobs (completions: an int up to 20; chat: logprobs
with top_logprobs up to 20). Fields this server does not implement are refused when they would change
the output (best_of > 1, suffix, tools / functions and a tool_choice / function_call that asks for a call);
other unknown fields are ignored. echo prepends the prompt's
text to each choice, and with logprobs the prompt tokens' logprobs to its logprobs (the first: null).
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..generate import check_text
from ..sampling import FLOAT32_MAX

if TYPE_CHECKING:
    from .text import TextOffsets

MAX_SEED = 2 ** 63 - 1  # Philox keys are int64
# OpenAI's bound on ``stop`` ("up to 4 sequences"): each one is matched against every row's text at every step
# (measured: 200,000 of them slowed an unrelated stream from 4.7 s to 8.3 s)
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20  # logprobs.MAX_TOP_LOGPROBS (OpenAI's bound)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, value):
        return False if value is None else value  # (nullable in OpenAI's types, as SamplingFields' flags)


class SamplingFields(BaseModel):
    """What completions and chat share. Strict types, as OpenAI's: "10" is not an integer nor "yes" a
    boolean (lax parsing took both; an int is still a float)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[Dict[str, Any]] = None  # {"type": "text" | "json_object" | "json_schema", ...}
    n: int = Field(1, ge=1)  # choices: one row each (at most the server's rows: checked by the service)
    ignore_eos: bool = False
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None  # token id (as a JSON key) -> bias in [-100, 100]
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)  # an extension (vLLM, llama.cpp)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)  # an extension (HF semantics)
    regex: Optional[str] = None  # an extension: the output matches this regular expression
    grammar: Optional[str] = None  # an extension: the output follows this Lark grammar

    @field_validator("stream", "n", "ignore_eos", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info: ValidationInfo):
        """OpenAI's types make these nullable (its Python client sends ``"n": null`` for n=None): null means
        the default (echo: completions')."""
        return cls.model_fields[info.field_name].get_default() if value is None else value

    @field_validator("temperature")
    @classmethod
    def _float32_temperature(cls, temperature):
        """A row holds its temperature in float32 (pydantic's le= would print the bound's 39 digits)."""
        if temperature is not None and temperature > FLOAT32_MAX:
            raise ValueError(f"must be at most {FLOAT32_MAX:.4g} (float32's largest), got {temperature:g}")
        return temperature

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        if len(strings) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(strings)}")
        for s in strings:
            check_text(s, "a stop string")
        return strings

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options, info: ValidationInfo):
        """As OpenAI: stream_options belong to a streamed request (a non-streamed one has its usage anyway)."""
        if options is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: the prompt scored (echo with logprobs), nothing drawn
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        return _refuse_unless(value, {"best_of": (None, 1), "suffix": (None, "")}[info.field_name], info.field_name)

    @property
    def top_logprobs_asked(self) -> Optional[int]:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request (n choices of it with n), got a list of {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, str):
            check_text(prompt, "the prompt")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None

    @field_validator("content")
    @classmethod
    def _valid_text(cls, content):
        for text in [content] if isinstance(content, str) else [part.text for part in content or []]:
            check_text(text, "the content")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Any]] = None
    functions: Optional[List[Any]] = None  # (tools' older spelling)
    tool_choice: Optional[Any] = None
    function_call: Optional[Any] = None

    @field_validator("tools", "functions", "tool_choice", "function_call")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        # no function calling: no tools to offer, and no choice but "none" (or "auto": call none, there being none)
        allowed = (None, []) if info.field_name in ("tools", "functions") else (None, "none", "auto")
        return _refuse_unless(value, allowed, info.field_name)

    @property
    def top_logprobs_asked(self) -> Optional[int]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The field ``token_limit`` comes from (errors name what the client sent)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _refuse_unless(value, allowed, name: str):
    """A field this server does not implement: only its values that change nothing pass."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported by this server")
    return value


# ---------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(engine_reason: Optional[str]) -> Optional[str]:
    """The OpenAI finish reason of the engine's (EOS and stop strings are both "stop")."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(engine_reason, engine_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(request_id: str, model: str, created: int, choice: Dict[str, Any], *, chunk: bool,
                      chat: bool, usage_fields: Optional[Dict[str, int]] = None, choices=None) -> Dict[str, Any]:
    """A completion (``chunk`` False) or a streamed chunk, text or chat."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body: Dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model,
                            "choices": [choice] if choices is None else choices}
    if usage_fields is not None:
        body["usage"] = usage_fields
    return body


def text_choice(text: str, reason: Optional[str], logprobs: Optional[dict] = None, index: int = 0) -> Dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def chat_choice(text: str, reason: Optional[str], logprobs: Optional[dict] = None, index: int = 0) -> Dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": reason}


def chat_delta(delta: Dict[str, str], reason: Optional[str], logprobs: Optional[dict] = None,
               index: int = 0) -> Dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def logprob_token(data: bytes) -> str:
    """A token's text in a logprobs object: its characters, or as OpenAI writes a token whose bytes are not
    whole UTF-8 characters, "bytes:\\xe6\\x97"."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


# A logprob of -inf (a token that min_p or a grammar masks, among the alternatives when fewer than top_logprobs
# tokens remain) is written as this: JSON has no infinity (the response failed with a 500, and a stream's chunk
# was not JSON), and vLLM writes the same floor.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: Optional[float]) -> Optional[float]:
    """``logprob`` as JSON holds it: at least LOGPROB_FLOOR (None stays None: echo's first prompt token)."""
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def chat_logprobs(entries: Sequence, top: int, token_bytes: Callable[[int], bytes]) -> Dict[str, Any]:
    """Chat's ``logprobs`` object from logprobs.TokenLogprob entries (``top`` alternatives each)."""
    def item(token: int, logprob: float) -> Dict[str, Any]:
        data = token_bytes(token)
        return {"token": logprob_token(data), "logprob": json_logprob(logprob), "bytes": list(data)}

    return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top[:top]])
                        for e in entries]}


def completion_logprobs(entries: Sequence, top: int, token_bytes: Callable[[int], bytes],
                        offsets: TextOffsets) -> Dict[str, Any]:
    """Completions' ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset); ``offsets``
    counts the characters of the choice's text so far (text.TextOffsets) and goes on past these tokens."""
    data = [token_bytes(e.token) for e in entries]
    return {"tokens": [logprob_token(d) for d in data], "token_logprobs": [json_logprob(e.logprob) for e in entries],
            "top_logprobs": [None if e.logprob is None else
                             {logprob_token(token_bytes(t)): json_logprob(lp) for t, lp in e.top[:top]} for e in entries],
            "text_offset": [offsets.take(d) for d in data]}


def error_body(message: str, error_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def model_card(model: str, created: int, max_model_len: int) -> Dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "specdec_ext",
            "max_model_len": max_model_len}


def model_list(model: str, created: int, max_model_len: int) -> Dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def now() -> int:
    return int(time.time())
