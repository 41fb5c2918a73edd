"""Where the drafters and the verifier meet (vLLM v1 style): the loop's step buffers, a drafter's
``Proposal`` and the verifier's ``Verdict``.

Shapes: B batch rows, n draft slots per step (a chain's k, adaptive k's k_max, or a tree's N nodes;
0 for plain decoding), S cache positions per row, V the target's vocabulary.

Ownership. ``SpecDecodeMetadata`` is written by the step and the loop (step.py, decode.py) and by its own
methods: a row joins (``set_row``, ``set_prompts``, ``set_first_tokens``) and leaves (``clear_rows``) through
them, never by field writes from outside; drafters and the verifier read it. It is data during a step:
the host facts a step reads (``batch_size``, ``device``, ``all_greedy``) are fields its methods keep true. A drafter returns its proposal in tensors it owns (the same storage every step, so
that a captured step can be replayed); the verifier writes its verdict into the loop's output buffers.
Every tensor is allocated once, before the first step, with a static shape; lengths live in tensors,
never in Python ints, so a step can be captured in a CUDA graph. Finished rows stay in the batch
(frozen: they commit nothing) until every row is done.

Randomness: row b draws from Philox keyed by ``seed[b]``; step s uses the counters
``offset = s * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET`` for the verifier (columns 0..n) and
``... + PHILOX_DRAFT_OFFSET`` for the drafter's own sampling. The step index is the same for a row
whatever else shares the batch, so a row's tokens do not depend on the batch. Under continuous batching
(specdec_ext/serve/) rows join and leave between steps, so each row counts its own steps
(``set_row_steps``) and may have its own filter (``row_sampling``); the engine steps over a view of the
slots in use (``rows``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .processing import ProcessingState
from .sampling import SamplingParams

PHILOX_OFFSET_STRIDE = 2  # Philox counters reserved per step: one for verification, one for drafting
PHILOX_VERIFY_OFFSET = 0  # the verifier's draws of step s: offset s * stride + 0
PHILOX_DRAFT_OFFSET = 1  # the drafter's draws of step s: offset s * stride + 1


@dataclass
class Proposal:
    """One step's drafts, in tensors the drafter owns."""

    token_ids: torch.Tensor  # [B, n] int64: chain positions, or tree nodes in topological order
    probs: Optional[torch.Tensor]  # [B, n, V] fp32: the filtered q each token was drawn from; None: deterministic
    num_draft: torch.Tensor  # [B] int32: drafted tokens (or nodes) of each row, 0..n
    parents: Optional[torch.Tensor] = None  # [B, n] int32: a tree (csrc/tree.h layout, -1 = child of the root)
    longest: Optional[int] = None  # host: a bound on max(num_draft) when the drafter knows it (the verify
    #                                pass is then longest + 1 wide); None: n

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class Verdict:
    """What verification decided, in the loop's buffers."""

    tokens: torch.Tensor  # [B, n+1] int64: accepted tokens, then the recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] int32: accepted drafts (the row emits num_accepted + 1), < 0: a RowStatus
    path: Optional[torch.Tensor] = None  # [B, n] int32: a tree's accepted node indices, then -1; None: a chain


