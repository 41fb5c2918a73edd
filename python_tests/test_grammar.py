"""Structured output's grammar side (issue 28, specdec_ext/grammar.py): llguidance masks per verify column
on the bundled tokenizer. Sampling random allowed tokens under the masks yields text the schema / regex /
grammar accepts; fill_chain and fill_tree write the masks the step-by-step matcher gives and leave it at
the committed state; forced tokens; EOS and padding ids; dead ends; errors naming the field."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from specdec_ext.grammar import (FINISH_DEAD_END, GrammarError, GrammarSpec, GrammarViolation, RowGrammar,
                                 TokenizerGrammar, compile_grammar, fill_chains, fill_unconstrained, grammar_spec)

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "specdec_ext" / "default_pair" / "tokenizer"
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # bounded walks: no free whitespace

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                              "id": {"type": "integer", "minimum": 0, "maximum": 999}},
             "required": ["name", "id"], "additionalProperties": False},
    "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False}
ENUMS_ARRAYS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
    "required": ["color", "tags"], "additionalProperties": False}
NUMBERS = {"type": "object", "properties": {
    "x": {"type": "number", "minimum": -5, "maximum": 5},
    "n": {"type": "integer", "minimum": 1, "maximum": 20},
    "nothing": {"type": "null"}}, "required": ["x", "n"], "additionalProperties": False}
ARRAY_OF_OBJECTS = {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                                               "required": ["k"], "additionalProperties": False},
                    "maxItems": 2}
SCHEMAS = {"nested": NESTED, "enums_arrays": ENUMS_ARRAYS, "numbers": NUMBERS, "array_of_objects": ARRAY_OF_OBJECTS}
DEAD_END_GRAMMAR = 'start: "a" /[a&&b]/ | "b"'  # "a" is allowed, and nothing can follow it


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return TokenizerGrammar.for_tokenizer(tokenizer)


def allowed_ids(mask) -> np.ndarray:
    """The token ids a [W] int32 mask allows."""
    mask = np.ascontiguousarray(np.asarray(mask, dtype=np.int32))
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]


def validate(value, schema) -> None:
    """A tiny JSON-schema validator for the subset the tests use (asserts)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
        return
    kind = schema["type"]
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in checks:
        assert isinstance(value, checks[kind]), (value, kind)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), value
    assert schema.get("minimum", -np.inf) <= value if kind in ("integer", "number") else True
    assert value <= schema.get("maximum", np.inf) if kind in ("integer", "number") else True
    if kind == "string":
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10 ** 9), value
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10 ** 9), value
        for item in value:
            validate(item, schema["items"])
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), value
        if schema.get("additionalProperties", True) is False:
            assert set(value) <= set(schema["properties"]), value
        for key, item in value.items():
            validate(item, schema["properties"][key])


def sample(row: RowGrammar, rng: np.random.Generator, eos: int, stop_probability: float = 0.5,
           max_steps: int = 600) -> list:
    """Random allowed tokens, one at a time, until the grammar accepts (then EOS with some probability);
    returns the committed tokens. Every mask is checked against allows()."""
    for _ in range(max_steps):
        ids = allowed_ids(row.mask_at_committed())
        assert len(ids), "a sampling walk reached a dead end"
        assert (eos in ids) == row.is_accepting() == row.allows(eos)
        if row.is_accepting() and (rng.random() < stop_probability or len(ids) == 1):
            assert row.commit([eos]) == 1 and row.finished
            return row.committed
        choices = ids[ids != eos]
        token = int(rng.choice(choices))
        assert row.allows(token)
        row.commit([token])
    raise AssertionError(f"no accepting state within {max_steps} tokens: {row.committed}")


def reference_masks(grammars: TokenizerGrammar, spec: GrammarSpec, prefix, tokens) -> np.ndarray:
    """The masks after prefix + tokens[:c] for c = 0..len(tokens), each from a fresh row (commit, then
    mask_at_committed): what fill_chain must write while every token is allowed."""
    out = []
    for c in range(len(tokens) + 1):
        row = grammars.row(spec)
        row.commit(list(prefix) + list(tokens[:c]))
        out.append(row.mask_at_committed())
    return np.stack(out)


