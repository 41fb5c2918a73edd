"""The OpenAI request bodies (validated by pydantic: a bad field is named in the 400) and response objects.

Supported request fields: prompt / messages, max_tokens (max_completion_tokens for chat), temperature,
top_p, top_k (an extension: 0 or -1 is off), seed, stop, stream, stream_options.include_usage, n = 1,
ignore_eos (an extension: generate exactly max_tokens). Fields this server does not implement are
refused when they would change the output (logprobs, echo, best_of > 1, suffix, penalties, logit_bias,
tools, a non-text response_format); other unknown fields are ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_SEED = 2 ** 63 - 1  # Philox keys are int64


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is supported (one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return strings

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value:
            raise ValueError("penalties are not supported (they would change the target's distribution)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("logprobs", "echo", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        return _refuse_unless(value, {"logprobs": (None,), "echo": (False,), "best_of": (None, 1),
                                      "suffix": (None, "")}[info.field_name], info.field_name)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request (n = 1), got a list of {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    response_format: Optional[Dict[str, Any]] = None

    @field_validator("logprobs", "top_logprobs", "tools", "response_format")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        allowed = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                   "response_format": (None, {"type": "text"})}[info.field_name]
        return _refuse_unless(value, allowed, info.field_name)

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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


def text_choice(text: str, reason: Optional[str]) -> Dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def chat_choice(text: str, reason: Optional[str]) -> Dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}


def chat_delta(delta: Dict[str, str], reason: Optional[str]) -> Dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}


def error_body(message: str, error_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def model_list(model: str, created: int, max_model_len: int) -> Dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specdec_ext", "max_model_len": max_model_len}]}


def now() -> int:
    return int(time.time())
