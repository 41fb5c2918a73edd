"""Incremental detokenization (stops.IncrementalText), used by the stop-string check (stops.apply_stops),
generate(stream=True) (GenerationStream) and the server's TextStream: its text equals the decode of all of
the tokens after every push, for the bundled byte-level BPE and for SentencePiece-style tokenizers (byte
fallback, a dropped leading space, clean-up of spaces, special tokens); the three places give exactly what
they gave when they decoded the whole row at every step (the old code is kept below as the reference); and
the tokens handed to decode grow linearly with the tokens streamed (they grew quadratically)."""
from __future__ import annotations

import json
import random
from typing import List, Optional

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from specdec_ext.default_pair import load_default_pair
from specdec_ext.generate import GenerationStream, _Finisher
from specdec_ext.serve.request import RowEvent
from specdec_ext.serve.text import TextStream
from specdec_ext.stops import IncrementalText, RowState, StopCriteria, apply_stops
from specdec_ext import stops as stops_module

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't stop; it's fine, isn't it? Yes!",
    "def main(x):\n    return x + 1  # comment\n\tprint('hello world')\n",
    "café naïve résumé über straße — “quotes” … 日本語 and 中文 text, 한국어 too.",
    "Numbers 0123456789, symbols @#$%^&*()[]{}<>/\\|~` and more words: alpha beta gamma delta.",
] * 20
MULTI_BYTE = "日本語のテキスト 🎉🙂😀 é à ü ñ — “x” "
BYTES = [f"<0x{b:02X}>" for b in range(256)]