@dataclass
class SpecDecodeMetadata:
    """The decode loop's static per-step buffers (written by the loop only)."""

    slots: int  # n: draft slots per step (static)
    sampling: SamplingParams  # the filter, the same for every row (the kernels also take it per row)

    # sequence state ------------------------------------------------------------------------------
    token_buffer: torch.Tensor  # [B, S] int64: prompt, committed tokens, the pending token
    seq_lens: torch.Tensor  # [B] int64: tokens in token_buffer, the pending token included
    prompt_lens: torch.Tensor  # [B] int64
    active: torch.Tensor  # [B] bool: False once the row has finished (it is then frozen)

    # per-row sampling parameters and draws -------------------------------------------------------
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64: Philox key of the row
    verify_offset: torch.Tensor  # [B] int64: Philox counter of the verifier at this step
    draft_offset: torch.Tensor  # [B] int64: Philox counter of the drafter at this step

    # target pass ---------------------------------------------------------------------------------
    target_input: torch.Tensor  # [B, n+1] int64: the pending token (kept by every write of seq_lens), then the drafts
    target_num_tokens: torch.Tensor  # [B] int64: num_draft + 1 (ragged proposals)
    verify_logits: Optional[torch.Tensor]  # [B, n+1, V]: a narrower pass widened into it (made on first use)

    # verdict and commit --------------------------------------------------------------------------
    output_tokens: torch.Tensor  # [B, n+1] int64: Verdict.tokens
    plain_tokens: torch.Tensor  # [B, 1] int64: Verdict.tokens of a step without drafts (step.verify)
    num_accepted: torch.Tensor  # [B] int32: Verdict.num_accepted
    tree_path: Optional[torch.Tensor]  # [B, n] int32: Verdict.path (tree proposals only)
    num_kept: torch.Tensor  # [B] int64: tokens the target commits (num_accepted + 1; 0 when frozen)

    # what a step without drafts verifies (plain decoding, or adaptive k's speculation-off steps) --
    no_drafts: Proposal

    # host facts, kept true by the methods below ---------------------------------------------------
    batch_size: int  # B
    device: torch.device
    all_greedy: bool  # every row greedy: a drafter then proposes argmaxes and no q
    row_sampling: Optional[List[SamplingParams]] = None  # each row's own filter (continuous batching;
    #   the tensors above hold the same values); None: ``sampling`` for every row

    # request fields beyond the filter (issue 28) ---------------------------------------------------
    processing: Optional[ProcessingState] = None  # logits processors per row (processing.py); None: none
    top_logprobs: Optional[int] = None  # host: logprobs of the emitted tokens with this many top tokens
    #   (logprobs.py); None: not computed
    step_logprobs: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # the last verify's
    #   (chosen [B, n+1], top ids [B, n+1, top], top values [B, n+1, top]); logprobs.step_logprobs

    @classmethod
    def allocate(cls, *, batch_size: int, slots: int, max_seq_len: int, sampling: SamplingParams,
                 seeds: torch.Tensor, tree: bool = False) -> "SpecDecodeMetadata":
        """Allocate every buffer once on ``seeds``' device; ``seeds`` is [B] int64; ``max_seq_len`` is S
        (the token buffer's width)."""
        B, n, device = batch_size, slots, seeds.device
        long = dict(dtype=torch.int64, device=device)
        no_drafts = Proposal(token_ids=torch.zeros((B, n), **long), probs=None,
                             num_draft=torch.zeros((B,), dtype=torch.int32, device=device), longest=0)
        return cls(
            slots=n,
            sampling=sampling,
            token_buffer=torch.zeros((B, max_seq_len), **long),
            seq_lens=torch.zeros((B,), **long),
            prompt_lens=torch.zeros((B,), **long),
            active=torch.ones((B,), dtype=torch.bool, device=device),
            temperature=torch.full((B,), float(sampling.temperature), dtype=torch.float32, device=device),
            top_k=torch.full((B,), int(sampling.top_k), dtype=torch.int32, device=device),
            top_p=torch.full((B,), float(sampling.top_p), dtype=torch.float32, device=device),
            seed=seeds.to(dtype=torch.int64).clone(),
            verify_offset=torch.zeros((B,), **long),
            draft_offset=torch.zeros((B,), **long),
            target_input=torch.zeros((B, n + 1), **long),
            target_num_tokens=torch.full((B,), n + 1, **long),
            verify_logits=None,
            output_tokens=torch.full((B, n + 1), -1, **long),
            plain_tokens=torch.full((B, 1), -1, **long),
            num_accepted=torch.zeros((B,), dtype=torch.int32, device=device),
            tree_path=torch.full((B, n), -1, dtype=torch.int32, device=device) if tree else None,
            num_kept=torch.zeros((B,), **long),
            no_drafts=no_drafts,
            batch_size=B,
            device=device,
            all_greedy=sampling.greedy,
        )

    # ------------------------------------------------------------------ views
    def rows(self, width: int) -> "SpecDecodeMetadata":
        """Rows 0..width-1 as metadata of their own: every buffer a view (writes reach this one)."""
        view = self._map_rows(lambda t: t[:width])
        view.set_row_sampling(None if self.row_sampling is None else self.row_sampling[:width])
        view.processing = None if self.processing is None else self.processing.rows(width)
        return view

    def select(self, index: torch.Tensor) -> "SpecDecodeMetadata":
        """Rows ``index`` [n] int64 as metadata of their own: every buffer a gathered copy, but the
        verify pass's scratch (``verify_logits``, made again on first use): a server's is [B, n+1, V],
        and copying its rows cost each join 9 ms at 16 slots, k = 8 (every joining row's prefill)."""
        picked = dataclasses.replace(self, verify_logits=None)._map_rows(lambda t: t[index])
        picked.set_row_sampling(None if self.row_sampling is None else [self.row_sampling[i] for i in index.tolist()])
        picked.processing = None if self.processing is None else self.processing.select(index)
        return picked

    def _map_rows(self, take: Callable[[torch.Tensor], torch.Tensor]) -> "SpecDecodeMetadata":
        """A copy whose per-row buffers (every tensor field, the no-drafts proposal) are ``take`` of ours."""
        def part(value):
            if isinstance(value, tuple):  # step_logprobs: a step's output, not row state
                return None
            if isinstance(value, torch.Tensor):
                return take(value)
            if isinstance(value, Proposal):
                return dataclasses.replace(value, **{f.name: take(getattr(value, f.name))
                                                     for f in dataclasses.fields(value)
                                                     if isinstance(getattr(value, f.name), torch.Tensor)})
            return value

        mapped = dataclasses.replace(self, **{f.name: part(getattr(self, f.name)) for f in dataclasses.fields(self)})
        mapped.batch_size = mapped.token_buffer.shape[0]
        return mapped

    # ------------------------------------------------------------------ rows joining and leaving
    def set_row_sampling(self, row_sampling: Optional[List[SamplingParams]]) -> None:
        """Each row's own filter (host list [B]; None: ``sampling`` for every row); ``all_greedy`` follows."""
        self.row_sampling = None if row_sampling is None else list(row_sampling)
        rows = [self.sampling] if self.row_sampling is None else self.row_sampling
        self.all_greedy = all(params.greedy for params in rows)

    def set_row(self, row: int, sampling: SamplingParams, seed: int) -> None:
        """Row ``row`` takes a request's filter and Philox seed (continuous batching)."""
        self.temperature[row] = float(sampling.temperature)
        self.top_k[row] = int(sampling.top_k)
        self.top_p[row] = float(sampling.top_p)
        self.seed[row] = int(seed)
        self._set_rows_sampling([row], sampling)

    def set_prompts(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Rows ``rows`` hold ``prompts`` (token_buffer, prompt_lens), nothing generated yet."""
        for row, prompt in zip(rows, prompts):
            self.token_buffer[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.int64)
            self.prompt_lens[row] = len(prompt)

    def set_first_tokens(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows ``index`` [n] int64 emit their first token ``tokens`` [n] (sampled from the prefill's
        logits), the pending token of their first step: seq_lens = prompt_lens + 1."""
        lengths = self.prompt_lens[index]  # [n]
        self.token_buffer[index, lengths] = tokens
        self.seq_lens[index] = lengths + 1
        self.target_input[index, 0] = tokens
        if self.processing is not None:
            self.processing.record_rows(index, tokens)

    def hold_rows(self, rows: Sequence[int], token: int) -> None:
        """Rows ``rows`` joined but their prompts are still being prefilled (chunked prefill): each holds a
        one-token prompt ``token`` and the same token pending, which a drafter can take as a stand-in
        prompt (it keeps the pending token unfed); frozen in the steps until ``set_prompts``."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        self.set_prompts(rows, [[token]] * len(rows))
        self.set_first_tokens(index, torch.full((len(rows),), token, dtype=torch.int64, device=self.device))

    def clear_rows(self, rows: Sequence[int], token: int, sampling: SamplingParams) -> None:
        """Rows ``rows`` leave: each becomes a frozen one-token row (``token``), greedy with seed 0, so that
        a drafter re-feeds the token and rolls it back and the target forwards it and commits nothing (a
        length of 0 would make a drafter's rollback negative)."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        self.token_buffer[index, 0] = token
        self.target_input[index, 0] = token
        self.seq_lens[index] = 1
        self.prompt_lens[index] = 0
        self.active[index] = False
        self.temperature[index] = float(sampling.temperature)
        self.top_k[index] = int(sampling.top_k)
        self.top_p[index] = float(sampling.top_p)
        self.seed[index] = 0
        self._set_rows_sampling(rows, sampling)
        if self.processing is not None:
            for row in rows:
                self.processing.clear_row(row)

    def _set_rows_sampling(self, rows: Sequence[int], sampling: SamplingParams) -> None:
        """``row_sampling`` with ``rows`` set to ``sampling`` (the other rows keep theirs)."""
        row_sampling = list(self.row_sampling) if self.row_sampling is not None else [self.sampling] * self.batch_size
        for row in rows:
            row_sampling[row] = sampling
        self.set_row_sampling(row_sampling)

    def reserve_verify_logits(self, vocab_size: int) -> None:
        """Allocate ``verify_logits`` [B, n+1, V] fp32 now (a server, whose drafter may propose narrower
        than n: no allocation in a step)."""
        self.verify_logits = torch.zeros((self.batch_size, self.slots + 1, vocab_size), dtype=torch.float32,
                                         device=self.device)

    # ------------------------------------------------------------------ Philox steps

    def set_row_steps(self, steps: torch.Tensor) -> None:
        """Point each row's Philox counters at its own step index ``steps`` [B] int64 (continuous
        batching: a row counts its own steps, so its draws do not depend on when it joined)."""
        steps = steps.to(device=self.device, dtype=torch.int64)
        self.verify_offset.copy_(steps * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET)
        self.draft_offset.copy_(steps * PHILOX_OFFSET_STRIDE + PHILOX_DRAFT_OFFSET)

    def set_step(self, step: int) -> None:
        """Point every row's Philox counters at step ``step`` (in place: the buffers stay the same)."""
        self.verify_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET)
        self.draft_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_DRAFT_OFFSET)



    def pending_tokens(self) -> torch.Tensor:
        """The last emitted token of each row (committed to token_buffer, not yet to the target cache):
        the first token of the next target pass, which ``target_input[:, 0]`` holds (``set_first_tokens``,
        ``clear_rows`` and the step's commit, step.append_tokens, keep it). Shape: [B, 1] int64, a copy."""
        return self.target_input[:, :1].clone()
