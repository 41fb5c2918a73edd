"""The public API: ``generate()`` and ``plain_generate()``: normalise the prompts -> plan (plan.py) ->
build the runners and the drafter (build.py) -> decode (decode.py); the result object and streaming."""
from __future__ import annotations

import contextlib
import numbers
import operator
import secrets
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import distributed
from .adaptive import AdaptiveK
from .build import build
from .decode import LoopConfig, decode, pad_batch
from .models import MAX_MISMATCHES_REPORTED, ModelSpec, Models, load_models
from .grammar import compile_grammar, grammar_spec
from .logprobs import TokenLogprob
from .plan import DecodePlan, make_plan
from .processing import Processing
from .runners import output_vocab_size
from .sampling import SamplingParams, as_float
from .stats import GenerationStats
from .step import Verifier, lossless_verify
from .stops import IncrementalText, RowState, StopCriteria, stop_prefix_len
from .vocab_bridge import check_round_trip

Prompt = Union[str, Sequence[int]]
SEED_BITS = 62  # random row seeds are drawn in [0, 2^62)
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)  # a given seed is a Philox key: an int64


# ------------------------------------------------------------------------------------- result
@dataclass
class GenerationResult:
    """New tokens and text per prompt, finish reasons and stats (``GenerationStats``)."""

    token_ids: List[List[int]]  # new tokens per prompt (EOS included when it ended the row)
    text: Optional[List[str]]  # decoded new tokens per prompt (stop string excluded); None without a tokenizer
    finish_reasons: List[str]  # "eos", "length", "stop" (a stop string, or a complete grammar) or "grammar_dead_end"
    stats: GenerationStats
    prompt_token_ids: List[List[int]] = field(default_factory=list)
    plan: Optional[DecodePlan] = None  # what ran and why (plan.explain())
    logprobs: Optional[List[List[TokenLogprob]]] = None  # per prompt, one per new token (``logprobs=``)

    def __len__(self) -> int:
        return len(self.token_ids)


class TextPiece(str):
    """A piece of streamed text; ``.index`` is the prompt it belongs to, ``.token_ids`` its new tokens."""

    index: int
    token_ids: List[int]

    def __new__(cls, text: str, index: int, token_ids: List[int]):
        piece = super().__new__(cls, text)
        piece.index = index
        piece.token_ids = token_ids
        return piece


class GenerationStream:
    """Iterator of ``TextPiece`` (a str with ``.index``) as tokens are accepted; ``.result`` at the end."""

    def __init__(self, events: Iterator[List[List[int]]], rows: List[RowState], finish):
        self._events = events
        self._rows = rows
        self._finish = finish
        self._sent = [0] * len(rows)  # characters of each row's text already yielded
        self._closed = [False] * len(rows)  # finished and fully yielded
        self._held: List[List[int]] = [[] for _ in rows]  # each row's tokens whose text waits for more bytes
        # each row's text, decoded a few tokens at a time (None without a tokenizer)
        self._texts = [IncrementalText(finish.decode) for _ in rows] if finish.tokenizer is not None else None
        self._look = max([len(s) for s in finish.stop_strings] + [1])  # the end of a text that the checks read
        self.result: Optional[GenerationResult] = None
        # one iterator for the stream's life: a loop left by break or an exception and entered again goes on
        # where it stopped (a fresh generator per loop lost the rest of the step it was in)
        self._pieces = self._generate()
        self._inside = threading.Lock()  # held by the thread inside next()
        self._inside_thread: Optional[int] = None
        self._close_asked = False

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> TextPiece:
        with self._inside:
            self._inside_thread = threading.get_ident()
            try:
                if self._close_asked:
                    self._close_now()
                with torch.inference_mode(False):  # (as the stream was made: _run)
                    return next(self._pieces)
            finally:
                self._inside_thread = None
                if self._close_asked:
                    self._close_now()

    def close(self) -> None:
        """Stop the generation where it is (``result`` stays None); its drafter's hooks on the target go.
        From another thread while one is inside ``next()``: waits for that step to end (that ``next()``
        returns its piece or stops), then closes."""
        self._close_asked = True
        if self._inside_thread == threading.get_ident():
            return  # called from inside this stream's own step (a callback): its next() closes on the way out
        with self._inside:
            self._close_now()

    def _close_now(self) -> None:
        self._pieces.close()
        close = getattr(self._events, "close", None)
        if close is not None:
            close()

    def _generate(self) -> Iterator[TextPiece]:
        for new in self._events:
            if self._close_asked:  # close() from another thread waits for this next(): no more steps
                return
            for b, tokens in enumerate(new):
                row = self._rows[b]
                if self._closed[b] or (not tokens and not row.finished):
                    continue
                self._closed[b] = row.finished
                if self._texts is None:
                    if tokens:
                        yield TextPiece("", b, tokens)
                    continue
                text = self._texts[b]  # the row's text: text.text == finisher.row_text(row) up to stop_text_end
                text.follow(row.tokens)
                end = len(text) if row.stop_text_end is None else min(len(text), row.stop_text_end)
                if not row.finished:
                    last = text.text_from(max(0, end - self._look))
                    if last.endswith("\ufffd"):
                        self._held[b] += tokens  # an incomplete UTF-8 sequence: its tokens go with the next piece
                        continue
                    end -= stop_prefix_len(last, self._finish.stop_strings)
                sent = self._sent[b]
                piece = text.text_from(sent)[: max(0, end - sent)]
                self._sent[b] = max(sent, end)
                tokens, self._held[b] = self._held[b] + tokens, []
                if piece or tokens:
                    yield TextPiece(piece, b, tokens)
        self.result = self._finish.result()


