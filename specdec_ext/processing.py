"""Logits processing inside verification (issue 28): the request fields of OpenAI's and HF's sampling
surface that change the target's distribution, applied to the target's logits at every position of a
verify pass, each position with its own prefix (the committed tokens, then the drafts before it on
its chain or tree path), and to a drafter's logits as it drafts (a draft model's or an EAGLE-3 head's
chain or a sampled draft with another tokenizer, ``apply_draft_step``; a draft model's, an EAGLE-3 head's
or the heads' tree, ``apply_frontier``; not the n-gram lookup or a greedy draft through text). The verifier then compares the processed target p' with the
processed draft q', so the output is distributed exactly as sampling from the processed target, whatever
the drafter proposes (an unprocessed q is exact too, only accepted less where the processors ban or
penalise much).

    Processing          one request's fields (frozen): min_p, logit_bias, presence / frequency /
                        repetition penalties, a grammar (specdec_ext/grammar.py)
    ProcessingState     a batch's rows: the tensors ops.process_logits reads (token counts, prompt
                        masks, biases, the per-row scalars) and each row's grammar matcher

The order of the processors and their semantics are the op's (csrc/logits_processing.h): logit_bias,
repetition penalty (HF: prompt and output tokens), frequency and presence penalties (OpenAI: output
tokens, counted with the drafts before the position), the grammar mask, then min_p at the row's
temperature; the verifier's temperature, top-k and top-p come after.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from . import ops
from .grammar import FINISH_DEAD_END
from .sampling import as_float

OPENAI_PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's API range)
OPENAI_LOGIT_BIAS_RANGE = (-100.0, 100.0)  # logit_bias values (OpenAI's API range)
# repetition_penalty: a seen token's float32 logit is divided by it where positive and multiplied where
# not, so within these bounds every logit up to 3e8 in size stays finite; beyond them a few units can
# overflow to inf (1e-38: the verifier refuses the row) and a penalty rounds to 0 or inf in float32
REPETITION_PENALTY_RANGE = (1e-30, 1e30)


@dataclass(frozen=True)
class Processing:
    """One request's logits processors. The defaults change nothing (``active`` is False)."""

    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature); 0 = off
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # HF: a seen token's (prompt or output) logit / r if > 0, x r if not; 1 = off
    logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, additive bias), sorted by id
    grammar: Optional[object] = None  # a grammar.GrammarSpec (structured output)

    @classmethod
    def of(cls, *, min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
           repetition_penalty: float = 1.0, logit_bias: Optional[Mapping] = None, grammar=None) -> "Processing":
        """From API-shaped values: ``logit_bias`` a mapping token id (int or its decimal string, as
        JSON keys are) -> bias. Types are checked here; ranges by ``validate``."""
        if logit_bias is not None and not isinstance(logit_bias, Mapping):
            raise ValueError(f"logit_bias must be a mapping of token id -> bias (a JSON object), got "
                             f"{type(logit_bias).__name__} {logit_bias!r:.60}")
        bias: Dict[int, float] = {}
        for key, value in (logit_bias or {}).items():
            token = _token_id(key)
            if token in bias:  # (9 and "9", or np.int64(9): which bias was meant?)
                raise ValueError(f"logit_bias names token {token} twice (key {key!r})")
            bias[token] = _bias_value(key, value)
        bias = list(bias.items())
        return cls(min_p=as_float("min_p", min_p), presence_penalty=as_float("presence_penalty", presence_penalty),
                   frequency_penalty=as_float("frequency_penalty", frequency_penalty),
                   repetition_penalty=as_float("repetition_penalty", repetition_penalty),
                   logit_bias=tuple(sorted(bias)), grammar=grammar)

    @property
    def active(self) -> bool:
        return (self.min_p > 0.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias) or self.grammar is not None)

    @property
    def penalised(self) -> bool:
        """Whether the counts of generated tokens matter (the penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the field and the reason (before any work): every field, whether or
        not its value turns a processor on (min_p=-0.1 is refused, not taken as off). ``vocab_size`` None:
        the logit_bias keys are checked against the vocabulary later (generate() checks the ranges before
        loading the models, make_plan the keys)."""
        low, high = OPENAI_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (low <= value <= high):
                raise ValueError(f"{name} must lie in [{low:g}, {high:g}], got {value}")
        low, high = REPETITION_PENALTY_RANGE
        if not (low <= self.repetition_penalty <= high):
            raise ValueError(f"repetition_penalty must lie in [{low:g}, {high:g}] (1 is off), got "
                             f"{self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1] (0 is off), got {self.min_p}")
        low, high = OPENAI_LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias key {token} is not a token id of the vocabulary [0, {vocab_size})")
            if not (low <= bias <= high):
                raise ValueError(f"logit_bias[{token}] must lie in [{low:g}, {high:g}], got {bias}")

    def describe(self) -> str:
        """One line for plan.explain() and the server's log."""
        parts = [f"{name}={getattr(self, name)}" for name, off in
                 (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
                 if getattr(self, name) != off]
        if self.logit_bias:
            parts.append(f"logit_bias on {len(self.logit_bias)} tokens")
        if self.grammar is not None:
            parts.append(f"grammar ({self.grammar.describe()})")
        return ", ".join(parts) or "none"


def _token_id(key) -> int:
    """A logit_bias key: an int (numpy's and 0-d integer tensors too), or the canonical decimal string of one
    (JSON object keys are strings)."""
    if isinstance(key, (bool, np.bool_)) or (isinstance(key, torch.Tensor) and key.dtype == torch.bool):
        raise ValueError(f"logit_bias key {key!r} is not an integer token id")
    if not isinstance(key, str):
        try:
            return operator.index(key)
        except TypeError:
            pass
    if isinstance(key, str):
        try:
            token = int(key)
        except ValueError:
            token = None
        if token is not None and str(token) == key:  # canonical only: int() also takes " 11", "011", "1_1"
            return token  #                              and non-ASCII digits ("١١")
    raise ValueError(f"logit_bias key {key!r} is not an integer token id (its ASCII decimal digits, as str(id) "
                     "writes them)")


def _bias_value(key, value) -> float:
    """A logit_bias value: a real number (numpy's and a 0-d real tensor's too), not a bool."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"logit_bias[{key!r}] must be a number, got {value!r}")
    return float(value)


@dataclass
class ProcessingState:
    """The processors of a batch's rows, in the tensors ``ops.process_logits`` reads. Rows without
    processing hold the neutral values (no bias, penalties off, min_p 0, all tokens allowed), so one
    call serves a batch that mixes processed and unprocessed rows. ``rows``/``select`` give views and
    gathered copies for the metadata's row views (continuous batching)."""

    output_counts: torch.Tensor  # [B, V] int32: occurrences of each token among the row's emitted tokens
    prompt_mask: torch.Tensor  # [B, V] bool: the token occurs in the row's prompt
    logit_bias: torch.Tensor  # [B, V] fp32
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    repetition_penalty: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    processing: List[Optional[Processing]]  # host [B]: each row's request (None: unprocessed)
    grammars: List[Optional[object]] = field(default_factory=list)  # host [B]: grammar.RowGrammar or None
    allowed: Optional[torch.Tensor] = None  # [B, n+1, W] int32: the grammar bitmask per column (made on first use)

    @classmethod
    def allocate(cls, batch_size: int, vocab_size: int, device: torch.device) -> "ProcessingState":
        B, V = batch_size, vocab_size
        scalar = dict(dtype=torch.float32, device=device)
        return cls(output_counts=torch.zeros((B, V), dtype=torch.int32, device=device),
                   prompt_mask=torch.zeros((B, V), dtype=torch.bool, device=device),
                   logit_bias=torch.zeros((B, V), **scalar),
                   presence_penalty=torch.zeros((B,), **scalar), frequency_penalty=torch.zeros((B,), **scalar),
                   repetition_penalty=torch.ones((B,), **scalar), min_p=torch.zeros((B,), **scalar),
                   processing=[None] * B, grammars=[None] * B)

    @property
    def vocab_size(self) -> int:
        return self.output_counts.shape[1]

    @property
    def any_active(self) -> bool:
        """Whether some row is processed (else the step skips the op)."""
        return any(p is not None for p in self.processing)

    # ------------------------------------------------------------------ rows joining and leaving
    def set_row(self, row: int, processing: Optional[Processing], prompt: Sequence[int], grammar=None) -> None:
        """Row ``row`` takes a request's processors (None: unprocessed), its prompt's tokens (the
        repetition penalty's seen set) and its grammar matcher; its counts start at zero."""
        self.clear_row(row)
        if processing is None or not processing.active:
            return
        self.processing[row] = processing
        self.grammars[row] = grammar
        self.presence_penalty[row] = processing.presence_penalty
        self.frequency_penalty[row] = processing.frequency_penalty
        self.repetition_penalty[row] = processing.repetition_penalty
        self.min_p[row] = processing.min_p
        if processing.repetition_penalty != 1.0 and len(prompt):
            ids = torch.as_tensor(list(prompt), dtype=torch.int64, device=self.prompt_mask.device)
            self.prompt_mask[row, ids] = True
        if processing.logit_bias:
            ids = torch.tensor([t for t, _ in processing.logit_bias], dtype=torch.int64, device=self.logit_bias.device)
            values = torch.tensor([b for _, b in processing.logit_bias], dtype=torch.float32, device=self.logit_bias.device)
            self.logit_bias[row, ids] = values

    def clear_row(self, row: int) -> None:
        """Row ``row`` back to the neutral values."""
        self.output_counts[row] = 0
        self.prompt_mask[row] = False
        self.logit_bias[row] = 0.0
        self.presence_penalty[row] = 0.0
        self.frequency_penalty[row] = 0.0
        self.repetition_penalty[row] = 1.0
        self.min_p[row] = 0.0
        self.processing[row] = None
        self.grammars[row] = None

    # ------------------------------------------------------------------ views
    def rows(self, width: int) -> "ProcessingState":
        """Rows 0..width-1: tensor views (writes reach this state), the host lists sliced."""
        return self._map(lambda t: t[:width], list(range(width)))

    def select(self, index: torch.Tensor) -> "ProcessingState":
        """Rows ``index`` [n] int64: gathered copies."""
        picked = index.tolist()
        return self._map(lambda t: t[index], picked)

    def refresh_host(self, source: "ProcessingState") -> None:
        """A view made by ``source.rows(width)`` takes the host lists again (rows joined or left since)."""
        width = len(self.processing)
        self.processing[:] = source.processing[:width]
        self.grammars[:] = source.grammars[:width]

    def _map(self, take, picked: List[int]) -> "ProcessingState":
        tensors = {name: take(getattr(self, name)) for name in
                   ("output_counts", "prompt_mask", "logit_bias", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_p")}
        return ProcessingState(**tensors, processing=[self.processing[i] for i in picked],
                               grammars=[self.grammars[i] for i in picked],
                               allowed=None if self.allowed is None else take(self.allowed))

    # ------------------------------------------------------------------ the step
    def apply(self, logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
              temperature: torch.Tensor, parents: Optional[torch.Tensor] = None,
              counts: Optional[torch.Tensor] = None) -> None:
        """Process ``logits`` in place: column c of row b with the prefix of c (ops.process_logits).
        ``counts`` replaces the output counts (a drafter's running counts with its drafts so far).

        logits [B, n+1, V]; draft_tokens [B, n] int64; num_draft [B] int32; temperature [B] fp32;
        parents [B, n] int32 (a tree) or None; counts [B, V] int32 or None
        """
        allowed = self._grammar_masks(logits.shape[1], draft_tokens, num_draft, parents)
        self._process(logits, draft_tokens, num_draft, temperature, parents, counts, allowed)

    def _process(self, logits, draft_tokens, num_draft, temperature, parents, counts, allowed) -> None:
        """ops.process_logits with the rows' tensors (``counts`` None: the output counts)."""
        ops.process_logits(logits, draft_tokens, parents=parents, num_draft=num_draft,
                           output_counts=self.output_counts if counts is None else counts,
                           prompt_mask=self.prompt_mask, logit_bias=self.logit_bias, allowed=allowed,
                           presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                           repetition_penalty=self.repetition_penalty, min_p=self.min_p, temperature=temperature)

    def apply_draft_step(self, logits: torch.Tensor, drafted: torch.Tensor, temperature: torch.Tensor,
                         counts: Optional[torch.Tensor]) -> torch.Tensor:
        """A chain drafter's logits for its next token, processed as the target's column i will be: after
        its i drafts so far (``drafted``), ``counts`` the output counts with those drafts added
        (``draft_counts``, ``add_drafted``; None when no row is penalised). Returns the processed logits (a
        copy; a row left without a finite logit keeps its own, ``with_some_token``).

        logits [B, V]; drafted [B, i] int64; temperature [B] fp32; counts [B, V] int32 -> [B, V]
        """
        B, i = drafted.shape
        processed = logits.clone().unsqueeze(1)  # [B, 1, V]
        none = drafted[:, :0]  # [B, 0]: the prefix is in ``counts`` and in the grammar's column i
        num_draft = torch.zeros((B,), dtype=torch.int32, device=logits.device)
        allowed = self._draft_masks(drafted) if self.has_grammar else None  # [B, 1, W]
        self._process(processed, none, num_draft, temperature, None, counts, allowed)
        return with_some_token(processed[:, 0], logits)

    def draft_counts(self) -> Optional[torch.Tensor]:
        """A chain drafter's running output counts (``apply_draft_step``): a copy of the rows', or None when no
        row is penalised. [B, V] int32"""
        return self.output_counts.clone() if self.any_penalised else None

    @staticmethod
    def add_drafted(counts: Optional[torch.Tensor], token: torch.Tensor) -> None:
        """Count each row's drafted ``token`` [B] into ``counts`` (``draft_counts``; None: nothing to count)."""
        if counts is not None:
            counts.scatter_add_(1, token[:, None], torch.ones_like(token[:, None], dtype=torch.int32))

    def apply_frontier(self, logits: torch.Tensor, tokens: Optional[torch.Tensor], parents: Optional[torch.Tensor],
                       frontier: Optional[torch.Tensor], temperature: torch.Tensor) -> torch.Tensor:
        """A tree drafter's logits at its frontier, processed as the target's columns of those nodes will be
        (each after its ancestors: ``apply`` over the tree grown so far, the frontier's logits in its nodes'
        columns). A node left without a finite logit keeps its unprocessed logits (``with_some_token``).

        logits [B, F, V]; tokens [B, C] int64 and parents [B, C] (expansion indices, parents first, -1 = the
        root) the nodes so far, frontier [B, F] int64 their indices (-1 = the root); tokens, parents and
        frontier None at the root (F = 1); temperature [B] fp32 -> [B, F, V] fp32
        """
        logits = logits.float()
        B, F, V = logits.shape
        if tokens is None:
            tokens = torch.zeros((B, 0), dtype=torch.int64, device=logits.device)
            frontier = torch.full((B, 1), -1, dtype=torch.int64, device=logits.device)
        C = tokens.shape[1]
        columns = (frontier + 1)[:, :, None].expand(B, F, V)  # [B, F, V]: node i is column i + 1, the root 0
        buffer = logits.new_zeros((B, C + 1, V)).scatter_(1, columns, logits)  # [B, C + 1, V]
        num_draft = torch.full((B,), C, dtype=torch.int32, device=logits.device)
        tree = parents.to(torch.int32).contiguous() if C else None
        self.apply(buffer, tokens.contiguous(), num_draft, temperature, parents=tree)
        return with_some_token(buffer.gather(1, columns), logits)

    def _draft_masks(self, drafted: torch.Tensor) -> torch.Tensor:
        """The grammar masks of a draft step [B, 1, W]: each grammar row's column after its drafts so far
        (RowGrammar.draft_column: one new mask per step, the matcher kept between steps), all ones for the
        other rows; a column where nothing may follow is left unconstrained (as _grammar_masks)."""
        B, V = self.output_counts.shape
        words = (V + 31) // 32
        if self.allowed is None or self.allowed.shape[1] < 1:
            self.allowed = torch.empty((B, 1, words), dtype=torch.int32)
        allowed = self.allowed[:, :1]
        allowed.fill_(-1)
        tokens = drafted.cpu().tolist()
        for b, grammar in enumerate(self.grammars):
            if grammar is not None:
                grammar.draft_column(allowed[b, 0].numpy(), tokens[b])
        allowed[(allowed == 0).all(-1)] = -1
        return allowed.contiguous().to(self.output_counts.device)

    @property
    def any_penalised(self) -> bool:
        return any(p is not None and p.penalised for p in self.processing)

    def record(self, tokens: torch.Tensor, num_kept: torch.Tensor) -> None:
        """The first num_kept[b] of tokens [B, w] were emitted by row b: they count from now on."""
        columns = torch.arange(tokens.shape[1], device=tokens.device)  # [w]
        kept = (columns[None, :] < num_kept.to(tokens.device)[:, None]).to(torch.int32)  # [B, w]
        self.output_counts.scatter_add_(1, tokens.clamp(min=0), kept)

    def record_rows(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows ``index`` [n] emitted one token each, ``tokens`` [n] (the first token after a prefill)."""
        self.output_counts.index_put_((index, tokens.clamp(min=0)), torch.ones_like(tokens, dtype=torch.int32),
                                      accumulate=True)

    # ------------------------------------------------------------------ grammars (host)
    @property
    def has_grammar(self) -> bool:
        return any(g is not None for g in self.grammars)

    def _grammar_masks(self, columns: int, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
                       parents: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The grammar bitmask [B, columns, W] of this pass (None without grammars): each grammar row's
        matcher fills its columns from its drafts (one host read of the drafts), the other rows allow
        every token."""
        if not self.has_grammar:
            return None
        B, V = self.output_counts.shape
        words = (V + 31) // 32
        if self.allowed is None or self.allowed.shape[1] < columns:
            self.allowed = torch.empty((B, columns, words), dtype=torch.int32)
        allowed = self.allowed[:, :columns]
        allowed.fill_(-1)
        tokens, counts = draft_tokens.cpu().tolist(), num_draft.cpu().tolist()
        tree = None if parents is None else parents.cpu().tolist()
        for b, grammar in enumerate(self.grammars):
            if grammar is None:
                continue
            n = counts[b]
            if tree is None:
                grammar.fill_chain(allowed[b, : n + 1], tokens[b][:n])
            else:
                grammar.fill_tree(allowed[b, : n + 1], tokens[b][:n], tree[b][:n])
        # a column where nothing may follow lies past the row's end (commit_host cuts its tokens there):
        # left unconstrained, so that the verifier sees finite logits
        allowed[(allowed == 0).all(-1)] = -1
        return allowed.contiguous().to(self.output_counts.device)  # (a copy where the buffer is wider)

    def commit_host(self, emitted: Dict[int, List[int]]) -> Dict[int, List[int]]:
        """Each grammar row's matcher advances by the tokens the row emitted (host); returns ``emitted``
        with each grammar row's tokens cut after the one its grammar ends at (its EOS, or a token after
        which nothing can follow: the verify's later columns were unconstrained, grammar.fill_chain)."""
        kept = dict(emitted)
        for b, tokens in emitted.items():
            grammar = self.grammars[b]
            if grammar is not None and tokens:
                kept[b] = tokens[: grammar.commit(tokens)]
        return kept

    def grammar_ends(self) -> Dict[int, str]:
        """Rows whose grammar lets nothing follow: row -> finish reason, "stop" where the text is a complete
        match (a row without EOS tokens), ``grammar.FINISH_DEAD_END`` where no token and not EOS is
        allowed although the match is incomplete."""
        ends = {b: self.grammar_end(b) for b, grammar in enumerate(self.grammars) if grammar is not None}
        return {b: reason for b, reason in ends.items() if reason is not None}

    def grammar_end(self, row: int) -> Optional[str]:
        """``grammar_ends`` for one row (None: its grammar lets something follow, or it has none)."""
        grammar = self.grammars[row]
        if grammar is None or not grammar.is_dead_end():
            return None
        # (accepting: a grammar that matched the empty text from the start, e.g. regex "", is not yet "stopped")
        return "stop" if grammar.is_complete() or grammar.is_accepting() else FINISH_DEAD_END


def with_some_token(processed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``processed`` where it keeps a finite logit, else (a grammar or a ban excluded every token a drafter's
    vocabulary holds) the unprocessed ``logits``: verification keeps the output exact whatever q proposes, and
    a q over no token is none. [..., V] -> [..., V]"""
    empty = torch.isneginf(processed).all(-1, keepdim=True)  # [..., 1]
    return torch.where(empty, logits, processed)
