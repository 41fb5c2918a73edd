"""The stop checks, on the host, per row: EOS inside an accepted run (the row ends there, inclusive),
max_new_tokens (exact), stop strings (the row ends after the token that completes one; its text
excludes the string). A finished row is frozen: the loop commits nothing for it any more."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence


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
    return kept


def _find_stop_string(row: RowState, start: int, stop: StopCriteria) -> Optional[int]:
    """If a stop string now occurs in the row's text: cut the row's tokens after the token that
    completes it, mark the row finished and return the new token count; else None."""
    text = stop.decode_text(row.tokens)
    longest = max(len(s) for s in stop.stop_strings)
    search_from = max(0, len(stop.decode_text(row.tokens[:start])) - longest)
    hits = [(text.find(s, search_from), s) for s in stop.stop_strings]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None
    index, string = min(hits)
    end = index + len(string)
    count = start + 1
    # (the first prefix whose text holds the whole string: a prefix that ends inside a multi-byte character
    # decodes it to a replacement character, as long as the text that follows but not the same)
    while count < len(row.tokens) and stop.decode_text(row.tokens[:count])[index:end] != string:
        count += 1
    del row.tokens[count:]
    row.finished, row.finish_reason, row.stop_text_end = True, "stop", index
    return count