def walk(grammars: TokenizerGrammar, spec: GrammarSpec, rng: np.random.Generator, length: int, eos: int):
    """``length`` random allowed non-EOS tokens from the empty text (fewer where the grammar ends)."""
    row = grammars.row(spec)
    tokens = []
    for _ in range(length):
        ids = allowed_ids(row.mask_at_committed())
        ids = ids[ids != eos]
        if not len(ids):
            break
        tokens.append(int(rng.choice(ids)))
        row.commit(tokens[-1:])
    return tokens


# ------------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_follows_the_schema(grammars, tokenizer, name):
    schema = {**SCHEMAS[name], **COMPACT}
    spec = GrammarSpec.json_schema(schema)
    for seed in range(3):
        row = grammars.row(spec)
        tokens = sample(row, np.random.default_rng(seed), tokenizer.eos_token_id)
        validate(json.loads(tokenizer.decode(tokens)), SCHEMAS[name])


def test_json_whitespace_and_json_object(grammars, tokenizer):
    # the default whitespace between JSON tokens (bounded: DEFAULT_JSON_WHITESPACE); json_object is any object
    row = grammars.row(GrammarSpec.json_schema(NESTED))
    validate(json.loads(tokenizer.decode(sample(row, np.random.default_rng(7), 0, stop_probability=1.0))), NESTED)
    row = grammars.row(GrammarSpec.json_object())
    row.commit(tokenizer.encode('{"k": [1, {"a": null}], "s": "x"}'))
    assert row.is_accepting() and row.allows(tokenizer.eos_token_id)
    row = grammars.row(GrammarSpec.json_object())
    with pytest.raises(GrammarViolation):
        row.commit(tokenizer.encode("[1]"))  # an object, not any JSON value
    cases = [('{\n  "a": 1\n}', None, True), ('{"a":  1}', None, False), ("{\n\n}", None, False),
             ('{"a":  1}', "flexible", True), ('{\n  "a": 1\n}', "compact", False), ('{"a":1}', "compact", True),
             ('{\n  "a": 1\n}', r"[\x20\x0A]{0,3}", True), ('{\n  "a": 1\n}', r" ?", False)]
    for text, whitespace, ok in cases:  # the default: one space, or a newline and some indentation
        row = grammars.row(GrammarSpec.json_object(whitespace=whitespace))
        try:
            row.commit(tokenizer.encode(text))
        except GrammarViolation:
            assert not ok, (text, whitespace)
        else:
            assert ok and row.is_accepting(), (text, whitespace)
    compact = grammars.row(GrammarSpec.json_schema(NESTED, whitespace="compact"))
    assert tokenizer.decode(compact.forced_tokens()) == '{"user":{"name":'


def test_regex(grammars, tokenizer):
    spec = GrammarSpec.regex(r"[0-9]{3}-[a-z]{2}(x|yz)?")
    for seed in range(4):
        tokens = sample(grammars.row(spec), np.random.default_rng(seed), tokenizer.eos_token_id)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}(x|yz)?", tokenizer.decode(tokens))


def test_lark_grammar(grammars, tokenizer):
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{1,5}/\n'
    spec = GrammarSpec.grammar(lark)
    seen = set()
    for seed in range(6):
        text = tokenizer.decode(sample(grammars.row(spec), np.random.default_rng(seed), tokenizer.eos_token_id))
        assert re.fullmatch(r"(hello|hi) [a-z]{1,5}!", text), text
        seen.add(text.split()[0])
    assert seen == {"hello", "hi"}


# ------------------------------------------------------------------------------------------------ fill_chain