# ------------------------------------------------------------------------------------- prompts
def normalise_prompts(prompts, tokenizer) -> Tuple[List[List[int]], bool]:
    """-> (token id lists, whether the prompts were text)."""
    if isinstance(prompts, np.ndarray) and prompts.dtype.kind in "iu":  # (as a tensor of token ids)
        prompts = torch.from_numpy(prompts.astype(np.int64))
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompts as a tensor must be [T] or [B, T] token ids, got shape {tuple(prompts.shape)}")
        if prompts.is_meta:
            raise ValueError("prompts as a tensor are on the meta device: they hold no token ids")
        prompts = prompts.tolist()
        if prompts and not isinstance(prompts[0], list):
            prompts = [prompts]
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of strings or token ids, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    if all(is_integer(t) for t in prompts):
        prompts = [list(prompts)]  # one prompt as token ids
    is_text = isinstance(prompts[0], str)
    out = []
    for b, p in enumerate(prompts):
        if isinstance(p, str) != is_text:
            raise TypeError("prompts must be all strings or all token id lists, not a mix")
        if is_text:
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer= or token ids")
            if not p:
                raise ValueError(f"prompt {b} is empty")
            check_text(p, f"prompt {b}")
            ids = tokenizer(p)["input_ids"]
        else:
            if not hasattr(p, "tolist") and not isinstance(p, (list, tuple)):
                raise TypeError(f"prompt {b} must be a string or a list of int token ids, got {type(p).__name__}")
            if getattr(p, "is_meta", False):
                raise ValueError(f"prompt {b} is a tensor on the meta device: it holds no token ids")
            ids = p.tolist() if hasattr(p, "tolist") else list(p)  # (a tensor or a numpy array of ids too)
            if not isinstance(ids, list) or not all(is_integer(t) for t in ids):
                raise TypeError(f"prompt {b} must be a string or a list of int token ids")
        if not ids:
            raise ValueError(f"prompt {b} is empty (no tokens)")
        out.append([int(t) for t in ids])
    return out, is_text


def is_integer(value) -> bool:
    """An integer that is no bool (numpy's and torch's integer scalars included)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _plain_int(value):
    """numpy's and torch's integer scalars as ints, as token ids take them (the argument checks want int);
    anything else as given."""
    return int(value) if not isinstance(value, int) and is_integer(value) else value


def check_text(text: str, what: str) -> None:
    """ValueError for text the tokenizer cannot take (it would raise a TypeError about its input type): a lone
    surrogate, e.g. from JSON's \\ud800 escape, has no UTF-8 encoding. (The server's requests too.)"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid text: character {error.start} is {text[error.start]!r}, a lone "
                         "surrogate, which has no UTF-8 encoding") from None


