"""TextStream: one request's text in pieces as its tokens arrive, as generate()'s stream shows it.

An incomplete UTF-8 sequence at the end waits for its next token; an end of the text that could begin
a stop string is held back until it cannot; a stop string is never shown (the engine's stop check
cuts the text where it begins, ``RowEvent.stop_text_end``).
"""
from __future__ import annotations

from typing import List, Sequence

from .request import RowEvent

INCOMPLETE_CHARACTER = "\ufffd"  # what the tokenizer decodes a partial UTF-8 sequence to


class TextStream:
    """Accumulates a request's tokens; ``push`` returns the text that can be shown now."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.tokens: List[int] = []
        self.text = ""  # everything shown so far

    def push(self, event: RowEvent) -> str:
        """The new piece of text after ``event`` (possibly empty)."""
        self.tokens.extend(event.tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
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
