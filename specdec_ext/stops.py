"""The stop checks, on the host, per row: EOS inside an accepted run (the row ends there, inclusive),
max_new_tokens (exact), stop strings (the row ends after the token that completes one; its text
excludes the string). A finished row is frozen: the loop commits nothing for it any more.

IncrementalText is a row's text decoded a few tokens at a time, equal to decoding all of them: the stop-string
check here, generate()'s stream and the server's TextStream keep one each, so that a long row costs no more
host time per token than a short one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

INCOMPLETE_CHARACTER = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to
FINISH_STOP_STRING = "stop"  # a row's finish_reason when a stop string ended it


@dataclass
class StopCriteria:
    """Host-side stop checks. ``decode_text`` maps token ids to text (needed for stop strings)."""

    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    decode_text: Optional[Callable[[List[int]], str]] = None


@dataclass
class RowState:
    """What the host knows of one row: its returned tokens and why it stopped."""

    tokens: List[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None  # "eos", "length", "stop"
    stop_text_end: Optional[int] = None  # with "stop": the text ends here (the stop string excluded)
    logprobs: Optional[list] = None  # one logprobs.TokenLogprob per token, when asked for
    decoded: Optional["IncrementalText"] = field(default=None, repr=False, compare=False)  # the stop-string
    #                                                      check's text of ``tokens`` (while unfinished)


def apply_stops(row: RowState, new_tokens: List[int], stop: StopCriteria, logprobs: Optional[list] = None) -> List[int]:
    """Append ``new_tokens`` to a row up to the first stop; returns the tokens actually appended.
    ``logprobs`` (one per new token) join ``row.logprobs`` for the tokens kept."""
    before = len(row.tokens)
    kept = _append_until_stop(row, new_tokens, stop)
    if logprobs is not None:
        if row.logprobs is None:
            row.logprobs = []
        row.logprobs.extend(logprobs[: len(row.tokens) - before])
    return kept


def _append_until_stop(row: RowState, new_tokens: List[int], stop: StopCriteria) -> List[int]:
    kept: List[int] = []
    for token in new_tokens:
        if len(row.tokens) + len(kept) >= stop.max_new_tokens:
            break
        kept.append(token)
        if token in stop.eos_token_ids:
            row.finished, row.finish_reason = True, "eos"
            break
    start = len(row.tokens)
    row.tokens.extend(kept)
    if stop.stop_strings and kept:
        cut = _find_stop_string(row, start, stop)
        if cut is not None:
            kept = kept[: max(0, cut - start)]
    if not row.finished and len(row.tokens) >= stop.max_new_tokens:
        row.finished, row.finish_reason = True, "length"
    if row.finished:
        row.decoded = None  # (a finished row takes no more tokens)
    return kept


def stop_prefix_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins a stop string (a stream holds it back, so that a stop
    string is never partly shown). Only the ends that start with a stop string's first character are compared,
    and none longer than the text: trying every prefix length of a stop string was quadratic in its length (a
    400,000-character stop string blocked the server's event loop for a second per event)."""
    best = 0
    for stop in stop_strings:
        tail = text[len(text) - min(len(stop) - 1, len(text)):]  # (its last len(stop) - 1 characters at most)
        i = tail.find(stop[0]) if tail else -1
        while i != -1 and len(tail) - i > best:
            if stop.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(stop[0], i + 1)
    return best


def _find_stop_string(row: RowState, start: int, stop: StopCriteria) -> Optional[int]:
    """If a stop string now occurs in the row's text: cut the row's tokens after the token that
    completes it, mark the row finished and return the new token count; else None. Only the text that can
    hold a new match is searched: the new text and the longest stop string's length before it."""
    decoded = row.decoded
    if decoded is None or decoded.decode != stop.decode_text:
        decoded = row.decoded = IncrementalText(stop.decode_text)
    decoded.follow(row.tokens, start)  # (nothing to do: it took the tokens at the row's last check)
    longest = max(len(s) for s in stop.stop_strings)
    search_from = max(0, len(decoded) - longest)
    decoded.extend(row.tokens[start:])
    text = decoded.text_from(search_from)  # the row's text from search_from on
    hits = [(text.find(s), s) for s in stop.stop_strings]
    hits = sorted((search_from + i, s) for i, s in hits if i >= 0)
    if not hits:
        return None
    # The stop that one token at a time would have seen first: the one completed by the fewest tokens (not the
    # one that starts first: of "p=" and "3p==" in "3p==", "p=" ends a token sooner), the earliest start among
    # those completed by the same token (as a check after that token alone takes).
    count, index = len(row.tokens) + 1, None
    for hit_index, string in hits:
        hit_count = _completing_count(row, start, hit_index, string, stop, count)
        if hit_count < count:
            count, index = hit_count, hit_index
    del row.tokens[count:]
    row.finished, row.finish_reason, row.stop_text_end = True, FINISH_STOP_STRING, index
    return count


def _completing_count(row: RowState, start: int, index: int, string: str, stop: StopCriteria, limit: int) -> int:
    """The fewest of the row's tokens (more than ``start``) whose text holds ``string`` at ``index``, or ``limit``
    if that takes ``limit`` or more. (A prefix that ends inside a multi-byte character decodes it to a
    replacement character, as long as the text that follows but not the same; this runs when a row stops.)"""
    end = index + len(string)
    count = start + 1
    while count < min(len(row.tokens), limit) and stop.decode_text(row.tokens[:count])[index:end] != string:
        count += 1
    return count if count < limit else limit


