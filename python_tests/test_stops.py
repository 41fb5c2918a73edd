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


def test_stop_prefix_len_is_the_longest_end_that_begins_a_stop_string():
    """stops.stop_prefix_len (the end a stream holds back) against every prefix length of every stop string,
    on random short texts; and a stop string of 400,000 characters costs no more than the text is long."""
    import random

    from specdec_ext.stops import stop_prefix_len

    def every_prefix(text, stops):
        return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        assert stop_prefix_len(text, stops) == every_prefix(text, stops), (text, stops)
    class Counted(str):  # counts the stop string's indexings and slices
        reads = 0

        def __getitem__(self, key):
            Counted.reads += 1
            return super().__getitem__(key)

    long = Counted("\x01" * 400_000)
    text = "def f(x):\n    return x\x01\x01"
    assert stop_prefix_len(text, [long]) == 2
    assert Counted.reads <= len(text)  # (every prefix length: 399,999 slices of up to 400,000 characters)


def test_the_stop_a_step_of_many_tokens_finds_is_the_one_tokens_one_at_a_time_find():
    """A speculative step appends several tokens at once; its stop check must end the row exactly where checks
    after each token would (else the output depends on how many drafts a step accepted). Random texts of
    multi-character and multi-byte tokens, overlapping stop strings, random step sizes, against one token at a
    time. It failed for overlapping stops: of "p=" and "3p==" in "3p==", the step chose the one that starts
    first ("3p==", the text "") where one token at a time ends at "p=" (the text "3")."""
    import random

    pieces = ["a", "b", "ab", "=", "==", "p", "3p", "本"]
    vocabulary = {i: piece.encode("utf-8") for i, piece in enumerate(pieces)}
    split = {}  # multi-byte pieces also as byte tokens, so that a prefix can end inside a character
    for piece in ("本",):
        for byte in piece.encode("utf-8"):
            split[len(vocabulary)] = bytes([byte])
            vocabulary[len(vocabulary)] = bytes([byte])

    def decode(tokens):
        return b"".join(vocabulary[t] for t in tokens).decode("utf-8", errors="replace")

    def run(tokens, stops, sizes):
        criteria = StopCriteria(max_new_tokens=100, stop_strings=stops, decode_text=decode)
        row, i = RowState(), 0
        while i < len(tokens) and not row.finished:
            size = next(sizes)
            apply_stops(row, tokens[i:i + size], criteria)
            i += size
        return row.tokens, row.finish_reason, row.stop_text_end

    rng = random.Random(0)
    stop_pool = ["p=", "3p==", "==", "ab", "bab", "b=", "本", "a本", "a=="]
    ended_by_stop = 0
    for _ in range(3000):
        tokens = [rng.randrange(len(vocabulary)) for _ in range(rng.randint(1, 14))]
        stops = rng.sample(stop_pool, rng.randint(2, 4))
        alone = run(tokens, stops, iter(lambda: 1, None))
        many = run(tokens, stops, iter(lambda: rng.randint(1, 6), None))
        assert many == alone, (decode(tokens), stops)
        ended_by_stop += alone[1] == "stop"
    assert ended_by_stop > 500  # (the stops do end rows)
