"""Text in and out of the server.

    SharedTokenizer  the tokenizer, one call at a time (the event loop and the engine thread share it)
    TextStream       one request's text in pieces as its tokens arrive, as generate()'s stream shows it:
                     an incomplete UTF-8 sequence at the end waits for its next token; an end of the text
                     that could begin a stop string is held back until it cannot; a stop string is never
                     shown (the engine's stop check cuts the text where it begins, RowEvent.stop_text_end)
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence

from ..grammar import compile_grammar
from .request import RowEvent

INCOMPLETE_CHARACTER = "\ufffd"  # what the tokenizer decodes a partial UTF-8 sequence to


class SharedTokenizer:
    """A tokenizer used from several threads: the server's event loop encodes prompts and decodes streamed
    text while the engine thread decodes for its stop-string checks, and a fast tokenizer's Rust object
    refuses concurrent use ("Already borrowed"), so every call takes one lock (a call takes microseconds)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    @property
    def chat_template(self):
        return getattr(self.tokenizer, "chat_template", None)

    def encode(self, text: str, **kwargs) -> List[int]:
        with self._lock:
            return list(self.tokenizer(text, **kwargs)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped (as generate()'s text)."""
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def compile_grammar(self, spec, vocab_size: int, eos_token_ids: Sequence[int]):
        """grammar.compile_grammar under the lock (llguidance reads the tokenizer's vocabulary once, cached)."""
        with self._lock:
            return compile_grammar(spec, self.tokenizer, vocab_size, eos_token_ids)

    def chat_prompt(self, messages: List[Dict[str, Any]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant's turn."""
        with self._lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class TextStream:
    """Accumulates a request's tokens; ``push`` returns the text that can be shown now."""

    def __init__(self, decode: Callable[[List[int]], str], stop_strings: Sequence[str] = ()):
        self.decode = decode
        self.stop_strings = list(stop_strings)
        self.tokens: List[int] = []
        self.text = ""  # everything shown so far

    def push(self, event: RowEvent) -> str:
        """The new piece of text after ``event`` (possibly empty)."""
        self.tokens.extend(event.tokens)
        text = self.decode(self.tokens)
        if event.stop_text_end is not None:
            text = text[: event.stop_text_end]
        elif not event.finished:
            if text.endswith(INCOMPLETE_CHARACTER):
                return ""
            text = text[: len(text) - self._held_back(text)]
        piece = text[len(self.text):]
        if len(text) > len(self.text):
            self.text = text
        return piece

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the beginning of a stop string."""
        return max((n for stop in self.stop_strings for n in range(1, len(stop)) if text.endswith(stop[:n])),
                   default=0)
