"""Structured output under speculative decoding (issue 28): the grammar side, on the host.

A request's constraint is a :class:`GrammarSpec` (a JSON schema, any JSON object, a regex or a Lark
grammar); :class:`TokenizerGrammar` holds llguidance's view of one HF tokenizer (built once, cached)
and compiles specs; each row owns a :class:`RowGrammar` (one llguidance matcher at the row's
committed text). Before a verify pass, ``fill_chain`` / ``fill_tree`` (``fill_chains``: a batch's
chains in one call of llguidance's thread pool) write the row's grammar bitmask for every column the
target scores; the verify kernel masks the logits with them, so the
rejection sampler draws from the target restricted to the grammar, and ``commit`` advances the
matcher by the emitted tokens.

Bitmask layout (llguidance's): ``W = ceil(V / 32)`` int32 words per column, token ``t`` allowed iff
bit ``t % 32`` of word ``t // 32`` is set. ``V`` is the model's vocabulary, which may exceed the
tokenizer's: ids past the tokenizer (padding rows of the embedding) are never allowed.

EOS: a row's EOS tokens (its own list, default the tokenizer's ``eos_token_id``) are allowed exactly
where the grammar accepts the committed text, and never fed to the matcher (llguidance counts an EOS
consumed in an accepting state as a token, but not one consumed after the grammar stopped, so a
rollback over it would be ambiguous); committing an EOS finishes the row's grammar.

Columns the grammar cannot reach (after a draft token the grammar does not allow, or after a draft
EOS) repeat the mask of the column where the walk stopped: the verify rejects the disallowed token at
that column (its masked p is 0), so the later columns are never sampled from, and repeating a
non-empty mask keeps every column's distribution finite (an all-zero mask would make a column's
logits all -inf: NaN probabilities, a -1 RowStatus in kernels that check every column). For the same
reason a finished row (EOS committed, frozen) and a row at a dead end (about to end with
FINISH_DEAD_END) get all-ones masks.

Costs are measured on the bundled 8192-token tokenizer by benchmarks/bench_grammar_masks.py.
"""
from __future__ import annotations

import contextlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import llguidance
import llguidance.hf
from llguidance import LLMatcher

FINISH_DEAD_END = "grammar_dead_end"  # the finish_reason of a row whose grammar allows no token and no EOS
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar")
# the whitespace a JSON output may put between its tokens, by default: one space, or a newline and up to
# 20 spaces or tabs of indentation (pretty printing). llguidance's own default ("flexible") is any run
# of JSON whitespace, which a greedy or sampled small model can fill until max_tokens (seen on the
# bundled pair: '{"user"' then newlines to the end); outlines bounds it likewise (its default: " ?")
DEFAULT_JSON_WHITESPACE = r"(\n[ \t]{0,20}|[ ]?)"
_TEMPLATES_PER_TOKENIZER = 64  # compiled grammars kept per TokenizerGrammar (LRU)
_MESSAGE_LIMIT = 600  # characters of llguidance's reason kept in a GrammarError


class GrammarError(ValueError):
    """A grammar the engine cannot compile, or one that matches nothing. ``field`` is the request field
    to blame (``json_schema``, ``regex``, ``grammar``, ``response_format``); the message starts with it."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason.strip()[:_MESSAGE_LIMIT]
        super().__init__(f"{field}: {self.reason}")


class GrammarViolation(RuntimeError):
    """Tokens committed to a row that its grammar does not allow (a bug in the caller: the verify's
    masks allow only grammatical tokens). The row's matcher is left at its state before the call."""