class IncrementalText:
    """The text of a growing list of tokens, always equal to ``decode(tokens)``, at a cost per new token that
    does not grow with the text: only a window of the last tokens is decoded again.

    The text is ``before + window``: ``window`` decodes ``tokens[start:]``, ``before`` is the text before it.
    A decode of a suffix need not be the end of the whole text (SentencePiece drops a leading space, a run of
    byte-fallback tokens decodes all or nothing, a token that ends inside a character decodes to U+FFFD,
    clean-up turns " ." into "."), so the window moves on only to a start where the suffix decodes to exactly
    the whole text's end, HEAD characters or more, between two tokens that decode alone to whole characters.
    New tokens change the text only near them, except where a byte-fallback run reaches back across the
    window's start and turns invalid: that changes the window's first tokens' text too, so while the window
    starts with its head (its first tokens' text: whole tokens, followed by one) the text before it stands;
    when it does not, the whole text is decoded (the window starts at 0) until the window can move on. (A
    clean-up of spaces reaches back 3 characters at most: not past a window of HEAD characters.)"""

    HEAD = 8  # characters a window has, at least, when it moves to a new start
    KEEP = 8  # tokens the window keeps when it moves
    SLACK = 16  # tokens the window grows by before it moves
    TRIES = 8  # starts tried per move (at most TRIES_DECODED of them decoded)
    TRIES_DECODED = 2

    def __init__(self, decode: Callable[[List[int]], str]):
        self.decode = decode
        self.tokens: List[int] = []
        self._alone: Dict[int, bool] = {}  # token -> whether it decodes alone to whole characters
        self._clear()

    def _clear(self) -> None:
        del self.tokens[:]
        self._start = 0  # the window: tokens[_start:]
        self._before = ""  # the text before the window
        self._window = ""  # decode(tokens[_start:])
        self._head = ""  # the text of the window's first tokens when it moved to _start: its start stays that
        self._next_move = self.SLACK  # the token count at which the window tries to move on

    def __len__(self) -> int:
        return len(self._before) + len(self._window)

    @property
    def text(self) -> str:
        """decode(tokens)."""
        return self._before + self._window

    def text_from(self, index: int) -> str:
        """text[index:], at the cost of that much text (and the window)."""
        if index >= len(self._before):
            return self._window[index - len(self._before):]
        return self._before[index:] + self._window

    def parts(self) -> Tuple[str, str]:
        """(a, b) with a + b == text, in constant time (the strings are not copied)."""
        return self._before, self._window

    def follow(self, tokens: Sequence[int], end: Optional[int] = None) -> None:
        """Take ``tokens[:end]``: the tokens taken so far and new ones after them (a list that changed
        otherwise, as far as its last tokens tell, is taken again from nothing)."""
        end = len(tokens) if end is None else end
        have = len(self.tokens)
        tail = max(0, have - self.KEEP)
        if end < have or list(tokens[tail:have]) != self.tokens[tail:]:
            self._clear()
            have = 0
        if end > have:
            self.extend(tokens[have:end])

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens``."""
        if not len(new_tokens):
            return
        self.tokens.extend(int(t) for t in new_tokens)
        window = self.decode(self.tokens[self._start:])
        if self._start and not window.startswith(self._head):
            # the new tokens changed text before the window: decode it all
            self._start, self._before, self._head = 0, "", ""
            window = self.decode(self.tokens)
            self._next_move = len(self.tokens)
        self._window = window
        if len(self.tokens) >= self._next_move:
            self._move()

    def _move(self) -> None:
        n, tokens = len(self.tokens), self.tokens
        tried = 0
        for start in range(n - self.KEEP, max(self._start, n - self.KEEP - self.TRIES), -1):
            if not (self._whole(tokens[start - 1]) and self._whole(tokens[start])):
                continue
            window = self.decode(tokens[start:])
            if len(window) >= self.HEAD and self._window.endswith(window):
                head = self._head_of(start, window)
                if head:
                    self._before += self._window[: len(self._window) - len(window)]
                    self._start, self._window, self._head = start, window, head
                    self._next_move = n + self.SLACK
                    return
            tried += 1
            if tried == self.TRIES_DECODED:
                break
        self._next_move = n + 1  # (a try decodes a few tokens, however long the window has grown)

    def _head_of(self, start: int, window: str) -> str:
        """The text of the window's first tokens that are whole and followed by a whole token ("" where
        there are none, or they decode to nothing or not to the window's start)."""
        end = start
        while end + 1 < len(self.tokens) and self._whole(self.tokens[end + 1]):
            end += 1
        head = self.decode(self.tokens[start:end]) if end > start else ""
        return head if INCOMPLETE_CHARACTER not in head and window.startswith(head) else ""

    def _whole(self, token: int) -> bool:
        """Whether ``token`` decodes alone to whole characters (or to nothing), not to a byte of one."""
        whole = self._alone.get(token)
        if whole is None:
            whole = self._alone[token] = INCOMPLETE_CHARACTER not in self.decode([token])
        return whole