# generation_config fields that generate() does not read (it decodes by its own arguments) and that change what
# transformers' generate() returns, with their values that change nothing: sampling, penalties and banned tokens,
# beam / contrastive / guided search, forced and length-penalised ends
UNREAD_GENERATION_FIELDS = {"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                            "min_new_tokens": None, "min_length": 0, "suppress_tokens": None,
                            "begin_suppress_tokens": None, "bad_words_ids": None, "sequence_bias": None,
                            "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "guidance_scale": None,
                            "forced_bos_token_id": None, "forced_eos_token_id": None,
                            "exponential_decay_length_penalty": None, "watermarking_config": None,
                            "dola_layers": None}


def warn_unread_generation_config(target_model) -> None:
    """A warning naming what the target's generation_config sets that generate() leaves out (transformers'
    generate() would apply it: its sampling or its penalties gave other tokens than ours, silently)."""
    config = getattr(target_model, "generation_config", None)
    fields = {name: getattr(config, name, off) for name, off in UNREAD_GENERATION_FIELDS.items()}
    set_ = [f"{name}={value!r}" for name, value in fields.items()
            if value not in (UNREAD_GENERATION_FIELDS[name], None, [], 0)]
    if set_:
        warnings.warn(f"the target's generation_config sets {', '.join(set_)}, which generate() does not read: it "
                      f"decodes by its own arguments (temperature=, top_p=, repetition_penalty=, ...; greedy by "
                      f"default)", stacklevel=4)  # (the caller of generate())


def eos_token_ids_of(eos_token_id, target_model, tokenizer) -> List[int]:
    """generate()'s ``eos_token_id`` rule: False -> none; None -> the target's generation_config EOS (else the
    tokenizer's); an id or a list of ids as given, each a token id of the target's vocabulary (ValueError
    otherwise). (The server ends its responses by the same rule.)"""
    if eos_token_id is False:
        return []
    if eos_token_id is None:
        config = getattr(target_model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        if eos_token_id is None:
            return []
        return [eos_token_id] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
    ids = _integer_list(eos_token_id)
    if ids is None:
        raise ValueError(f"eos_token_id must be a token id (an int), a list of them, None or False, got "
                         f"{eos_token_id!r}")
    vocab_size = output_vocab_size(target_model)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id: {bad[:MAX_MISMATCHES_REPORTED]} outside the target's vocabulary "
                         f"[0, {vocab_size})")
    return ids


def _row_seeds(seed, batch: int) -> torch.Tensor:
    """generate()'s ``seed`` as the rows' Philox keys [batch] int64."""
    if seed is None:
        return torch.tensor([secrets.randbits(SEED_BITS) for _ in range(batch)], dtype=torch.int64)
    low, high = SEED_RANGE
    seeds = _integer_list(seed)
    if seeds is None or not all(low <= s <= high for s in seeds):
        raise ValueError(f"seed must be an int in [-2^63, 2^63) (for every prompt), a list of such ints (one per "
                         f"prompt) or None, got {seed!r}")
    if _integer(seed) is not None:
        seeds = seeds * batch
    if len(seeds) != batch:
        raise ValueError(f"seed: got {len(seeds)} seeds for {batch} prompts")
    return torch.tensor(seeds, dtype=torch.int64)