def test_fill_chain_matches_step_by_step_and_rolls_back(grammars, tokenizer):
    spec = GrammarSpec.json_schema(NESTED)
    rng = np.random.default_rng(11)
    tokens = walk(grammars, spec, rng, 12, tokenizer.eos_token_id)
    prefix, draft = tokens[:6], tokens[6:11]
    row = grammars.row(spec)
    row.commit(prefix)
    before = row.mask_at_committed()
    words = np.zeros((len(draft) + 3, grammars.num_words), dtype=np.int32)  # two columns past the chain
    assert row.fill_chain(words, draft) == len(draft)
    reference = reference_masks(grammars, spec, prefix, draft)
    np.testing.assert_array_equal(words[: len(draft) + 1], reference)
    np.testing.assert_array_equal(words[len(draft) + 1:], np.broadcast_to(reference[-1], (2, grammars.num_words)))
    np.testing.assert_array_equal(row.mask_at_committed(), before)  # back at the committed state
    assert row.num_committed == len(prefix)
    row.commit(draft)  # and it still advances
    np.testing.assert_array_equal(row.mask_at_committed(), reference[-1])


def test_fill_chain_with_a_disallowed_draft_token(grammars, tokenizer):
    spec = GrammarSpec.json_schema(ENUMS_ARRAYS)
    tokens = walk(grammars, spec, np.random.default_rng(5), 8, tokenizer.eos_token_id)
    prefix, good = tokens[:4], tokens[4:6]
    row = grammars.row(spec)
    row.commit(prefix)
    before = row.mask_at_committed()
    reference = reference_masks(grammars, spec, prefix, good)
    bad = int(np.setdiff1d(np.arange(1, grammars.vocab_size), allowed_ids(reference[-1]))[0])  # not EOS (0)
    draft = good + [bad] + tokens[6:8]
    words = np.full((len(draft) + 1, grammars.num_words), 7, dtype=np.int32)
    assert row.fill_chain(words, draft) == 2  # the verify rejects at column 2
    np.testing.assert_array_equal(words[:3], reference)
    for column in range(3, len(draft) + 1):  # documented: the columns after it repeat its column
        np.testing.assert_array_equal(words[column], reference[-1])
    np.testing.assert_array_equal(row.mask_at_committed(), before)
    with pytest.raises(GrammarViolation, match="not allowed"):
        row.commit(good + [bad])
    np.testing.assert_array_equal(row.mask_at_committed(), before)  # a refused commit changes nothing
    assert row.commit(good) == 2


def test_fill_chain_into_tensors(grammars, tokenizer):
    spec = GrammarSpec.regex(r"[a-c]{2,6}")
    row = grammars.row(spec)
    draft = tokenizer.encode("abca")
    expected = np.zeros((len(draft) + 1, grammars.num_words), dtype=np.int32)
    row.fill_chain(expected, draft)
    batch = torch.zeros((2, len(draft) + 3, grammars.num_words), dtype=torch.int32)
    row.fill_chain(batch[1, : len(draft) + 1], draft)  # a contiguous view: written in place
    np.testing.assert_array_equal(batch[1, : len(draft) + 1].numpy(), expected)
    assert not batch[0].any() and not batch[1, len(draft) + 1:].any()
    strided = torch.zeros((grammars.num_words, len(draft) + 1), dtype=torch.int32).t()  # not contiguous
    row.fill_chain(strided, draft)
    np.testing.assert_array_equal(strided.numpy(), expected)
    with pytest.raises(ValueError, match="shape"):
        row.fill_chain(np.zeros((2, grammars.num_words), dtype=np.int32), draft)
    unconstrained = torch.zeros((3, grammars.num_words), dtype=torch.int32)
    fill_unconstrained(unconstrained)
    assert (unconstrained == -1).all()


# ------------------------------------------------------------------------------------------------ fill_tree