# ----------------------------------------------------------------------------------- tokenizers
def llama_bpe() -> transformers.PreTrainedTokenizerFast:
    """Llama-2 style, built offline: BPE with byte fallback (a small alphabet, so that accented letters, CJK
    and emoji fall back to <0xNN> tokens), spaces as ▁ by the normaliser, decoder Replace / ByteFallback /
    Fuse / Strip (a decode drops one leading space)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, limit_alphabet=60,
                                                            special_tokens=["<unk>"], show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in BYTES + sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", clean_up_tokenization_spaces=False)


def unigram_metaspace() -> transformers.PreTrainedTokenizerFast:
    """SentencePiece Unigram style, built offline: Metaspace pre-tokenizer and decoder (the first token's ▁
    dropped), byte fallback, and clean_up_tokenization_spaces (" ," -> "," across tokens)."""
    trained = Tokenizer(models.Unigram())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trained.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                                unk_token="<unk>", max_piece_length=8,
                                                                show_progress=False))
    model = json.loads(trained.to_str())["model"]
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(b, 0.0) for b in BYTES]
    seen = {p for p, _ in pieces}
    pieces += [(p, s) for p, s in model["vocab"] if p not in seen]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", clean_up_tokenization_spaces=True)


def adversarial() -> transformers.PreTrainedTokenizerFast:
    """A tiny vocabulary of the pieces that make a suffix decode differently from the whole text's end: byte
    tokens of multi-byte characters (a byte-fallback run decodes all or nothing), ▁ and spaces (dropped at
    the start), the clean-up patterns (" n't", " 's", " ' ", " ."), a literal U+FFFD and a special token."""
    pieces = ["<unk>", "<s>", "▁", " ", "'", "n", "t", ".", "a", "s", "m", "re", "ve", "▁'", "▁n", ",", "?",
              "▁▁", "<0xE6>", "<0x97>", "<0xA5>", "<0xC3>", "<0xA9>", "<0x0A>", "<0x41>", "<0xF0>", "<0x9F>",
              "<0x8E>", "<0x89>", "\ufffd", "x"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>",
                                                clean_up_tokenization_spaces=True)


ADVERSARIAL_RUNS = [[18, 19, 20], [18, 19], [25, 26, 27, 28], [21, 22], [3, 4, 3], [14, 4, 6], [3, 7]]


@pytest.fixture(scope="module", params=["default_pair", "llama_bpe", "unigram_metaspace", "adversarial"])
def tokenizer(request):
    if request.param == "default_pair":
        return load_default_pair()[2]
    return {"llama_bpe": llama_bpe, "unigram_metaspace": unigram_metaspace, "adversarial": adversarial}[
        request.param]()


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def random_tokens(tokenizer, rng: random.Random, length: int, mode: int) -> List[int]:
    """0: uniform over the vocabulary (special tokens included); 1: a real text (multi-byte characters split
    across tokens) with a few random and special tokens mixed in; 2: byte tokens, special tokens and the
    adversarial runs, densely (the adversarial tokenizer has no real text: 1 is 2 there)."""
    vocab = len(tokenizer)
    if mode == 1 and vocab < 64:
        mode = 2
    if mode == 0:
        return [rng.randrange(vocab) for _ in range(length)]
    if mode == 1:
        text = " ".join(rng.sample(CORPUS[:4], 4)) + MULTI_BYTE
        ids = tokenizer(text * (1 + length // 40), add_special_tokens=False, verbose=False)["input_ids"]
        start = rng.randrange(max(1, len(ids) - length))
        special = tokenizer.all_special_ids
        return [t if rng.random() > 0.04 else rng.choice(special + [rng.randrange(vocab)])
                for t in ids[start:start + length]]
    out: List[int] = []
    while len(out) < length:
        if len(tokenizer) < 64 and rng.random() < 0.5:
            out += rng.choice(ADVERSARIAL_RUNS)
        elif rng.random() < 0.3:
            out += tokenizer.encode(rng.choice(MULTI_BYTE), add_special_tokens=False)
        else:
            out.append(rng.choice(tokenizer.all_special_ids + [rng.randrange(vocab)]))
    return out[:length]


def chunks(tokens: List[int], rng: random.Random, most: int = 7):
    i = 0
    while i < len(tokens):
        step = rng.randint(1, most)
        yield tokens[i:i + step]
        i += step


# ---------------------------------------------------------------------- the old code (reference)
def old_find_stop_string(row: RowState, start: int, stop: StopCriteria) -> Optional[int]:
    """stops._find_stop_string as it was, the whole row decoded twice per step (and once per prefix where a stop
    ends the row), with today's choice among several stops: the one completed by the fewest tokens, the earliest
    start among those (as one token at a time finds it: test_stops.py)."""
    text = stop.decode_text(row.tokens)
    longest = max(len(s) for s in stop.stop_strings)
    search_from = max(0, len(stop.decode_text(row.tokens[:start])) - longest)
    hits = [(text.find(s, search_from), s) for s in stop.stop_strings]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None

    def completing(index: int, string: str) -> int:
        count = start + 1
        while count < len(row.tokens) and stop.decode_text(row.tokens[:count])[index:index + len(string)] != string:
            count += 1
        return count

    count, index = min((completing(i, s), i) for i, s in hits)
    del row.tokens[count:]
    row.finished, row.finish_reason, row.stop_text_end = True, "stop", index
    return count


def old_append_until_stop(row: RowState, new_tokens: List[int], stop: StopCriteria) -> List[int]:
    """apply_stops with the old stop-string search (old_find_stop_string)."""
    current = stops_module._find_stop_string
    stops_module._find_stop_string = old_find_stop_string
    try:
        return apply_stops(row, new_tokens, stop)
    finally:
        stops_module._find_stop_string = current


class OldTextStream:
    """serve.text.TextStream as it was: all tokens decoded at every push."""

    def __init__(self, decode, stop_strings=()):
        self.decode, self.stop_strings, self.tokens, self.text = decode, list(stop_strings), [], ""

    def push(self, event: RowEvent) -> str:
        self.tokens.extend(event.tokens)
        text = self.decode(self.tokens)
        if event.stop_text_end is not None:
            text = text[: event.stop_text_end]
        elif not event.finished:
            if text.endswith("\ufffd"):
                return ""
            held = max((n for stop in self.stop_strings for n in range(1, len(stop)) if text.endswith(stop[:n])),
                       default=0)
            text = text[: len(text) - held]
        piece = text[len(self.text):]
        if len(text) > len(self.text):
            self.text = text
        return piece



def held_back(text, stop_strings) -> int:
    """The stream's held-back end, the whole-prefix way: every prefix length of every stop string."""
    return max((n for stop in stop_strings for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

def old_stream_pieces(events, rows: List[RowState], finisher: _Finisher):
    """GenerationStream.__iter__ as it was (row_text decoded the whole row at every event)."""
    sent, closed, held = [0] * len(rows), [False] * len(rows), [[] for _ in rows]
    for new in events:
        for b, tokens in enumerate(new):
            row = rows[b]
            if closed[b] or (not tokens and not row.finished):
                continue
            closed[b] = row.finished
            text = finisher.decode(row.tokens)
            text = text[: row.stop_text_end] if row.stop_text_end is not None else text
            if not row.finished:
                if text.endswith("\ufffd"):
                    held[b] += tokens
                    continue
                text = text[: len(text) - held_back(text, finisher.stop_strings)]
            piece = text[sent[b]:]
            sent[b] = max(sent[b], len(text))
            tokens, held[b] = held[b] + tokens, []
            if piece or tokens:
                yield piece, b, tokens


def stop_strings_of(text: str, rng: random.Random) -> List[str]:
    """A few pieces of ``text`` (multi-byte characters, replacement characters and all) and one that never
    occurs."""
    stops = ["@@never@@"]
    for _ in range(rng.randint(0, 3)):
        if text:
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 6)])
    return stops


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_text_equals_the_whole_decode_after_every_push(tokenizer, mode):
    rng = random.Random(100 + mode)
    decode = decoder(tokenizer)
    for trial in range(12):
        tokens = random_tokens(tokenizer, rng, rng.choice([1, 5, 40, 300, 1500]), mode)
        text = IncrementalText(decode)
        done = 0
        for chunk in chunks(tokens, rng):
            text.extend(chunk)
            done += len(chunk)
            whole = decode(tokens[:done])
            assert text.text == whole, (trial, done)
            assert len(text) == len(whole)
            i = rng.randrange(len(whole) + 2)
            assert text.text_from(i) == whole[i:]
            assert "".join(text.parts()) == whole


