"""Where the drafters and the verifier meet (vLLM v1 style): the loop's step buffers, a drafter's
``Proposal`` and the verifier's ``Verdict``.

Shapes: B batch rows, n draft slots per step (a chain's k, adaptive k's k_max, or a tree's N nodes;
0 for plain decoding), S cache positions per row, V the target's vocabulary.

Ownership. ``SpecDecodeMetadata`` is written by the decode loop only (decode.py); drafters and the
verifier read it. A drafter returns its proposal in tensors it owns (the same storage every step, so
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
from typing import Callable, List, Optional

import torch

from .sampling import SamplingParams

PHILOX_OFFSET_STRIDE = 2  # Philox counters reserved per step: one for verification, one for drafting
PHILOX_VERIFY_OFFSET = 0  # the verifier's draws of step s: offset s * stride + 0
PHILOX_DRAFT_OFFSET = 1  # the drafter's draws of step s: offset s * stride + 1
SCRATCH_COLUMNS = 1  # token_buffer's last column absorbs the masked-out writes of the commit scatter


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

    def verify_width(self) -> int:
        """Tokens per row of the target pass that verifies this proposal: [pending, drafts]."""
        slots = self.token_ids.shape[1]
        return (slots if self.longest is None else min(self.longest, slots)) + 1


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
    token_buffer: torch.Tensor  # [B, S] int64: prompt, committed tokens, the pending token, a scratch column
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
    target_input: torch.Tensor  # [B, n+1] int64: the pending token, then the drafts
    target_num_tokens: torch.Tensor  # [B] int64: num_draft + 1 (ragged proposals)
    verify_logits: Optional[torch.Tensor]  # [B, n+1, V]: a narrower pass widened into it (made on first use)

    # verdict and commit --------------------------------------------------------------------------
    output_tokens: torch.Tensor  # [B, n+1] int64: Verdict.tokens
    num_accepted: torch.Tensor  # [B] int32: Verdict.num_accepted
    tree_path: Optional[torch.Tensor]  # [B, n] int32: Verdict.path (tree proposals only)
    num_kept: torch.Tensor  # [B] int64: tokens the target commits (num_accepted + 1; 0 when frozen)

    # what a step without drafts verifies (plain decoding, or adaptive k's speculation-off steps) --
    no_drafts: Proposal
    step: int = 0  # decode step index (host-side; the Philox offsets are derived from it)
    row_sampling: Optional[List[SamplingParams]] = None  # host: each row's own filter (continuous
    #   batching; the tensors above hold the same values); None: ``sampling`` for every row

    @property
    def batch_size(self) -> int:
        return self.token_buffer.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_buffer.device

    @classmethod
    def allocate(cls, *, batch_size: int, slots: int, max_seq_len: int, sampling: SamplingParams,
                 seeds: torch.Tensor, tree: bool = False) -> "SpecDecodeMetadata":
        """Allocate every buffer once on ``seeds``' device; ``seeds`` is [B] int64; ``max_seq_len`` is S
        (SCRATCH_COLUMNS included)."""
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
            num_accepted=torch.zeros((B,), dtype=torch.int32, device=device),
            tree_path=torch.full((B, n), -1, dtype=torch.int32, device=device) if tree else None,
            num_kept=torch.zeros((B,), **long),
            no_drafts=no_drafts,
        )

    @property
    def all_greedy(self) -> bool:
        """Every row is greedy (host): a drafter then proposes argmaxes and no q."""
        if self.row_sampling is None:
            return self.sampling.greedy
        return all(params.greedy for params in self.row_sampling)

    def rows(self, width: int) -> "SpecDecodeMetadata":
        """Rows 0..width-1 as metadata of their own: every buffer a view (writes reach this one)."""
        view = self._map_rows(lambda t: t[:width])
        if self.row_sampling is not None:
            view.row_sampling = self.row_sampling[:width]
        return view

    def select(self, index: torch.Tensor) -> "SpecDecodeMetadata":
        """Rows ``index`` [n] int64 as metadata of their own: every buffer a gathered copy."""
        picked = self._map_rows(lambda t: t[index])
        if self.row_sampling is not None:
            picked.row_sampling = [self.row_sampling[i] for i in index.tolist()]
        return picked

    def _map_rows(self, take: Callable[[torch.Tensor], torch.Tensor]) -> "SpecDecodeMetadata":
        """A copy whose per-row buffers (every tensor field, the no-drafts proposal) are ``take`` of ours."""
        def part(value):
            if isinstance(value, torch.Tensor):
                return take(value)
            if isinstance(value, Proposal):
                return dataclasses.replace(value, **{f.name: take(getattr(value, f.name))
                                                     for f in dataclasses.fields(value)
                                                     if isinstance(getattr(value, f.name), torch.Tensor)})
            return value

        return dataclasses.replace(self, **{f.name: part(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def set_row_steps(self, steps: torch.Tensor) -> None:
        """Point each row's Philox counters at its own step index ``steps`` [B] int64 (continuous
        batching: a row counts its own steps, so its draws do not depend on when it joined)."""
        steps = steps.to(device=self.device, dtype=torch.int64)
        self.verify_offset.copy_(steps * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET)
        self.draft_offset.copy_(steps * PHILOX_OFFSET_STRIDE + PHILOX_DRAFT_OFFSET)

    def set_step(self, step: int) -> None:
        """Point the Philox counters at step ``step`` (in place: the buffers stay the same)."""
        self.step = step
        self.verify_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET)
        self.draft_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_DRAFT_OFFSET)

    def pending_tokens(self) -> torch.Tensor:
        """The last emitted token of each row (committed to token_buffer, not yet to the target cache):
        the first token of the next target pass. Shape: [B, 1] int64."""
        return torch.gather(self.token_buffer, 1, (self.seq_lens - 1)[:, None])