def random_tree(grammars, spec, prefix, rng, nodes: int):
    """Random parents; each node's token an allowed one under its path (70%) or any token."""
    tokens, parents = [], []
    for i in range(nodes):
        parent = int(rng.integers(-1, i)) if i else -1
        path, node = [], parent
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        row = grammars.row(spec)
        row.commit(prefix)
        ok = row.fill_chain(np.zeros((len(path) + 1, grammars.num_words), dtype=np.int32), path[::-1])
        ids = allowed_ids(row.mask_at_committed()) if ok == len(path) else []
        if ok == len(path):
            row.commit(path[::-1])
            ids = allowed_ids(row.mask_at_committed())
        token = int(rng.choice(ids)) if len(ids) and rng.random() < 0.7 else int(rng.integers(0, grammars.vocab_size))
        tokens.append(token)
        parents.append(parent)
    return tokens, parents


def test_fill_tree_equals_fill_chain_along_every_path(grammars, tokenizer):
    spec = GrammarSpec.json_schema(NUMBERS)
    rng = np.random.default_rng(21)
    prefix = walk(grammars, spec, rng, 3, tokenizer.eos_token_id)
    for _ in range(4):
        tokens, parents = random_tree(grammars, spec, prefix, rng, 10)
        row = grammars.row(spec)
        row.commit(prefix)
        before = row.mask_at_committed()
        words = np.zeros((len(tokens) + 2, grammars.num_words), dtype=np.int32)
        reached = row.fill_tree(words, tokens, parents)
        np.testing.assert_array_equal(row.mask_at_committed(), before)
        np.testing.assert_array_equal(words[0], before)
        np.testing.assert_array_equal(words[-1], before)  # columns past the tree repeat column 0
        for i in range(len(tokens)):
            path, node = [], i
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            chain = np.zeros((len(path) + 1, grammars.num_words), dtype=np.int32)
            allowed = row.fill_chain(chain, path[::-1])
            assert reached[i] == (allowed == len(path)), (i, path)
            np.testing.assert_array_equal(words[i + 1], chain[len(path)], err_msg=f"node {i}")
        np.testing.assert_array_equal(row.mask_at_committed(), before)


def test_fill_tree_checks_its_parents(grammars):
    row = grammars.row(GrammarSpec.regex("[ab]+"))
    words = np.zeros((3, grammars.num_words), dtype=np.int32)
    with pytest.raises(ValueError, match="topological"):
        row.fill_tree(words, [1, 2], [-1, 1])
    with pytest.raises(ValueError, match="length"):
        row.fill_tree(words, [1, 2], [-1])


# ------------------------------------------------------------------------------------------------ forced tokens


def test_forced_tokens_are_the_only_continuations(grammars, tokenizer):
    spec = GrammarSpec.json_schema({**NESTED, **COMPACT})
    row = grammars.row(spec)
    assert tokenizer.decode(row.forced_tokens()) == '{"user":{"name":'  # required keys, no free whitespace
    start = grammars.row(GrammarSpec.json_schema(NESTED))  # flexible whitespace: only "{" is forced
    assert tokenizer.decode(start.forced_tokens()) == "{"
    np.testing.assert_array_equal(allowed_ids(start.mask_at_committed()), start.forced_tokens())
    decode = grammars.ll_tokenizer.decode_bytes
    rng = np.random.default_rng(2)
    checked = 0
    for _ in range(60):
        if row.is_accepting():
            break
        forced = row.forced_tokens()
        ids = allowed_ids(row.mask_at_committed())
        if forced:
            checked += 1
            forced_bytes = decode(forced)
            assert forced[0] in ids
            for token in ids:  # every allowed token agrees with the forced bytes
                piece = decode([int(token)])
                assert piece.startswith(forced_bytes) or forced_bytes.startswith(piece), (piece, forced_bytes)
            before = row.num_committed
            row.commit(forced)  # a drafter may propose them as they are
            assert row.num_committed == before + len(forced)
        else:
            row.commit([int(rng.choice(ids[ids != tokenizer.eos_token_id]))])
    assert checked >= 3  # '{', '"user":{"name":"', ... are forced in a compact schema with required keys
    assert not grammars.row(GrammarSpec.regex("[ab]")).forced_tokens()