def _integer(value) -> Optional[int]:
    """``value`` as an int where it is an integer (a Python or numpy int, a 0-d integer tensor), else None:
    a bool, a float or text (int() would take True, cut 1.5 to 1 and read "5")."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _integer_list(value) -> Optional[List[int]]:
    """An integer -> [it]; a list, tuple or tensor of integers -> them as ints; anything else None (text
    too, which iterates as characters)."""
    one = _integer(value)
    if one is not None:
        return [one]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return None
    items = [_integer(item) for item in value]
    return None if any(item is None for item in items) else items


class _Finisher:
    """Turns the rows into text and the final result."""

    def __init__(self, rows, tokenizer, stats, prompts, stop_strings=(), plan=None):
        self.rows, self.tokenizer, self.stats, self.prompts = rows, tokenizer, stats, prompts
        self.stop_strings = list(stop_strings)
        self.plan = plan


    def decode(self, ids: List[int]) -> str:
        """The text of ``ids`` (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def row_text(self, row: RowState) -> Optional[str]:
        """A row's whole text (the stream keeps its own, IncrementalText, equal to it step by step)."""
        if self.tokenizer is None:
            return None
        text = self.decode(row.tokens)
        return text[: row.stop_text_end] if row.stop_text_end is not None else text

    def result(self) -> GenerationResult:
        texts = [self.row_text(r) for r in self.rows] if self.tokenizer is not None else None
        return GenerationResult(token_ids=[list(r.tokens) for r in self.rows], text=texts,
                                finish_reasons=[r.finish_reason or "length" for r in self.rows],
                                stats=self.stats, prompt_token_ids=self.prompts, plan=self.plan,
                                logprobs=self._logprobs())

    def _logprobs(self) -> Optional[List[List[TokenLogprob]]]:
        """Per row, one per returned token (None when logprobs were not asked for)."""
        if self.plan is None or self.plan.top_logprobs is None:
            return None
        return [list(r.logprobs or [])[: len(r.tokens)] for r in self.rows]


# ------------------------------------------------------------------------------------- generate
def generate(prompts, target: ModelSpec = None, draft: ModelSpec = None, *, max_new_tokens: int = 128,
             k: Union[None, int, str, AdaptiveK] = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed=None, eos_token_id=None, stop=None, stream: bool = False, tokenizer=None,
             draft_tokenizer=None, max_seq_len: Optional[int] = None, runner: str = "auto",
             verifier: Verifier = lossless_verify, cost_probe: bool = True, draft_confidence: float = 0.0,
             draft_tree: Optional[Tuple[int, int, int]] = None, explain: bool = False,
             tp_size: Optional[int] = None, tp_check: str = "broadcast", min_p: float = 0.0,
             logit_bias: Optional[Mapping] = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, json_schema=None, regex: Optional[str] = None,
             grammar: Optional[str] = None, logprobs: Optional[int] = None) -> Union[GenerationResult, GenerationStream]:
    """Lossless speculative generation: the tokens are distributed exactly as sampling from the target.

    Parameters
    ----------
    prompts : str, list of str, list of int, list of lists of int, or a [B, T] tensor
        The prompts (text needs the target's tokenizer).
    target, draft : model id / local path (loaded offline with from_pretrained) or a loaded model
        Both None: the bundled default pair. ``draft="ngram"``: no draft model, a suffix automaton
        over each row's prompt and output proposes the continuation of its longest earlier match.
        ``draft="heads"``: no draft model, the bundled target's Medusa-style heads
        (specdec_ext/heads.py) propose a token tree from the target's last hidden state (the target
        must be the bundled one); ``draft=MedusaHeads`` (``specdec_ext.heads.load_heads(dir)``) does
        the same with heads trained for ``target`` (tools/train_heads.py). Heads always draft a tree:
        ``draft_tree`` (default ``HEADS_TREE`` = (3, 3, 8)) with d <= the number of heads.
        ``draft=EagleDrafterSpec(path_or_head)`` (specdec_ext.eagle; or an ``Eagle3Model``, or a directory
        holding an EAGLE-3 checkpoint: SafeAILab/EAGLE, SpecForge or speculators): an EAGLE-3 head drafts
        from the target's own hidden states (its runner taps them), a chain of ``k`` or, with
        ``draft_tree``, an EAGLE-2 dynamic tree; a head made for another target is refused first.
    max_new_tokens : int
        Exact cap on new tokens per prompt (>= 0).
    k : None (default), int >= 1, "auto", or an ``AdaptiveK``
        Draft tokens per step. "auto": per step, the draft length 0..8 that maximises the expected
        tokens per second from the measured acceptance by position and draft/verify costs, speculation
        switched off where it does not pay (specdec_ext/adaptive.py; an ``AdaptiveK`` sets k_max and
        the controller's knobs); the steps then run eagerly. None: "auto", except where adaptive k
        would cost something (``default_draft_length``): seeded sampling at temperature > 0 (the
        adaptive choices follow measured times, so a seed would not reproduce its sample) and a
        draft model on a device where CUDA graphs capture the decode steps get ``FIXED_K`` = 4.
        ``result.stats.adaptive`` says what the controller chose; ``result.stats.k`` is the
        static draft width (k_max with "auto"). ``result.plan`` (a ``DecodePlan``) says what ran and
        why (``result.plan.explain()``).
    temperature, top_k, top_p : float, int, float
        The sampling filter (0 = greedy; top_k 0 and top_p 1 are off), applied to target and draft:
        temperature >= 0, at most float32's largest (3.4e38) or inf (uniform over the finite logits);
        top_k >= 0 (one at least the vocabulary's size is off too); top_p in (0, 1].
    seed : int, list of int, or None
        Philox seed per prompt, an int in [-2^63, 2^63): an int is used for every row (a row's tokens
        depend on its prompt and seed only, not on the batch; identical prompts with one seed give
        identical samples; with an int k, which k=None then is), a list gives one per prompt, None
        draws random seeds.
    eos_token_id : int, list of int, None or False
        None: the target's generation_config (or the tokenizer's) EOS; False: no EOS stop; ids given must lie
        in the target's vocabulary.
        A row ends at its first EOS (the EOS is returned); later tokens of the step are discarded.
    stop : str or list of str
        Stop strings: a row ends after the token that completes one; the text excludes the stop string.
    stream : bool
        Return a ``GenerationStream``: an iterator of ``TextPiece`` (str with ``.index``), with
        ``.result`` set once exhausted. One iterator for its life: a loop left by ``break`` and entered
        again goes on where it stopped; it may be consumed on any thread; ``.close()`` ends it early.
    tokenizer, draft_tokenizer : optional tokenizers, or the directories they were saved to (default: loaded next
        to the model paths)
        A draft whose tokenizer spells some token id differently from the target's drafts through text
        (issue 29, drafters/cross_tokenizer.py): greedy, its tokens are decoded and re-encoded as target
        tokens at the committed boundary; sampling, it samples from its distribution moved onto the
        tokens both vocabularies spell the same way (a true q over target ids, so still lossless).
        Refused before any work when a tokenizer does not round-trip text (the probes and text
        prompts) or, when sampling, when the vocabularies share fewer than
        ``vocab_bridge.MIN_INTERSECTION`` tokens. Chains only (no ``draft_tree``).
    max_seq_len : int, optional
        Cache capacity per row (default: the target's max_position_embeddings); a prompt that does not
        fit with what the loop writes (plan.loop_cache_len: prompt + max_new_tokens - 1 for plain decoding,
        prompt + max_new_tokens + 2 k with drafts) raises ValueError; one past the models'
        max_position_embeddings warns (a model with an absolute position table, GPT-2's ``wpe``, GPT-J's
        and CodeGen's sin/cos rows, CTRL's ``pos_encoding``, MPT's ALiBi bias of config.max_seq_len keys, is
        bounded by the table: it cannot look past it). With the default k (None or "auto") the drafts shrink to what the
        cache leaves past prompt + max_new_tokens, down to plain decoding (``result.plan.explain()`` says so);
        an asked k or draft_tree that does not fit is refused, and so are heads (their tree is fixed: the
        default ``HEADS_TREE`` when none is asked).
    runner : 'auto' | 'lean' | 'paged' | 'recompute'
        The model runner of target and draft (runners/). 'auto': for Llama/Mistral/Qwen2-style models a
        lean runner over a contiguous cache (runners/lean.py: the CPU kernels on a CPU, the target in
        its own dtype, a half-precision draft in fp32; a pure-torch forward elsewhere), the paged KV
        cache for other models and where CUDA graphs run.
    verifier : callable
        ``verifier(meta, proposal, target_logits) -> Verdict`` (default: the lossless chain_verify /
        tree_verify, ``decode.lossless_verify``); for tests.
    cost_probe : bool
        The cost-model stats' plain step (``GenerationStats.target_step_time``): k="auto"'s own measurement
        of it, else a few plain target passes timed after prefill (a probe of the same target and batch
        size from the last minute serves instead, probes.PLAIN_STEP_REUSE_S).
    draft_confidence : float
        A row stops drafting (before k) after a token the draft gives probability below this; it
        saves draft passes that would mostly be rejected. 0 (default) always drafts k. Lossless either way.
    draft_tree : (b, d, N), optional
        Draft a token tree instead of a chain: the draft model (or the heads) expands its top-b tokens
        per node over d levels (each level keeping its best min(b^l, N) nodes by cumulative score),
        then the N best expanded nodes form the tree (drafters/tree_drafter.py; b = 1 is a chain of
        min(d, N)); a node's score is the learnt log-rate at which the target emits such candidates
        (drafters/calibration.py, kept per draft model and temperature across calls). At T > 0 a draft
        model samples each node's children without replacement from its filtered q instead of taking
        the top-b (heads always take the top-b). One target pass verifies the tree with the tree mask,
        tree_verify picks the path (recursive rejection sampling for sampled children, the
        deterministic-candidate rule otherwise; both lossless) and commit_tree keeps it. ``k`` is then
        ignored (the verify budget is N + 1 tokens). Needs a draft model or heads (not "ngram");
        draft_confidence does not apply; the steps run eagerly (no CUDA graphs).

    explain : bool
        Print ``plan.explain()`` (one line per choice: drafter, k, runners, CUDA graphs, cache) to
        stderr before decoding (rank 0 only under tensor parallelism).
    tp_size : int, optional
        Load ``target`` (a path) sharded over this many ranks with HF tensor parallelism (every rank
        calls generate() with the same arguments, e.g. under torchrun; docs/multi-gpu.md). A target
        already loaded with ``tp_plan`` / ``distributed_config`` needs nothing: it is detected.
    tp_check : "broadcast" (default), "verify" or "off"
        Under tensor parallelism, how the ranks are kept on rank 0's decisions (distributed.py).
    min_p, logit_bias, presence_penalty, frequency_penalty, repetition_penalty : logits processors
        OpenAI's and HF's (specdec_ext/processing.py), applied inside verification to the target's
        logits at every draft position, each with the drafts before it counted, so the output is distributed
        exactly as sampling from the processed target. A draft model, an EAGLE-3 head (chains and trees) and
        the heads propose from their processed logits too, grammar masks included (each tree node after its
        ancestors), and so does a sampled draft with another tokenizer; the n-gram lookup and a greedy draft
        through text propose unprocessed (still exact: verification processes the target; fewer drafts are
        accepted where the processors ban or penalise much).
        min_p in [0, 1] (0 off; tokens below min_p x the top probability after temperature dropped);
        logit_bias {token id: bias in [-100, 100]}; presence / frequency penalties in [-2, 2] over the
        generated tokens; repetition_penalty in [1e-30, 1e30] (1 off) over the prompt and generated tokens.
    json_schema, regex, grammar : structured output (at most one)
        A JSON schema (dict or JSON text), a regular expression, or a Lark grammar (llguidance's
        syntax): every row's output follows it (specdec_ext/grammar.py). The masks are filled on the
        host per verify pass; drafts the grammar forbids are rejected, tokens it forces are accepted.
        A row whose grammar reaches a dead end finishes with ``"grammar_dead_end"``. Needs a tokenizer.
    logprobs : int in [0, 20], optional
        Also return each new token's log-probability and the ``logprobs`` most likely tokens at its
        position (``result.logprobs``: per prompt, one ``logprobs.TokenLogprob`` per token) under the
        processed target at the row's temperature (specdec_ext/logprobs.py).

    Returns
    -------
    GenerationResult (``.token_ids``, ``.text``, ``.finish_reasons``, ``.stats``) or GenerationStream.
    """
    processing = _processing(min_p=min_p, logit_bias=logit_bias, presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                             json_schema=json_schema, regex=regex, grammar=grammar)
    models = load_models(target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, tp_size=tp_size)
    return _run(models, prompts, RunRequest(
        max_new_tokens=max_new_tokens, sampling=_sampling(temperature, top_k, top_p), seed=seed,
        eos_token_id=eos_token_id, stop=stop, stream=stream, max_seq_len=max_seq_len, runner=runner, k=k,
        draft_tree=draft_tree, draft_confidence=draft_confidence, verifier=verifier, cost_probe=cost_probe,
        explain=explain, tp_check=tp_check, processing=processing, top_logprobs=logprobs))


# generate()'s request fields beyond the filter (processing.py, grammar.py, logprobs.py), plain_generate()'s too
PROCESSING_OPTIONS = ("min_p", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "json_schema", "regex", "grammar", "logprobs")


def _processing(*, json_schema=None, regex=None, grammar=None, **fields) -> Optional[Processing]:
    """generate()'s processors and grammar as one Processing (None when they change nothing). Every field is
    checked here, whatever its value: make_plan checks only an active Processing (and the logit_bias keys
    against the vocabulary), and an out-of-range value such as min_p=-0.1 leaves it inactive."""
    processing = Processing.of(grammar=grammar_spec(json_schema=json_schema, regex=regex, grammar=grammar), **fields)
    processing.validate()
    return processing if processing.active else None


PLAIN_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_token_id", "stop", "stream",
                 "tokenizer", "max_seq_len", "runner", "explain", "tp_size") + PROCESSING_OPTIONS


