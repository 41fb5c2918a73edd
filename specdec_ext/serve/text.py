"""Text in and out of the server.

    SharedTokenizer  the tokenizer, one call at a time (the event loop and the engine thread share it)
    TextStream       one request's text in pieces as its tokens arrive, as generate()'s stream shows it:
                     an incomplete UTF-8 sequence at the end waits for its next token; an end of the text
                     that could begin a stop string is held back until it cannot; a stop string is never
                     shown (the engine's stop check cuts the text where it begins, RowEvent.stop_text_end)
"""
from __future__ import annotations

import codecs
import functools
import re
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..grammar import compile_grammar
from ..stops import INCOMPLETE_CHARACTER, IncrementalText, stop_prefix_len
from .request import RowEvent

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: the printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHARACTER = _byte_level_alphabet()


class TextOffsets:
    """Completions' ``text_offset``: each token starts after the characters its predecessors' bytes complete
    (a token that ends inside a multi-byte character adds nothing until the next one completes it)."""

    def __init__(self):
        self.characters = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, data: bytes) -> int:
        """The offset of a token of bytes ``data``, then count them."""
        offset = self.characters
        self.characters += len(self._decoder.decode(data))
        return offset


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
        """The tokens of ``text`` (no warning for a text past the tokenizer's model_max_length: the server
        checks prompts against its own context)."""
        with self._lock:
            return list(self.tokenizer(text, verbose=False, **kwargs)["input_ids"])

    def longest_piece_bytes(self) -> int:
        """The most UTF-8 bytes of one token's piece, added tokens included: a text of L bytes has at least
        L / this many tokens, before normalisation."""
        with self._lock:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return max((len(piece.encode("utf-8")) for piece in pieces if piece), default=1)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped (as generate()'s text)."""
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for (b"" for a special token, as its text is skipped, and for an id
        past the tokenizer's, in a model vocabulary padded beyond it): a token of a
        byte-level BPE may hold part of a multi-byte character, which decode() alone shows as a replacement
        character."""
        with self._lock:
            if int(token) in self.tokenizer.all_special_ids:
                return b""
            piece = self.tokenizer.convert_ids_to_tokens(int(token))
            if piece is None:  # an id of a vocabulary padded past the tokenizer's: no text
                return b""
            decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF_CHARACTER for c in piece):
                return bytes(_BYTE_OF_CHARACTER[c] for c in piece)
            byte = _BYTE_FALLBACK.fullmatch(piece)
            if byte:  # a SentencePiece byte-fallback token, e.g. <0xE6>
                return bytes([int(byte.group(1), 16)])
            return self.tokenizer.decode([int(token)], skip_special_tokens=True).encode("utf-8")

    def compile_grammar(self, spec, vocab_size: int, eos_token_ids: Sequence[int]):
        """grammar.compile_grammar with the tokenizer's lock held only while llguidance reads its vocabulary
        (once, cached): the compile itself, up to seconds for a large regex, blocks no decode."""
        return compile_grammar(spec, self.tokenizer, vocab_size, eos_token_ids, tokenizer_lock=self._lock)

    def chat_prompt(self, messages: List[Dict[str, Any]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant's turn."""
        with self._lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class TextStream:
    """Accumulates a request's tokens; ``push`` returns the text that can be shown now. The text is decoded a
    few tokens at a time (stops.IncrementalText), the same as decoding all of the tokens at every push."""

    def __init__(self, decode: Callable[[List[int]], str], stop_strings: Sequence[str] = ()):
        self.decode = decode
        self.stop_strings = list(stop_strings)
        self._decoded = IncrementalText(decode)
        self.tokens: List[int] = self._decoded.tokens  # every token so far
        self._look = max([len(s) for s in self.stop_strings] + [1])  # the end of a text that the checks read
        self._shown = 0  # len(self.text)
        self._text = ""
        self._text_parts: Optional[Tuple[str, str]] = None  # self.text, not joined yet: (a + b)[:_shown]

    @property
    def text(self) -> str:
        """Everything shown so far."""
        if self._text_parts is not None:  # (joined when read, not at every push)
            self._text, self._text_parts = "".join(self._text_parts)[: self._shown], None
        return self._text

    def push(self, event: RowEvent) -> str:
        """The new piece of text after ``event`` (possibly empty)."""
        decoded = self._decoded
        decoded.extend(event.tokens)
        end = len(decoded)
        if event.stop_text_end is not None:
            end = min(end, event.stop_text_end)
        elif not event.finished:
            last = decoded.text_from(max(0, end - self._look))
            if last.endswith(INCOMPLETE_CHARACTER):
                return ""
            end -= stop_prefix_len(last, self.stop_strings)
        piece = decoded.text_from(self._shown)[: max(0, end - self._shown)]
        if end > self._shown:
            self._shown, self._text_parts = end, decoded.parts()
        return piece