# ------------------------------------------------------------------------------ EOS, padding, dead ends


def test_row_eos_tokens(grammars, tokenizer):
    spec = GrammarSpec.regex("ab?")
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    row = grammars.row(spec, eos_token_ids=[5, 6])  # the row's EOS, not the tokenizer's (0)
    assert set(allowed_ids(row.mask_at_committed())) == {a, tokenizer.convert_tokens_to_ids("ab")}
    row.commit([a])
    assert set(allowed_ids(row.mask_at_committed())) == {5, 6, b}  # accepting: the row's EOS, not 0
    assert row.allows(5) and not row.allows(0)
    with pytest.raises(GrammarViolation, match="not allowed"):
        row.commit([0])  # the tokenizer's EOS is an ordinary (disallowed) token in this row
    words = np.zeros((4, grammars.num_words), dtype=np.int32)
    assert row.fill_chain(words, [5, b, b]) == 1  # an EOS ends the walk: later columns repeat its column
    assert all((words[c] == words[0]).all() for c in range(4))
    assert row.fill_chain(words, [b, 6, 9]) == 2
    assert list(allowed_ids(words[1])) == [5, 6] and (words[2] == words[1]).all() and (words[3] == words[1]).all()
    assert row.commit([b, 6, 123, 456]) == 2  # the tokens after the EOS are not kept
    assert row.finished and not row.is_dead_end() and row.commit([a]) == 0
    words[:] = 0
    assert row.fill_chain(words, [a]) == 0 and (words == -1).all()  # a finished row: all ones
    with pytest.raises(GrammarViolation, match="EOS"):
        grammars.row(spec, eos_token_ids=[5]).commit([5])  # not accepting yet


def test_padding_ids_are_never_allowed(tokenizer):
    size = len(tokenizer)
    grammars = TokenizerGrammar.for_tokenizer(tokenizer, vocab_size=size + 45)
    assert grammars is TokenizerGrammar.for_tokenizer(tokenizer, vocab_size=size + 45)
    assert grammars.num_words == (size + 45 + 31) // 32 and grammars.vocab_size == size + 45
    rng = np.random.default_rng(0)
    for spec in (GrammarSpec.regex(r"[\s\S]{0,12}"), GrammarSpec.json_object()):
        row = grammars.row(spec)
        for _ in range(10):
            words = np.zeros((4, grammars.num_words), dtype=np.int32)
            ids = allowed_ids(row.mask_at_committed())
            assert len(ids) and ids.max() < size
            draft = [int(t) for t in rng.choice(ids, 3)]
            row.fill_chain(words, draft)
            assert all(allowed_ids(words[c]).max() < size for c in range(4))
            assert not row.allows(size) and not row.allows(size + 44)
            if row.is_accepting():
                break
            row.commit([int(rng.choice(ids[ids != 0]))])
    row = grammars.row(GrammarSpec.regex("a"), eos_token_ids=[size + 3])  # an EOS past the tokenizer
    row.commit([tokenizer.convert_tokens_to_ids("a")])
    assert list(allowed_ids(row.mask_at_committed())) == [size + 3] and row.allows(size + 3)
    with pytest.raises(ValueError, match="smaller"):
        TokenizerGrammar(tokenizer, vocab_size=size - 1)