def plain_generate(prompts, target: ModelSpec = None, **options):
    """Plain decoding (one target pass per token) over the same runner, sampler and stop checks as
    ``generate``: the baseline of the benchmarks and of the cost model. ``options``: generate()'s
    keywords that do not concern a draft (``PLAIN_OPTIONS``, same defaults); the target None means the
    bundled pair's target."""
    unknown = sorted(set(options) - set(PLAIN_OPTIONS))
    if unknown:
        raise TypeError(f"plain_generate() got unexpected keyword arguments: {', '.join(unknown)} "
                        f"(it takes {', '.join(PLAIN_OPTIONS)})")
    models = load_models(target, tokenizer=options.get("tokenizer"), plain=True, tp_size=options.get("tp_size"))
    return _run(models, prompts, RunRequest(
        max_new_tokens=options.get("max_new_tokens", 128),
        sampling=_sampling(options.get("temperature", 0.0), options.get("top_k", 0), options.get("top_p", 1.0)),
        seed=options.get("seed"), eos_token_id=options.get("eos_token_id"), stop=options.get("stop"),
        stream=options.get("stream", False), max_seq_len=options.get("max_seq_len"),
        runner=options.get("runner", "auto"), cost_probe=False, explain=options.get("explain", False),
        processing=_processing(**{name: options[name] for name in PROCESSING_OPTIONS[:-1] if name in options}),
        top_logprobs=options.get("logprobs")))