def test_a_very_long_text_equals_the_whole_decode(tokenizer):
    rng = random.Random(7)
    decode = decoder(tokenizer)
    tokens = random_tokens(tokenizer, rng, 20_000, 1)
    text, done = IncrementalText(decode), 0
    for chunk in chunks(tokens, rng, most=5):
        text.extend(chunk)
        done += len(chunk)
        if rng.random() < 0.01:  # (a whole decode at every step would take a while)
            assert text.text == decode(tokens[:done])
    assert text.text == decode(tokens)


def test_follow_takes_new_tokens_and_starts_again_on_a_changed_list(tokenizer):
    rng = random.Random(3)
    decode = decoder(tokenizer)
    tokens = random_tokens(tokenizer, rng, 200, 1)
    text = IncrementalText(decode)
    text.follow(tokens, 120)
    assert text.text == decode(tokens[:120])
    text.follow(tokens)
    assert text.text == decode(tokens)
    shorter = tokens[:150]
    text.follow(shorter)  # (a list that shrank: taken again)
    assert text.text == decode(shorter) and text.tokens == shorter
    changed = shorter[:-1] + [shorter[-1] + 1]
    text.follow(changed)
    assert text.text == decode(changed)


@pytest.mark.parametrize("mode", [1, 2])
def test_stop_strings_end_rows_where_the_old_check_ended_them(tokenizer, mode):
    rng = random.Random(200 + mode)
    decode = decoder(tokenizer)
    stopped = 0
    for trial in range(25):
        tokens = random_tokens(tokenizer, rng, rng.choice([10, 80, 400, 1200]), mode)
        stops = stop_strings_of(decode(tokens), rng)
        eos = [rng.randrange(len(tokenizer))] if rng.random() < 0.2 else []
        criteria = StopCriteria(max_new_tokens=rng.choice([len(tokens), len(tokens) // 2 + 1, 10 ** 6]),
                                eos_token_ids=eos, stop_strings=stops, decode_text=decode)
        new, old = RowState(), RowState()
        for chunk in chunks(tokens, rng):
            kept_new = apply_stops(new, chunk, criteria)
            kept_old = old_append_until_stop(old, chunk, criteria)
            assert kept_new == kept_old, (trial, stops)
            assert (new.tokens, new.finished, new.finish_reason, new.stop_text_end) == \
                (old.tokens, old.finished, old.finish_reason, old.stop_text_end), (trial, stops)
            if new.finished:
                break
        stopped += new.finish_reason == "stop"
    assert stopped >= 5  # (the stop strings were found, not only missed)


@pytest.mark.parametrize("mode", [1, 2])
def test_the_servers_text_stream_shows_what_it_showed(tokenizer, mode):
    rng = random.Random(300 + mode)
    decode = decoder(tokenizer)
    for trial in range(20):
        tokens = random_tokens(tokenizer, rng, rng.choice([10, 80, 600]), mode)
        stops = stop_strings_of(decode(tokens), rng) if rng.random() < 0.7 else []
        criteria = StopCriteria(max_new_tokens=rng.choice([len(tokens), 10 ** 6]), stop_strings=stops,
                                decode_text=decode)
        row = RowState()
        new, old = TextStream(decode, stops), OldTextStream(decode, stops)
        for chunk in chunks(tokens, rng):
            kept = apply_stops(row, chunk, criteria)
            event = RowEvent(tokens=kept, finished=row.finished, finish_reason=row.finish_reason,
                             stop_text_end=row.stop_text_end)
            assert new.push(event) == old.push(event), trial
            assert new.text == old.text and new.tokens == old.tokens
            if row.finished:
                break
        if not row.finished:  # the end, as the engine tells it (an incomplete character shown now)
            event = RowEvent(tokens=[], finished=True, finish_reason="length")
            assert new.push(event) == old.push(event)
            assert new.text == old.text


class _Tokenizer:
    """A tokenizer's decode that counts the tokens it is handed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream_events(rows: List[RowState], sequences, criteria: StopCriteria, rng: random.Random, append):
    """The loop's events: each step, each unfinished row takes a chunk of its tokens (``append`` checks the
    stops), as decode() yields them."""
    pending = [list(chunks(s, rng)) for s in sequences]
    while any(pending[b] and not rows[b].finished for b in range(len(rows))):
        new = []
        for b, row in enumerate(rows):
            new.append(append(row, pending[b].pop(0), criteria) if pending[b] and not row.finished else [])
        yield new


@pytest.mark.parametrize("mode", [1, 2])
def test_generate_streams_what_it_streamed(tokenizer, mode):
    rng = random.Random(400 + mode)
    decode = decoder(tokenizer)
    for trial in range(8):
        sequences = [random_tokens(tokenizer, rng, rng.choice([5, 60, 500]), mode) for _ in range(3)]
        stops = stop_strings_of(decode(sequences[0]), rng) if trial % 2 else []
        criteria = StopCriteria(max_new_tokens=400, stop_strings=stops, decode_text=decode)
        seed = rng.random()
        rows_new, rows_old = [RowState() for _ in sequences], [RowState() for _ in sequences]
        new_finisher = _Finisher(rows_new, tokenizer, None, [[]] * 3, stops)
        old_finisher = _Finisher(rows_old, tokenizer, None, [[]] * 3, stops)
        stream = GenerationStream(stream_events(rows_new, sequences, criteria, random.Random(seed), apply_stops),
                                  rows_new, new_finisher)
        got = [(str(p), p.index, p.token_ids) for p in stream]
        want = list(old_stream_pieces(stream_events(rows_old, sequences, criteria, random.Random(seed),
                                                    old_append_until_stop), rows_old, old_finisher))
        assert got == want, trial
        assert stream.result.text == [old_finisher.row_text(r) for r in rows_old]


def test_decoded_tokens_grow_linearly_with_the_stream():
    """Not a timing: the tokens handed to decode over a 4,000-token stream in steps of 1 to 5, with a stop
    string that never occurs, through the stop check, the server's TextStream and generate()'s stream (the
    old code handed it about n^2 / 2 tokens in each)."""
    base = load_default_pair()[2]
    rng = random.Random(5)
    n = 4000
    tokens = random_tokens(base, rng, n, 1)
    steps = list(chunks(tokens, rng, most=5))

    counted = _Tokenizer(base)
    decode = lambda ids: counted.decode(ids, skip_special_tokens=True)  # noqa: E731
    row = RowState()
    criteria = StopCriteria(max_new_tokens=10 ** 6, stop_strings=["@@never@@"], decode_text=decode)
    for step in steps:
        apply_stops(row, step, criteria)
    assert row.tokens == tokens and not row.finished
    assert counted.decoded < 50 * n, counted.decoded

    counted.decoded = 0
    stream = TextStream(decode, ["@@never@@"])
    shown = "".join(stream.push(RowEvent(tokens=step)) for step in steps)
    shown += stream.push(RowEvent(tokens=[], finished=True))
    assert shown == stream.text == base.decode(tokens, skip_special_tokens=True)
    assert counted.decoded < 50 * n, counted.decoded

    counted.decoded = 0
    rows = [RowState()]
    finisher = _Finisher(rows, counted, None, [[]], ["@@never@@"])

    def events():
        for i, step in enumerate(steps):
            rows[0].tokens.extend(step)
            if i == len(steps) - 1:
                rows[0].finished, rows[0].finish_reason = True, "length"
            yield [step]
    streamed = GenerationStream(events(), rows, finisher)
    assert "".join(streamed) == base.decode(tokens, skip_special_tokens=True)
    assert counted.decoded - n < 50 * n, counted.decoded  # (result() decodes the row once, at the end)

    counted.decoded = 0  # the measure tells the old way apart
    old = OldTextStream(decode, ["@@never@@"])
    for step in steps[: len(steps) // 2]:
        old.push(RowEvent(tokens=step))
    assert counted.decoded > 50 * n


def test_the_detokenize_benchmark_runs_both_methods_and_counts_the_decoded_tokens(capsys):
    """benchmarks/bench_detokenize.py end to end on a short stream: the whole-row baseline decodes more tokens
    than the stream holds, the incremental text a few per token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_detokenize

    assert bench_detokenize.main(["--lengths", "300", "--repeats", "1"]) == 0
    rows = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    300")}
    assert set(rows) == {"whole", "incremental"}
    whole, incremental = (int(rows[name][-5].replace(",", "")) for name in ("whole", "incremental"))  # (decoded)
    assert whole > 10 * 300 and incremental < 20 * 300