def test_dead_end(grammars, tokenizer):
    spec = GrammarSpec.grammar(DEAD_END_GRAMMAR)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    row = grammars.row(spec)
    before = row.mask_at_committed()
    assert set(allowed_ids(before)) == {a, b} and not row.is_dead_end()
    words = np.zeros((4, grammars.num_words), dtype=np.int32)
    assert row.fill_chain(words, [a, b, b]) == 1  # "a" is allowed; after it nothing is: all ones
    np.testing.assert_array_equal(words[0], before)
    assert (words[1:] == -1).all()
    tree = np.zeros((4, grammars.num_words), dtype=np.int32)
    assert row.fill_tree(tree, [a, b, a], [-1, -1, 0]) == [True, True, False]
    assert (tree[1] == -1).all() and (tree[3] == -1).all() and list(allowed_ids(tree[2])) == [0]
    np.testing.assert_array_equal(row.mask_at_committed(), before)  # the walks left the matcher usable
    assert row.commit([a, b, b]) == 1  # kept up to the dead end
    assert row.is_dead_end() and not row.is_accepting() and row.forced_tokens() == []
    assert row.fill_chain(words, [b]) == 0 and (words == -1).all()  # an ending row: all ones
    assert FINISH_DEAD_END == "grammar_dead_end"
    done = grammars.row(GrammarSpec.regex("ab"), eos_token_ids=())  # complete, and no EOS to end it
    done.commit([a, b])
    assert done.is_complete() and done.is_accepting() and done.is_dead_end()
    with_eos = grammars.row(GrammarSpec.regex("ab"))
    with_eos.commit([a, b])
    assert with_eos.is_complete() and not with_eos.is_dead_end()
    assert list(allowed_ids(with_eos.mask_at_committed())) == [tokenizer.eos_token_id]


def _draft_cases(grammars, tokenizer):
    """(spec, committed prefix, drafts) walks: allowed drafts, a disallowed one, an EOS inside, a dead end,
    a finished row."""
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    eos = tokenizer.eos_token_id
    cases = []
    for seed, schema in enumerate((NESTED, ENUMS_ARRAYS, NUMBERS)):
        spec = GrammarSpec.json_schema(schema)
        tokens = walk(grammars, spec, np.random.default_rng(seed), 14, eos)
        cases.append((spec, tokens[:5], tokens[5:11]))
        cases.append((spec, tokens[:3], tokens[3:5] + [7, 8] + tokens[5:7]))  # a token the grammar refuses
    c = tokenizer.convert_tokens_to_ids("c")
    cases.append((GrammarSpec.regex("abc?"), [], [a, b, eos, c]))  # EOS where it accepts (c could follow), then more
    cases.append((GrammarSpec.grammar(DEAD_END_GRAMMAR), [], [a, b, b]))  # a dead end after "a"
    cases.append((GrammarSpec.regex("ab"), [a, b, eos], [a, b]))  # a finished row
    return cases


def test_draft_column_is_fill_chains_column_and_rolls_back(grammars, tokenizer):
    """A draft model's steps: draft_column after i drafts writes the bits fill_chain writes in column i, one
    new mask per step (the matcher kept between calls), and any other method finds the committed state."""
    for spec, prefix, drafts in _draft_cases(grammars, tokenizer):
        row, reference_row = grammars.row(spec), grammars.row(spec)
        for r in (row, reference_row):
            r.commit(prefix)
        before = reference_row.mask_at_committed()
        full = np.zeros((len(drafts) + 1, grammars.num_words), dtype=np.int32)
        reference_row.fill_chain(full, drafts)
        for i in range(len(drafts) + 1):
            column = np.zeros(grammars.num_words, dtype=np.int32)
            row.draft_column(column, drafts[:i])
            np.testing.assert_array_equal(column, full[i], err_msg=f"{spec.describe()}, column {i}")
        np.testing.assert_array_equal(row.mask_at_committed(), before)  # rolled back for the verify
        again = np.zeros_like(full)
        assert row.fill_chain(again, drafts) == reference_row.fill_chain(full, drafts)
        np.testing.assert_array_equal(again, full)
    spec, prefix, drafts = _draft_cases(grammars, tokenizer)[0]
    row = grammars.row(spec)
    row.commit(prefix)
    column = torch.zeros(grammars.num_words, dtype=torch.int32)
    row.draft_column(column, drafts[:2])
    row.draft_column(column, [drafts[0], drafts[2]])  # not an extension of the last call: starts over
    full = np.zeros((3, grammars.num_words), dtype=np.int32)
    row.fill_chain(full, [drafts[0], drafts[2]])
    np.testing.assert_array_equal(column.numpy(), full[2])
    assert row.commit(drafts[:3]) == 3 and row.num_committed == len(prefix) + 3  # commits from the committed text