def _sampling(temperature, top_k, top_p) -> SamplingParams:
    sampling = SamplingParams(as_float("temperature", temperature), _plain_int(top_k), as_float("top_p", top_p))
    sampling.validate()
    return sampling


@dataclass(frozen=True)
class RunRequest:
    """A generate() / plain_generate() call below its public signature (generate()'s docstring says
    what each field means)."""

    max_new_tokens: int
    sampling: SamplingParams
    seed: object = None  # int, a list of ints, or None
    eos_token_id: object = None  # int, a list of ints, None or False
    stop: object = None  # str or a list of str
    stream: bool = False
    max_seq_len: Optional[int] = None
    runner: str = "auto"
    k: Union[None, int, str, AdaptiveK] = None
    draft_tree: Optional[Tuple[int, int, int]] = None
    draft_confidence: float = 0.0
    verifier: Verifier = lossless_verify
    cost_probe: bool = True
    explain: bool = False
    tp_check: str = "broadcast"
    processing: Optional[Processing] = None
    top_logprobs: Optional[int] = None

    def __post_init__(self):
        for name in ("max_new_tokens", "max_seq_len", "k", "top_logprobs"):
            object.__setattr__(self, name, _plain_int(getattr(self, name)))  # (frozen)
        if isinstance(self.draft_tree, (tuple, list)) and all(is_integer(v) for v in self.draft_tree):
            object.__setattr__(self, "draft_tree", tuple(int(v) for v in self.draft_tree))


