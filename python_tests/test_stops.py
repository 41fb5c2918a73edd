"""Stop strings on byte-level tokens (stops.py): a row ends after the token that completes the string,
also where the string's characters take several tokens each (a prefix that ends inside a character
decodes it to a replacement character, which must not count as the string)."""
from __future__ import annotations

import pytest

from specdec_ext.stops import RowState, StopCriteria, apply_stops


def byte_tokens(text: str):
    return list(text.encode("utf-8"))


def byte_decode(tokens):
    return bytes(tokens).decode("utf-8", errors="replace")


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize("text, stop, kept_text", [
    ("é🎉日本語xx", "本", "é🎉日本"),
    ("🎉🎉🎉🎉", "🎉🎉", "🎉🎉"),
    ("ab本cd", "本", "ab本"),
    ("plain ascii stop here", "stop", "plain ascii stop"),
])
def test_a_row_ends_after_the_token_that_completes_a_multi_byte_stop_string(step, text, stop, kept_text):
    criteria = StopCriteria(max_new_tokens=100, stop_strings=[stop], decode_text=byte_decode)
    row = RowState()
    tokens = byte_tokens(text)
    for i in range(0, len(tokens), step):
        apply_stops(row, tokens[i:i + step], criteria)
        if row.finished:
            break
    assert row.finished and row.finish_reason == "stop"
    assert byte_decode(row.tokens) == kept_text  # every byte of the stop string kept, nothing after it
    assert row.stop_text_end == kept_text.index(stop)