# ------------------------------------------------------------------------------------------------ errors and specs


@pytest.mark.parametrize("make, field, reason", [
    (lambda: GrammarSpec.json_schema("{not json"), "json_schema", "not valid JSON"),
    (lambda: GrammarSpec.json_schema([1, 2]), "json_schema", "JSON object"),
    (lambda: GrammarSpec.json_schema({"type": "objectx"}), "json_schema", "objectx"),
    (lambda: GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "json_schema", "Unsatisfiable"),
    (lambda: GrammarSpec.json_schema({"type": "string", "format": "weird"}), "json_schema", "weird"),
    (lambda: GrammarSpec.json_schema({"type": "object"}, whitespace="[ "), "json_schema", "unclosed"),
    (lambda: GrammarSpec.regex("[0-9"), "regex", "unclosed"),
    (lambda: GrammarSpec.regex(3), "regex", "string"),
    (lambda: GrammarSpec.grammar("start: foo"), "grammar", "foo"),
    (lambda: GrammarSpec.grammar(""), "grammar", "non-empty"),
    (lambda: grammar_spec(json_schema={"type": "object"}, regex="a"), "regex", "at most one"),
    (lambda: GrammarSpec.from_response_format({"type": "xml"}), "response_format", "xml"),
    (lambda: GrammarSpec.from_response_format({"type": "json_schema"}), "json_schema", "schema"),
])
def test_bad_inputs_name_the_field(make, field, reason):
    with pytest.raises(GrammarError, match=reason) as info:
        make()
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)


def test_unsatisfiable_regex_is_refused_at_compile(grammars, tokenizer):
    spec = GrammarSpec.regex("[a&&b]")  # the syntax is fine; llguidance's matcher stops at once
    with pytest.raises(GrammarError, match="matches no text") as info:
        grammars.compile(spec)
    assert info.value.field == "regex"
    with pytest.raises(GrammarError, match="regex: matches no text"):
        compile_grammar(spec, tokenizer)


def test_specs_and_caches(grammars, tokenizer):
    lenient = GrammarSpec.json_schema({"type": "string", "format": "weird"}, strict=False)
    assert "lenient" in lenient.describe()
    assert grammars.compile(lenient).new_row().allows(tokenizer.convert_tokens_to_ids('"'))
    text = json.dumps(NESTED)
    assert GrammarSpec.json_schema(text) == GrammarSpec.json_schema(NESTED)  # hashable, equal by value
    assert grammars.compile(GrammarSpec.json_schema(text)) is grammars.compile(GrammarSpec.json_schema(NESTED))
    assert TokenizerGrammar.for_tokenizer(tokenizer) is grammars
    response = {"type": "json_schema", "json_schema": {"name": "user", "schema": NESTED, "strict": True}}
    spec = GrammarSpec.from_response_format(response)
    assert spec.kind == "json_schema" and spec.strict and spec.name == "user" and "user" in spec.describe()
    assert GrammarSpec.from_response_format({"type": "json_object"}) == GrammarSpec.json_object()
    assert GrammarSpec.from_response_format({"type": "text"}) is None and grammar_spec() is None
    assert grammar_spec(regex="a+") == GrammarSpec.regex("a+")
    compiled = compile_grammar(GrammarSpec.regex("a+"), tokenizer, len(tokenizer), [3])
    row = compiled.new_row()
    assert row.eos_token_ids == {3} and isinstance(row, RowGrammar)


# ------------------------------------------------------------------------------------------------ the batch