def _run(models: Models, prompts, request: RunRequest):
    """Normalise the prompts -> plan -> build -> decode, outside inference mode whatever the caller's: the
    loop's buffers and what is kept across calls (a tree's calibration) are written in place later, maybe
    outside it (a stream finished after its maker's ``torch.inference_mode()`` block, or on another thread)."""
    for name in ("stream", "explain", "cost_probe"):
        if not isinstance(getattr(request, name), bool):  # (stream="no" is truthy: a stream nobody asked for)
            raise TypeError(f"{name} must be True or False, got {getattr(request, name)!r}")
    with torch.inference_mode(False):
        return _plan_build_decode(models, prompts, request)


def _plan_build_decode(models: Models, prompts, request: RunRequest):
    tokenizer = models.tokenizer
    stop_strings = _stop_strings(request.stop, tokenizer)
    token_prompts = _token_prompts(prompts, models)
    seeds = _row_seeds(request.seed, len(token_prompts))
    eos_ids = eos_token_ids_of(request.eos_token_id, models.target, tokenizer)
    warn_unread_generation_config(models.target)
    plan = make_plan(models.target, models.draft, drafter=models.drafter,
                     prompt_lengths=[len(p) for p in token_prompts], max_new_tokens=request.max_new_tokens,
                     k=request.k, draft_tree=request.draft_tree, runner=request.runner, sampling=request.sampling,
                     seeded=request.seed is not None, max_seq_len=request.max_seq_len,
                     draft_confidence=request.draft_confidence, tp_check=request.tp_check, vocab_bridge=models.bridge,
                     processing=request.processing, top_logprobs=request.top_logprobs,
                     num_heads=getattr(models.heads, "num_heads", None))
    if request.explain and distributed.rank() == 0:
        print(plan.explain(), file=sys.stderr)
    B = len(token_prompts)
    seeds = seeds.to(plan.device)
    stats = GenerationStats(k=plan.slots, batch_size=B, tree=plan.tree)
    rows = [RowState() for _ in range(B)]
    finisher = _Finisher(rows, tokenizer, stats, token_prompts, stop_strings, plan)
    if request.max_new_tokens == 0:
        events = iter(())
    else:
        grammar_of = _grammar_rows(request.processing, tokenizer, output_vocab_size(models.target), eos_ids)
        target_runner, drafter = build(plan, models)
        stop_criteria = StopCriteria(
            max_new_tokens=request.max_new_tokens, eos_token_ids=eos_ids, stop_strings=stop_strings,
            decode_text=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None)
        padded_prompts, padded_seeds, padded_rows = pad_batch(token_prompts, seeds, rows, plan.padded_batch_size)
        config = LoopConfig.of(plan, verifier=request.verifier, cost_probe=request.cost_probe, grammar_of=grammar_of)
        events = decode(target_runner, drafter, padded_prompts, padded_seeds, stop_criteria, config,
                        rows=padded_rows, stats=stats)
        events = _real_rows(events, B, drafter)
    if request.stream:
        return GenerationStream(events, rows, finisher)
    for _ in events:
        pass
    return finisher.result()