# ---------------------------------------------------------------------------------------------------
# GrammarSpec


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. ``kind`` is one of GRAMMAR_KINDS; ``source`` the schema as JSON text,
    the regex or the Lark text (``""`` for json_object). ``strict`` (JSON schemas): True refuses
    keywords the engine cannot enforce (llguidance's default), False ignores them (llguidance's
    ``lenient``). ``whitespace`` (JSON): the whitespace allowed between tokens; None is
    DEFAULT_JSON_WHITESPACE (one space, or a newline and up to 20 spaces / tabs), "flexible"
    llguidance's default (any run of JSON whitespace: unbounded, so a row may spend its tokens on
    newlines), "compact" none at all (separators "," and ":"), any other string a regex (e.g.
    ``r"[\x20\x0A]{0,16}"``). Build with the class methods, which check the syntax (no tokenizer needed)
    and raise GrammarError naming the field; TokenizerGrammar.compile checks the rest (a regex matching
    nothing)."""

    kind: str
    source: str = ""
    strict: bool = True
    name: Optional[str] = None
    whitespace: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError("response_format", f"unknown grammar kind {self.kind!r} (one of {GRAMMAR_KINDS})")

    @property
    def field(self) -> str:
        """The request field an error is reported against."""
        return "json_schema" if self.kind == "json_object" else self.kind

    @classmethod
    def json_schema(cls, schema: Union[str, Mapping[str, Any]], *, strict: bool = True,
                    name: Optional[str] = None, whitespace: Optional[str] = None) -> "GrammarSpec":
        """A JSON schema, as a dict or JSON text (the object under OpenAI's ``json_schema.schema``)."""
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as error:
                raise GrammarError("json_schema", f"not valid JSON: {error}") from None
        else:
            parsed = schema
        if not isinstance(parsed, Mapping):
            raise GrammarError("json_schema", f"a schema must be a JSON object, got {type(parsed).__name__}")
        try:
            text = json.dumps(parsed)  # key order kept: it is the order the properties are generated in
        except (TypeError, ValueError) as error:
            raise GrammarError("json_schema", f"not serialisable as JSON: {error}") from None
        spec = cls("json_schema", text, bool(strict), name, whitespace)
        spec.check_syntax()
        return spec

    @classmethod
    def json_object(cls, *, whitespace: Optional[str] = None) -> "GrammarSpec":
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        spec = cls("json_object", "", True, None, whitespace)
        if whitespace is not None:
            spec.check_syntax()
        return spec

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """The whole output matches ``pattern`` (Rust regex syntax, anchored at both ends)."""
        if not isinstance(pattern, str):
            raise GrammarError("regex", f"a regex must be a string, got {type(pattern).__name__}")
        spec = cls("regex", pattern)
        spec.check_syntax()
        return spec

    @classmethod
    def grammar(cls, lark: str) -> "GrammarSpec":
        """A Lark grammar as llguidance accepts it (start rule ``start``; GBNF is converted to Lark)."""
        if not isinstance(lark, str) or not lark.strip():
            raise GrammarError("grammar", "a grammar must be non-empty Lark text")
        spec = cls("grammar", lark)
        spec.check_syntax()
        return spec

    @classmethod
    def from_response_format(cls, response_format: Optional[Mapping[str, Any]]) -> Optional["GrammarSpec"]:
        """OpenAI's ``response_format``: None or ``{"type": "text"}`` -> None (no constraint);
        ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise GrammarError("response_format", "must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise GrammarError("response_format", f"unknown type {kind!r} (text, json_object, json_schema)")
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping) or "schema" not in body:
            raise GrammarError("json_schema", "response_format.json_schema must be an object with a 'schema'")
        return cls.json_schema(body["schema"], strict=bool(body.get("strict", False)), name=body.get("name"))

    def describe(self) -> str:
        """One line for plans and logs: the kind and a short excerpt of the source."""
        if self.kind == "json_object":
            return "json_object" + ("" if self.whitespace is None else f" (whitespace {self.whitespace!r})")
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        label = f"{self.kind} {self.name}" if self.name else self.kind
        label += "" if self.strict else " (lenient)"
        label += "" if self.whitespace is None else f" (whitespace {self.whitespace!r})"
        return f"{label}: {text!r}"

    def llguidance_grammar(self) -> str:
        """The grammar text llguidance's matcher takes (pure text transformation, no checks)."""
        if self.kind in ("json_object", "json_schema"):
            schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(schema, defaults=self._json_defaults(schema),
                                                      overrides=self._json_overrides())
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return llguidance.grammar_from("grammar", self.source)  # Lark, or GBNF converted to Lark

    def _json_defaults(self, schema: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """llguidance's JSON options below the schema's own ``x-guidance`` (which wins): lenient where not
        strict; DEFAULT_JSON_WHITESPACE where neither the call nor the schema says otherwise."""
        defaults: Dict[str, Any] = {} if self.strict else {"lenient": True}
        own = schema.get("x-guidance") if isinstance(schema, Mapping) else None
        says_whitespace = isinstance(own, Mapping) and ("whitespace_flexible" in own or "whitespace_pattern" in own)
        if self.whitespace is None and not says_whitespace:
            defaults["whitespace_pattern"] = DEFAULT_JSON_WHITESPACE
        return defaults or None

    def _json_overrides(self) -> Optional[Dict[str, Any]]:
        """The call's explicit ``whitespace``, above the schema's ``x-guidance``."""
        if self.whitespace is None:
            return None
        if self.whitespace == "compact":
            return {"whitespace_flexible": False}
        if self.whitespace == "flexible":
            return {"whitespace_flexible": True}
        return {"whitespace_pattern": self.whitespace}

    def check_syntax(self) -> None:
        """Raise GrammarError naming the field when llguidance cannot compile the spec (no tokenizer)."""
        try:
            grammar = self.llguidance_grammar()
        except ValueError as error:
            raise GrammarError(self.field, str(error)) from None
        message = LLMatcher.validate_grammar(grammar)
        if message and not message.startswith("WARNING"):
            raise GrammarError(self.field, message)


# ---------------------------------------------------------------------------------------------------
# TokenizerGrammar


_CACHE: "weakref.WeakKeyDictionary[Any, Dict[int, TokenizerGrammar]]" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


class CompiledGrammar:
    """A spec compiled for one tokenizer: a template matcher at the empty text; each row gets a deep copy
    (~5 us, against ~2-7 ms to compile a small JSON schema). ``eos_token_ids``: the rows' EOS
    tokens (None: the tokenizer's)."""

    def __init__(self, spec: GrammarSpec, template: LLMatcher, tokenizer_grammar: "TokenizerGrammar",
                 eos_token_ids: Optional[Sequence[int]] = None):
        self.spec = spec
        self.tokenizer_grammar = tokenizer_grammar
        self.eos_token_ids = None if eos_token_ids is None else tuple(int(t) for t in eos_token_ids)
        self._template = template

    def new_matcher(self) -> LLMatcher:
        return self._template.deep_copy()

    def new_row(self) -> "RowGrammar":
        """A fresh RowGrammar at the empty text (the start of a row's generated output)."""
        return RowGrammar(self.tokenizer_grammar, self, self.eos_token_ids)

    def with_eos(self, eos_token_ids: Optional[Sequence[int]]) -> "CompiledGrammar":
        """The same grammar for rows with these EOS tokens (shares the template)."""
        return CompiledGrammar(self.spec, self._template, self.tokenizer_grammar, eos_token_ids)


class TokenizerGrammar:
    """llguidance's tokenizer for one HF (fast) tokenizer and a model vocabulary of ``vocab_size`` ids
    (default: the tokenizer's). Building it walks the vocabulary (about 0.1 s for 8192 tokens, ~1 s for
    150k): use :meth:`for_tokenizer`, which caches one per (tokenizer, vocab_size)."""

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None):
        # no reference to ``tokenizer`` is kept: the cache holds it weakly, as the key of this value
        vocabulary = tokenizer.get_vocab()
        self.tokenizer_size = max(len(tokenizer), max(vocabulary.values()) + 1 if vocabulary else 0)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.tokenizer_size
        if self.vocab_size < self.tokenizer_size:
            raise ValueError(f"the model's vocabulary ({self.vocab_size}) is smaller than the tokenizer's "
                             f"({self.tokenizer_size}): a grammar could allow ids the model cannot emit")
        self.num_words = (self.vocab_size + 31) // 32
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        except ValueError as error:
            raise ValueError(f"llguidance cannot use this tokenizer ({error}); a fast HF tokenizer is needed") from None
        eos = tokenizer.eos_token_id
        self.eos_token_ids: Tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))
        self._pad_words = _pad_clear_words(self.tokenizer_size, self.vocab_size)
        self.has_padding = bool(self._pad_words)
        self._templates: "OrderedDict[GrammarSpec, CompiledGrammar]" = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: Optional[int] = None) -> "TokenizerGrammar":
        """The cached TokenizerGrammar of ``tokenizer`` (held weakly: it goes with the tokenizer)."""
        with _CACHE_LOCK:
            per_vocab = _CACHE.setdefault(tokenizer, {})
            key = -1 if vocab_size is None else int(vocab_size)
            if key not in per_vocab:
                per_vocab[key] = cls(tokenizer, vocab_size)
            return per_vocab[key]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` for this tokenizer (cached per spec, LRU of 64; ~2-7 ms for a small schema).
        Raises GrammarError naming the field when llguidance refuses it, or when it matches nothing
        (llguidance's validation passes a regex like ``[a&&b]``; its matcher errs at the first mask,
        "NoExtensionBias"; unsatisfiable JSON schemas are refused by the validation itself)."""
        with self._lock:
            if spec in self._templates:
                self._templates.move_to_end(spec)
                return self._templates[spec]
        try:
            grammar = spec.llguidance_grammar()
        except ValueError as error:
            raise GrammarError(spec.field, str(error)) from None
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(spec.field, matcher.get_error())
        mask = matcher.compute_bitmask()  # an unsatisfiable grammar shows only here: stopped, in error, not accepting
        if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
            reason = matcher.get_error().split("\n")[0] or matcher.stop_reason()
            raise GrammarError(spec.field, f"matches no text (llguidance stops at the start: {reason})")
        _check_first_token(spec, matcher, mask)
        compiled = CompiledGrammar(spec, matcher, self)
        with self._lock:
            self._templates[spec] = compiled
            while len(self._templates) > _TEMPLATES_PER_TOKENIZER:
                self._templates.popitem(last=False)
        return compiled

    def row(self, spec: GrammarSpec, eos_token_ids: Optional[Sequence[int]] = None) -> "RowGrammar":
        """A fresh RowGrammar for ``spec`` at the empty text (the start of the row's generated output)."""
        return self.compile(spec).with_eos(eos_token_ids).new_row()

    def clear_padding(self, words: np.ndarray) -> None:
        """Clear the bits of ids past the tokenizer in one column (uint32 view, [W])."""
        for index, keep in self._pad_words:
            words[index] &= keep


def grammar_spec(json_schema: Union[None, str, Mapping[str, Any]] = None, regex: Optional[str] = None,
                 grammar: Optional[str] = None, *, strict: bool = True,
                 whitespace: Optional[str] = None) -> Optional[GrammarSpec]:
    """generate()'s keywords as a GrammarSpec (None when all are None); at most one may be given;
    ``strict`` and ``whitespace`` apply to a JSON schema (GrammarSpec). Raises GrammarError naming the
    field for a spec llguidance cannot compile."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise GrammarError(given[1], f"give at most one of json_schema, regex, grammar (got {', '.join(given)})")
    if json_schema is not None:
        return GrammarSpec.json_schema(json_schema, strict=strict, whitespace=whitespace)
    if regex is not None:
        return GrammarSpec.regex(regex)
    if grammar is not None:
        return GrammarSpec.grammar(grammar)
    return None


def _check_first_token(spec: GrammarSpec, matcher: LLMatcher, mask) -> None:
    """GrammarError where llguidance's matcher fails on the first token the grammar allows: past its resource
    limits (a regex "a{300000}" compiles, then its lexer gives up at the first "a", "too many expressions
    constructed"), which a row would otherwise take for a dead end after one token. The matcher is rolled back."""
    words = np.frombuffer(bytes(mask), dtype=np.uint32)
    nonzero = np.flatnonzero(words)
    if not len(nonzero):
        return
    word = int(nonzero[0])
    token = word * 32 + (int(words[word]) & -int(words[word])).bit_length() - 1
    matcher.consume_token(token)
    failed = matcher.is_error()
    reason = matcher.get_error().split("\n")[0] if failed else ""
    if failed:
        raise GrammarError(spec.field, f"llguidance cannot run it: {reason}")
    matcher.rollback(1)


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: Optional[int] = None,
                    eos_token_ids: Optional[Sequence[int]] = None, tokenizer_lock=None) -> CompiledGrammar:
    """``spec`` compiled for ``tokenizer`` (TokenizerGrammar.for_tokenizer: cached) and a model of
    ``vocab_size`` ids, its rows ending with ``eos_token_ids`` (None: the tokenizer's EOS). Raises
    GrammarError naming the field (a grammar that does not compile, or matches nothing).
    ``tokenizer_lock`` (a shared tokenizer's lock) is held only while the vocabulary is read, not for the
    compile itself (up to seconds for a large regex)."""
    with tokenizer_lock or contextlib.nullcontext():
        grammars = TokenizerGrammar.for_tokenizer(tokenizer, vocab_size)
    return grammars.compile(spec).with_eos(eos_token_ids)


def _pad_clear_words(tokenizer_size: int, vocab_size: int) -> List[Tuple[int, np.uint32]]:
    """(word, bits to keep) for every word that holds an id in [tokenizer_size, vocab_size)."""
    out = []
    for index in range(tokenizer_size // 32, (vocab_size + 31) // 32):
        low = index * 32
        keep = 0
        for bit in range(32):
            if low + bit < tokenizer_size:
                keep |= 1 << bit
        if keep != 0xFFFFFFFF:
            out.append((index, np.uint32(keep)))
    return out


def _bit(token: int) -> Tuple[int, np.uint32]:
    return token >> 5, np.uint32(1 << (token & 31))


def _host_words(words: Union[np.ndarray, torch.Tensor], columns: int, num_words: int,
                ndim: int = 2) -> Tuple[np.ndarray, Any]:
    """(a C-contiguous uint32 [P, W] ([B, P, W] for ndim 3) host view to write, the tensor to copy it
    into after, or None)."""
    shape = "[P, W]" if ndim == 2 else "[B, P, W]"
    if isinstance(words, torch.Tensor):
        if words.dtype != torch.int32 or words.dim() != ndim:
            raise ValueError(f"words must be an int32 {shape} tensor, got {words.dtype} of shape {tuple(words.shape)}")
        if words.device.type == "cpu" and words.is_contiguous():
            array, copy_back = words.numpy(), None
        else:
            array, copy_back = np.empty(tuple(words.shape), dtype=np.int32), words
    else:
        array, copy_back = words, None
        if not isinstance(array, np.ndarray) or array.dtype != np.int32 or array.ndim != ndim:
            raise ValueError(f"words must be an int32 {shape} numpy array or torch tensor")
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError("words must be C-contiguous and writeable")
    if array.shape[-1] != num_words or array.shape[-2] < columns:
        raise ValueError(f"words has shape {tuple(array.shape)}; [..., >= {columns}, {num_words}] needed")
    return array.view(np.uint32), copy_back


def _finish(array: np.ndarray, copy_back: Any) -> None:
    if copy_back is not None:
        copy_back.copy_(torch.from_numpy(array.view(np.int32)))


# ---------------------------------------------------------------------------------------------------
# RowGrammar


class RowGrammar:
    """One row's grammar state: an llguidance matcher at the row's committed text (the tokens generated
    so far; the prompt is not part of the grammar). Not thread-safe; one per row.

    Tentative walks (fill_chain, fill_tree) advance the committed matcher and roll it back. A dead end
    (llguidance allowed a token after which nothing can follow: a grammar with an empty branch, as
    ``start: "a" /[a&&b]/``) puts an llguidance matcher into an error state no rollback leaves; the walk
    then rebuilds the committed matcher from the compiled template and the committed tokens (O(tokens
    so far), only at dead ends). Copying the matcher per walk instead would cost O(tokens so far)
    every time (llguidance's deep_copy: ~1 us at the start, ~17 us after 500 tokens).

    Costs (bundled 8192-token tokenizer, JSON schema, shared 2-core VM; benchmarks/bench_grammar_masks.py):
    a mask is one llguidance mask computation (6-12 us warm median; the first mask of a new lexer state
    up to a few ms) plus ~1-2 us of Python; advancing and rolling back one token ~1-2 us; a chain of
    k = 4 48-92 us; a tree of 8 nodes 77-146 us; a one-token commit 5-9 us."""

    def __init__(self, tokenizer_grammar: TokenizerGrammar, compiled: CompiledGrammar,
                 eos_token_ids: Optional[Sequence[int]] = None):
        self.tokenizer_grammar = tokenizer_grammar
        self.spec = compiled.spec
        self.num_words = tokenizer_grammar.num_words
        self.vocab_size = tokenizer_grammar.vocab_size
        self._compiled = compiled
        self._matcher = compiled.new_matcher()
        eos = tokenizer_grammar.eos_token_ids if eos_token_ids is None else tuple(int(t) for t in eos_token_ids)
        self.eos_token_ids = frozenset(t for t in eos if 0 <= t < self.vocab_size)
        # llguidance sets its own EOS bits (also where it stopped without accepting): cleared, then the
        # row's EOS bits set where the grammar accepts
        ll_eos = [t for t in tokenizer_grammar.ll_tokenizer.eos_tokens if 0 <= t < self.vocab_size]
        self._eos_clear = [_bit(t) for t in sorted(set(ll_eos) | self.eos_token_ids)]
        self._ll_eos = [_bit(t) for t in sorted(set(ll_eos))]
        self._foreign_eos = frozenset(ll_eos) - self.eos_token_ids  # llguidance's EOS, not this row's: never allowed
        # the row's EOS are llguidance's (the usual case): its masks already set them exactly where it
        # accepts (the one exception, an EOS bit where it stopped without accepting, is its error state)
        self._native_eos = frozenset(ll_eos) == self.eos_token_ids
        self._eos_set = [_bit(t) for t in sorted(self.eos_token_ids)]
        self._scratch = np.zeros((1, self.num_words), dtype=np.uint32)
        self.committed: List[int] = []  # the tokens committed (an EOS not included)
        self.finished = False  # an EOS was committed
        # a draft model's steps (draft_column): the draft tokens the matcher has consumed past the
        # committed text, the last column's mask, and whether the walk stopped (later columns repeat it)
        self._drafted: Optional[List[int]] = None
        self._draft_mask = np.zeros((1, self.num_words), dtype=np.uint32)
        self._draft_stopped = False
        self._draft_dead = False  # the walk reached a dead end: the matcher is in its error state
        self._draft_consumed = 0  # draft tokens the matcher consumed (rolled back by _end_draft)

    # -- one column ----------------------------------------------------------------------------------

    def _mask_into(self, array: np.ndarray, column: int, base: Optional[int] = None) -> bool:
        """The mask at the matcher's current state into ``array[column]`` (one llguidance mask, the
        EOS bits, the padding bits); ``base``: ``array.ctypes.data`` (~2 us to read: once per fill).
        False at a dead end (the matcher in its error state, or no token allowed: a complete match in a
        row without EOS tokens)."""
        stride = self.num_words * 4
        pointer = (array.ctypes.data if base is None else base) + column * stride
        self._matcher.unsafe_compute_mask_ptr(pointer, stride)
        if self._matcher.is_error():
            array[column] = 0
            return False
        if self.tokenizer_grammar.has_padding:  # before the EOS bits: a row's EOS may lie past the tokenizer
            self.tokenizer_grammar.clear_padding(array[column])
        if not self._native_eos:
            for index, bit in self._eos_clear:
                array[column, index] &= ~bit
            if self._matcher.is_accepting():
                for index, bit in self._eos_set:
                    array[column, index] |= bit
        return bool(array[column].any())  # nothing allowed (a complete match without EOS): a dead end too

    def _allowed_in(self, array: np.ndarray, column: int, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        index, bit = _bit(token)
        return bool(array[column, index] & bit)

    def _open_mask(self, array: np.ndarray) -> bool:
        """Column 0's mask; False (every column all ones) for a finished row or at a dead end."""
        if not self.finished and self._mask_into(array, 0) and array[0].any():
            return True
        array[:] = 0xFFFFFFFF
        return False

    def _advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # its mask allowed it: llguidance disagrees with itself
            raise RuntimeError(f"llguidance refused token {token} its own mask allowed: {self._matcher.get_error()}")

    def _restore(self, extra: Sequence[int] = ()) -> None:
        """A fresh matcher at the committed text plus ``extra`` (after a dead end in a tentative walk)."""
        matcher = self._compiled.new_matcher()
        tokens = self.committed + list(extra)
        if tokens and not matcher.consume_tokens(tokens):
            raise RuntimeError(f"llguidance cannot replay the committed tokens: {matcher.get_error()}")
        self._matcher = matcher

    def _walkable_prefix(self, draft_tokens: Sequence[int]) -> List[int]:
        """The drafts llguidance's executor may walk: up to the first EOS (the row's or llguidance's) or id
        outside the tokenizer (never allowed, and not for llguidance to judge)."""
        size, out = self.tokenizer_grammar.tokenizer_size, []
        for token in draft_tokens:
            token = int(token)
            if not 0 <= token < size or token in self.eos_token_ids or token in self._foreign_eos:
                break
            out.append(token)
        return out

    def _finish_executor_chain(self, array: np.ndarray, draft: List[int], walkable: int) -> int:
        """fill_chains' per-row part after llguidance's executor wrote raw masks at columns 0..(allowed
        drafts): llguidance's EOS bits (set where it accepts) become the row's, padding bits cleared,
        the columns past the walk repeat its last one; returns the allowed count (fill_chain's)."""
        last = 0
        while last < walkable and self._allowed_in(array, last, draft[last]):
            last += 1
        if self.tokenizer_grammar.has_padding:
            for column in range(last + 1):
                self.tokenizer_grammar.clear_padding(array[column])
        for column in range(0 if self._native_eos else last + 1):
            accepting = any(array[column, index] & bit for index, bit in self._ll_eos)
            for index, bit in self._eos_clear:
                array[column, index] &= ~bit
            if accepting:
                for index, bit in self._eos_set:
                    array[column, index] |= bit
            if column and not array[column].any():  # a complete match in a row without EOS: fill_chain's rule
                array[column:] = 0xFFFFFFFF
                return column
        if last == 0 and not array[0].any():  # a dead end at the committed text (fill_chain's rule)
            array[:] = 0xFFFFFFFF
            return 0
        allowed = last
        if last < len(draft) and draft[last] in self.eos_token_ids and self._allowed_in(array, last, draft[last]):
            allowed += 1  # an EOS where the grammar accepts: allowed, and the walk ends there
        array[last + 1:] = array[last]
        return allowed

    # -- a draft model's steps -------------------------------------------------------------------------

    def draft_column(self, words: Union[np.ndarray, torch.Tensor], drafted: Sequence[int]) -> None:
        """The mask a draft model's next token is drawn under: column ``len(drafted)`` of what
        ``fill_chain(words, drafted)`` writes (the same bits, tested), into ``words`` (int32 [W] or
        [1, W]). Incremental over one draft: the matcher keeps the drafts it has consumed between calls
        and consumes only the new ones, so drafting k tokens costs k + 1 masks, not (k + 1)(k + 2) / 2.
        ``drafted`` must extend the previous call's (a chain; anything else starts over). Every other
        method first rolls the matcher back to the committed text (``_end_draft``)."""
        drafted = [int(t) for t in drafted]
        if self._drafted is None or drafted[: len(self._drafted)] != self._drafted:
            self._end_draft()
            self._drafted, self._draft_consumed = [], 0
            self._draft_stopped = self._draft_dead = False
            if not self._open_mask(self._draft_mask):  # finished or a dead end: every column all ones
                self._draft_stopped = True
        for token in drafted[len(self._drafted):]:
            self._drafted.append(token)
            if self._draft_stopped:
                continue
            if not self._allowed_in(self._draft_mask, 0, token) or token in self.eos_token_ids:
                self._draft_stopped = True  # fill_chain's rule: the columns after it repeat this one
                continue
            self._advance(token)
            self._draft_consumed += 1
            if not self._mask_into(self._draft_mask, 0):
                self._draft_mask[:] = 0xFFFFFFFF  # a dead end: all ones, and so are the columns after it
                self._draft_stopped = self._draft_dead = True
        if isinstance(words, torch.Tensor):
            words.view(-1).copy_(torch.from_numpy(self._draft_mask[0].view(np.int32)))
        else:
            words.reshape(-1)[:] = self._draft_mask[0].view(np.int32)

    def _end_draft(self) -> None:
        """Back to the committed text after draft_column's walk."""
        if self._drafted is None:
            return
        if self._draft_dead:
            self._restore()
        elif self._draft_consumed:
            self._matcher.rollback(self._draft_consumed)
        self._drafted, self._draft_consumed = None, 0

    # -- the decode step -----------------------------------------------------------------------------

    def fill_chain(self, words: Union[np.ndarray, torch.Tensor], draft_tokens: Sequence[int]) -> int:
        """Write the masks of a chain verify: column 0 at the committed text, column c >= 1 after draft
        tokens 0..c-1. Columns after the first draft token the grammar does not continue through (one it
        does not allow, or an EOS) repeat that token's column; columns past the chain
        (``len(draft_tokens) + 1`` to P - 1) repeat the last one; a column at a dead end (llguidance
        allowed the token before it, nothing can follow) is all ones, and so are the columns after it
        (commit then keeps the tokens up to the dead end, and is_dead_end ends the row). The matcher
        ends at the committed state. Returns how many leading draft tokens the grammar allows (an EOS
        where it accepts counts; the verify rejects at the first one it does not allow). Cost:
        (allowed tokens + 1) masks and as many one-token advances, one rollback. ``words``: int32
        [P, W], P >= len(draft_tokens) + 1, a numpy array or a tensor (a CPU contiguous one is written
        in place; any other is filled on the host, then copied in). A finished row (EOS committed) or
        one at a dead end gets all ones in every column (it is frozen or ending: its tokens are
        discarded, and finite logits keep the verifier's status checks quiet) and 0 is returned."""
        self._end_draft()
        n = len(draft_tokens)
        array, copy_back = _host_words(words, n + 1, self.num_words)
        if not self._open_mask(array):
            _finish(array, copy_back)
            return 0
        allowed = last = 0  # last: the column of the matcher's state (= the draft tokens consumed)
        dead, base = False, array.ctypes.data
        for token in draft_tokens:
            token = int(token)
            if not self._allowed_in(array, last, token):
                break
            allowed += 1
            if token in self.eos_token_ids:
                break  # the row would end here: nothing after it is sampled
            self._advance(token)
            last += 1
            if not self._mask_into(array, last, base):
                array[last] = 0xFFFFFFFF
                dead = True
                break
        if last + 1 < array.shape[0]:
            array[last + 1:] = array[last]
        if dead:
            self._restore()
        elif last:
            self._matcher.rollback(last)
        _finish(array, copy_back)
        return allowed

    def fill_tree(self, words: Union[np.ndarray, torch.Tensor], tokens: Sequence[int],
                  parents: Sequence[int]) -> List[bool]:
        """Write the masks of a tree verify: column 0 at the committed text, column i + 1 after node i
        with its ancestors as prefix (parents[i] in [-1, i), -1 = a child of the root; csrc/tree.h).
        A node the grammar does not reach (its token, or an ancestor's, not allowed; or an EOS on the
        path above it) repeats the column of its deepest reachable ancestor; a dead end (as in
        fill_chain) is all ones, its subtree too; columns past the tree repeat column 0. Walks the tree
        depth first with one advance and one rollback per reachable non-EOS node: (reachable nodes + 1)
        masks. Returns, per node, whether its whole path is allowed. A finished row or one at a dead
        end: all ones, as fill_chain."""
        self._end_draft()
        n = len(tokens)
        if len(parents) != n:
            raise ValueError(f"tokens ({n}) and parents ({len(parents)}) differ in length")
        array, copy_back = _host_words(words, n + 1, self.num_words)
        parent_of = [int(p) + 1 for p in parents]  # by column: 0 the root, node i is column i + 1
        children: List[List[int]] = [[] for _ in range(n + 1)]
        for column, parent_column in enumerate(parent_of, start=1):
            if not 0 <= parent_column < column:
                raise ValueError(f"parents[{column - 1}] = {parent_column - 1}: nodes must be in topological "
                                 "order (-1 <= parent < i)")
            children[parent_column].append(column)
        if not self._open_mask(array):
            _finish(array, copy_back)
            return [False] * n
        reached = self._walk_tree(array, [int(t) for t in tokens], parent_of, children)
        if n + 1 < array.shape[0]:
            array[n + 1:] = array[0]
        _finish(array, copy_back)
        return reached

    def _walk_tree(self, array: np.ndarray, tokens: List[int], parent_of: List[int],
                   children: List[List[int]]) -> List[bool]:
        """fill_tree's depth-first walk from the committed state (column 0 written); back there after."""
        live = [True] + [False] * len(tokens)  # the column's state is the matcher's while its subtree is walked
        reached = [False] * len(tokens)
        base = array.ctypes.data
        path: List[int] = []  # the tokens consumed since the committed state
        stack: List[Tuple[int, bool]] = [(child, False) for child in reversed(children[0])]
        while stack:
            column, leaving = stack.pop()
            if leaving:
                self._matcher.rollback(1)
                path.pop()
                continue
            parent_column, token = parent_of[column - 1], tokens[column - 1]
            ok = live[parent_column] and self._allowed_in(array, parent_column, token)
            reached[column - 1] = ok
            if ok and token not in self.eos_token_ids:
                self._advance(token)
                if self._mask_into(array, column, base):
                    live[column] = True
                    path.append(token)
                    stack.append((column, True))
                else:  # a dead end: all ones here and below; the matcher rebuilt at the parent's state
                    array[column] = 0xFFFFFFFF
                    self._restore(path)
            else:
                array[column] = array[parent_column]
            stack.extend((child, False) for child in reversed(children[column]))
        return reached

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance the matcher by a step's emitted tokens; returns how many of them the row keeps. An
        EOS (where the grammar accepts) finishes the row's grammar: the tokens after it are not kept
        (the row ends at its EOS; stops.py trims them). A token after which nothing can follow (a dead
        end) is kept and the tokens after it are not: is_dead_end() is then True. Raises
        GrammarViolation (the matcher unchanged) when a token is not allowed. A finished row takes
        nothing (returns 0). Cost: one llguidance advance per token (~1-2 us), no mask (one where a
        token is refused, to tell a dead end from a violation)."""
        self._end_draft()
        if self.finished:
            return 0
        body = [int(t) for t in tokens]
        eos_at = next((i for i, t in enumerate(body) if t in self.eos_token_ids), None)
        if eos_at is not None:
            body = body[:eos_at]
        size = self.tokenizer_grammar.tokenizer_size
        bad = next((i for i, t in enumerate(body) if not 0 <= t < size or t in self._foreign_eos), len(body))
        done = self._matcher.try_consume_tokens(body[:bad])
        if done < len(body):
            if not self._mask_into(self._scratch, 0):  # a dead end after `done` tokens: they stay
                self.committed.extend(body[:done])
                return done
            self._matcher.rollback(done)
            raise GrammarViolation(f"token {body[done]} (position {done} of {list(tokens)}) is not allowed by the "
                                   f"{self.spec.kind} grammar after {len(self.committed)} committed tokens")
        if eos_at is not None and not self._matcher.is_accepting():
            self._matcher.rollback(done)
            raise GrammarViolation(f"EOS at position {eos_at} of {list(tokens)} where the {self.spec.kind} grammar "
                                   "does not accept the text")
        self.committed.extend(body)
        self.finished = eos_at is not None
        return len(body) + (1 if self.finished else 0)

    # -- queries at the committed state ----------------------------------------------------------------

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    def forced_tokens(self) -> List[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the tokenization of the
        bytes every continuation starts with, less a last token that could merge with what follows);
        [] when nothing is forced. A drafter may propose them as they are. Cost: about one mask."""
        self._end_draft()
        if self.finished or self._matcher.is_error():
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def mask_at_committed(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The column-0 mask alone, int32 [W] (into ``out``, C-contiguous int32 [W], when given), e.g. for
        a drafter that samples under the grammar; all zeros for a finished row or at a dead end. Cost:
        one mask."""
        self._end_draft()
        target = self._scratch if out is None else out.reshape(1, -1).view(np.uint32)
        if target.shape != (1, self.num_words):
            raise ValueError(f"out must hold {self.num_words} int32 words")
        if self.finished:
            target[:] = 0
        else:
            self._mask_into(target, 0)
        return target[0].view(np.int32).copy() if out is None else out

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next: its bit in the column-0 mask (an EOS: where the grammar
        accepts). Not llguidance's ``validate_tokens``, which is looser: where the grammar forces bytes
        the mask allows only the first token of their canonical tokenization (regex "ab": only "ab",
        while the matcher would also consume "a" then "b"). Cost: one mask."""
        self._end_draft()
        token = int(token)
        if self.finished or not 0 <= token < self.vocab_size:
            return False
        self._mask_into(self._scratch, 0)
        return self._allowed_in(self._scratch, 0, token)

    def is_accepting(self) -> bool:
        """The committed text is a complete match (an EOS may come next). Cost: ~0.1 us."""
        self._end_draft()
        return not self.finished and self._matcher.is_accepting()

    def is_complete(self) -> bool:
        """The text is a complete match and nothing but EOS can follow (llguidance stopped, accepting):
        a row without EOS tokens should finish here ("stop"). Cost: ~0.1 us."""
        self._end_draft()
        return self.finished or (self._matcher.is_stopped() and self._matcher.is_accepting())

    def is_dead_end(self) -> bool:
        """No token allowed and EOS not allowed either: the row must end, finish_reason FINISH_DEAD_END
        ("grammar_dead_end"). Includes a complete grammar in a row without EOS tokens. Cost: one mask."""
        self._end_draft()
        if self.finished:
            return False
        return not (self._mask_into(self._scratch, 0) and self._scratch.any())

    def error(self) -> str:
        """llguidance's error message ('' when none; at a dead end llguidance reports its stop reason)."""
        self._end_draft()
        return self._matcher.get_error()


def fill_unconstrained(words: Union[np.ndarray, torch.Tensor]) -> None:
    """All bits set: the mask of a row without a grammar (the kernel then leaves its logits as they are)."""
    if isinstance(words, torch.Tensor):
        words.fill_(-1)
    else:
        words.fill(-1)


_EXECUTOR: Optional[llguidance.LLExecutor] = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()  # llguidance's thread pool: 80% of the CPUs, at most 32
    return _EXECUTOR


def fill_chains(rows: Sequence[Optional[RowGrammar]], words: Union[np.ndarray, torch.Tensor],
                drafts: Sequence[Sequence[int]]) -> List[int]:
    """A batch's fill_chain: row b's masks into ``words[b]`` ([B, P, W] int32), the same as
    ``rows[b].fill_chain(words[b], drafts[b])`` (tested), all rows' llguidance work in one call of
    llguidance's executor, in parallel threads without the GIL; rows None (no grammar) get all ones.
    Returns each row's count of allowed leading drafts (0 for rows None). Cost: the masks of every row
    divided over the executor's threads, plus ~5 us of Python per row; a row at a dead end is redone
    on its own (rare). On the shared 2-core VM: 35-70 us per row over 8-32 rows against 45-105 us for
    fill_chain in turn; with the cores oversubscribed (load 6) up to 3x slower than fill_chain in turn
    (the executor's threads wait for a CPU): measure on the serving host before preferring it."""
    for row in rows:
        if row is not None:
            row._end_draft()  # (the executor walks each row's matcher from its committed text)
    num_words = next((row.num_words for row in rows if row is not None), int(words.shape[-1]))
    longest = max((len(draft) for draft in drafts), default=0)
    array, copy_back = _host_words(words, longest + 1, num_words, ndim=3)
    if array.shape[0] != len(rows) or len(drafts) != len(rows):
        raise ValueError(f"words has {array.shape[0]} rows, rows {len(rows)}, drafts {len(drafts)}: one each")
    P, W = array.shape[1], array.shape[2]
    work, counts = [], [0] * len(rows)
    for b, row in enumerate(rows):
        if row is None or row.finished:
            array[b] = 0xFFFFFFFF
        elif not row._ll_eos:  # no llguidance EOS to tell where it accepts: on its own
            counts[b] = row.fill_chain(array[b].view(np.int32), drafts[b])
        else:
            work.append((row, b, row._walkable_prefix(drafts[b])))
    pointer, size = array.ctypes.data, len(rows) * P
    chains = [(row._matcher, b * P, prefix) for row, b, prefix in work if prefix]
    if chains:
        _executor().unsafe_compute_mask_ptr_with_draft_token(chains, pointer, W * 4, size)
    singles = [(row._matcher, b * P) for row, b, prefix in work if not prefix]  # it refuses empty drafts
    if singles:
        _executor().unsafe_compute_mask_ptr(singles, pointer, W * 4, size)
    for row, b, prefix in work:
        if row._matcher.is_error():  # a dead end inside the walk: llguidance's matcher cannot roll back
            row._restore()
            counts[b] = row.fill_chain(array[b].view(np.int32), drafts[b])
        else:
            counts[b] = row._finish_executor_chain(array[b], [int(t) for t in drafts[b]], len(prefix))
    _finish(array, copy_back)
    return counts