def test_fill_chains_equals_fill_chain_per_row(tokenizer):
    """llguidance's executor path gives every row what fill_chain gives it: valid, disallowed and EOS
    drafts, the row's own EOS, padding ids, rows without a grammar, finished rows, dead ends."""
    size = len(tokenizer)
    grammars = TokenizerGrammar.for_tokenizer(tokenizer, vocab_size=size + 40)
    a = tokenizer.convert_tokens_to_ids("a")
    rng = np.random.default_rng(4)
    specs = [GrammarSpec.json_schema(NESTED), GrammarSpec.regex(r"[0-9]{1,3}(,[0-9]{1,3}){0,3}"),
             GrammarSpec.grammar(DEAD_END_GRAMMAR), GrammarSpec.json_schema(NUMBERS)]
    for trial in range(6):
        rows, drafts = [], []
        for b in range(7):
            if b == 0:
                rows.append(None)
                drafts.append([1, 2])
                continue
            spec = specs[b % len(specs)]
            eos = [0] if b % 3 else ([7, 0] if trial % 2 else [])  # [] a row without EOS (ignore_eos)
            tokens = walk(grammars, spec, rng, 6, 0) if spec.kind != "grammar" else []
            row = grammars.row(spec, eos_token_ids=eos)
            cut = int(rng.integers(0, len(tokens) + 1))
            row.commit(tokens[:cut])
            draft = tokens[cut:]
            if spec.kind == "grammar":
                draft = [a, a] if trial % 2 else [tokenizer.convert_tokens_to_ids("b"), 0]
            roll = rng.random()
            if roll < 0.3 and draft:
                draft[int(rng.integers(0, len(draft)))] = int(rng.integers(0, grammars.vocab_size))
            elif roll < 0.5 and eos:
                draft = draft[:2] + [int(rng.choice(eos))] + draft[2:]
            if b == 6 and row.is_accepting() and eos:
                row.commit([eos[0]])  # finished
            rows.append(row)
            drafts.append(draft[:5])
        expected = np.zeros((7, 6, grammars.num_words), dtype=np.int32)
        counts = [0 if row is None else row.fill_chain(expected[b], drafts[b]) for b, row in enumerate(rows)]
        expected[0] = -1
        before = [None if row is None or row.finished else row.mask_at_committed() for row in rows]
        got = torch.zeros((7, 6, grammars.num_words), dtype=torch.int32)
        assert fill_chains(rows, got, drafts) == counts
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"trial {trial}")
        for row, mask in zip(rows, before):
            if mask is not None:
                np.testing.assert_array_equal(row.mask_at_committed(), mask)


def test_fill_chains_where_a_row_without_eos_completes(grammars, tokenizer):
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    rows = [grammars.row(GrammarSpec.regex("[ab]"), eos_token_ids=()), grammars.row(GrammarSpec.regex("[ab]"))]
    drafts = [[a, b, a], [a, 0, b]]
    expected = np.zeros((2, 4, grammars.num_words), dtype=np.int32)
    counts = [row.fill_chain(expected[i], drafts[i]) for i, row in enumerate(rows)]
    assert counts == [1, 2]
    assert (expected[0, 1:] == -1).all()  # complete, and no EOS to end it: all ones from there (a dead end)
    assert list(allowed_ids(expected[1, 1])) == [0] and (expected[1, 3] == expected[1, 1]).all()
    got = np.zeros_like(expected)
    assert fill_chains(rows, got, drafts) == counts
    np.testing.assert_array_equal(got, expected)


def test_the_mask_is_stricter_than_the_matcher_where_bytes_are_forced(grammars, tokenizer):
    # llguidance's mask allows only the canonical first token of forced bytes; its matcher consumes more
    a, b, ab = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "ab"))
    row = grammars.row(GrammarSpec.regex("ab"))
    assert list(allowed_ids(row.mask_at_committed())) == [ab] == row.forced_tokens()
    assert not row.allows(a) and row.allows(ab)
    assert row.commit([a, b]) == 2 and row.is_accepting()  # commit takes what the matcher takes