def _grammar_rows(processing: Optional[Processing], tokenizer, vocab_size: int, eos_ids: List[int]):
    """A row -> grammar matcher factory for the loop (None without a grammar); the grammar is compiled
    here, before any model work."""
    if processing is None or processing.grammar is None:
        return None
    if tokenizer is None:
        raise ValueError("structured output (json_schema, regex, grammar) needs the target's tokenizer")
    compiled = compile_grammar(processing.grammar, tokenizer, vocab_size, eos_ids)
    return lambda row: compiled.new_row()


def _stop_strings(stop, tokenizer) -> List[str]:
    """generate()'s ``stop`` as a list of non-empty strings (they need a tokenizer)."""
    if stop is None:
        stop_strings = []
    elif isinstance(stop, (list, tuple)):
        stop_strings = list(stop)
    else:
        stop_strings = [stop]  # a string, or what the check below refuses (stop=5)
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    for s in stop_strings:
        check_text(s, f"stop string {s!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    return stop_strings


def _token_prompts(prompts, models: Models) -> List[List[int]]:
    """The prompts as token ids, each id inside the target's vocabulary (text prompts round-trip through
    both tokenizers where a draft with another tokenizer drafts through text)."""
    token_prompts, is_text = normalise_prompts(prompts, models.tokenizer)
    if is_text and models.bridge is not None:
        check_round_trip(models.tokenizer, models.bridge.draft_tokenizer, [prompts] if isinstance(prompts, str)
                         else list(prompts))
    vocab_size = output_vocab_size(models.target)
    for b, p in enumerate(token_prompts):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab_size}): {bad[:MAX_MISMATCHES_REPORTED]}")
    return token_prompts


def _real_rows(events, batch: int, drafter):
    """The loop's events cut to the real rows (the padding of a CUDA-graph bucket emits nothing); each
    resumption of the loop runs inside ``drafter.running()`` on the thread resuming it, and the drafter is
    closed (hooks on the target removed) when they end."""
    running = drafter.running if drafter is not None else contextlib.nullcontext
    try:
        while True:
            with running():
                new = next(events, None)
            if new is None:
                return
            yield new[:batch]
    finally:
        if drafter is not None:
            drafter.close()
