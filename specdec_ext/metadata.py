"""Where the proposers and the verifier meet: one dataclass of per-step tensors (vLLM v1 style).

``SpecDecodeMetadata`` holds every tensor one decode step reads or writes. All of them are allocated
once, before the first step, with static shapes (B = batch rows, k = draft length, S = cache
positions per row, V = the target's vocabulary); lengths live in tensors, never in Python ints, so a
step can be captured in a CUDA graph without reshaping the loop. Rows that have finished stay in the
batch (frozen: they commit nothing) until every row is done.

Randomness: row b draws from Philox keyed by ``seed[b]``; step s uses the counters
``offset = s * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET`` for the verifier (columns 0..k) and
``... + PHILOX_DRAFT_OFFSET`` for the drafter's own sampling (columns 0..k-1). The step index is the
same for a row whatever else shares the batch, so a row's tokens do not depend on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

PHILOX_OFFSET_STRIDE = 2  # Philox counters reserved per step: one for verification, one for drafting
PHILOX_VERIFY_OFFSET = 0  # chain_verify's draws of step s: offset s * stride + 0, columns 0..k
PHILOX_DRAFT_OFFSET = 1  # the drafter's draws of step s: offset s * stride + 1, columns 0..k-1
MAX_DRAFT_FEED = 2  # committed tokens a model drafter may not have seen: the bonus/recovered token
# and, when every draft was accepted, the last draft token (which it proposed but never fed)


@dataclass(frozen=True)
class SamplingParams:
    """The filter applied alike to the target and the draft: softmax(l / T), top-k, then top-p."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 is off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 is off), got {self.top_p}")


@dataclass
class SpecDecodeMetadata:
    """Static per-step buffers shared by the drafter, the target forward and chain_verify."""

    k: int  # draft tokens per step (static)
    sampling: SamplingParams  # the filter, the same for every row (the kernels also take it per row)

    # sequence state -----------------------------------------------------------------------------
    token_buffer: torch.Tensor  # [B, S] int64: prompt, then committed tokens, then the pending token
    seq_lens: torch.Tensor  # [B] int64: tokens in token_buffer, the pending token included
    prompt_lens: torch.Tensor  # [B] int64
    num_generated: torch.Tensor  # [B] int64: new tokens of the row so far (pending one included)
    active: torch.Tensor  # [B] bool: False once the row has finished (it is then frozen)

    # proposal (written by the drafter) ----------------------------------------------------------
    draft_token_ids: torch.Tensor  # [B, k] int64
    draft_probs: Optional[torch.Tensor]  # [B, k, V] fp32: the filtered q rows; None when greedy
    num_draft: torch.Tensor  # [B] int32: drafted tokens per row, 0..k

    # target pass (written by the loop) ----------------------------------------------------------
    target_input: torch.Tensor  # [B, k+1] int64: the pending token, then the k draft tokens
    target_num_tokens: torch.Tensor  # [B] int64: num_draft + 1 (ragged proposals)

    # verification (per-row parameters of chain_verify, and its outputs) -------------------------
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64: Philox key of the row
    verify_offset: torch.Tensor  # [B] int64: Philox counter of chain_verify at this step
    draft_offset: torch.Tensor  # [B] int64: Philox counter of the drafter at this step
    output_tokens: torch.Tensor  # [B, k+1] int64: accepted drafts, recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] int32: accepted draft tokens (the row emits num_accepted + 1)
    num_kept: torch.Tensor  # [B] int64: tokens the target commits (num_accepted + 1, 0 when frozen)
    step: int = 0  # decode step index (host-side; offsets are derived from it)
    # adaptive k (specdec_ext/adaptive.py) ---------------------------------------------------------
    draft_budget: Optional[List[int]] = None  # host [B]: most drafts row b may propose this step (None:
    # k); a drafter that knows its counts on the host lowers it to them (the verify pass's width)
    verify_logits: Optional[torch.Tensor] = None  # [B, k+1, V]: narrower verify passes widened into it

    # tree proposals (only with a tree drafter; None on the chain path) --------------------------
    # The k draft slots are then N tree nodes: draft_token_ids [B, N] holds their tokens, target_input
    # [B, N+1] is [pending, nodes], output_tokens [B, N+1] the accepted path then the recovered/bonus
    # token; draft_probs is None (deterministic candidates, tree_verify's draft_probs=None rule).
    tree_parents: Optional[torch.Tensor] = None  # [B, N] int32: csrc/tree.h layout, -1 = child of pending
    tree_path: Optional[torch.Tensor] = None  # [B, N] int32: tree_verify's accepted node indices, then -1

    @property
    def batch_size(self) -> int:
        return self.token_buffer.shape[0]

    @property
    def verify_width(self) -> int:
        """Tokens per row of this step's target pass: k + 1, or max(draft_budget) + 1 (adaptive k)."""
        return self.k + 1 if self.draft_budget is None else max(self.draft_budget, default=0) + 1

    @classmethod
    def allocate(cls, *, batch_size: int, k: int, max_seq_len: int, vocab_size: int,
                 sampling: SamplingParams, seeds: torch.Tensor, device: torch.device) -> "SpecDecodeMetadata":
        """Allocate every buffer once; ``seeds`` is [B] int64."""
        B, S, V = batch_size, max_seq_len, vocab_size
        long = dict(dtype=torch.int64, device=device)
        return cls(
            k=k,
            sampling=sampling,
            token_buffer=torch.zeros((B, S), **long),
            seq_lens=torch.zeros((B,), **long),
            prompt_lens=torch.zeros((B,), **long),
            num_generated=torch.zeros((B,), **long),
            active=torch.ones((B,), dtype=torch.bool, device=device),
            draft_token_ids=torch.zeros((B, k), **long),
            draft_probs=None if sampling.greedy or k == 0 else torch.zeros((B, k, V), dtype=torch.float32, device=device),
            num_draft=torch.full((B,), k, dtype=torch.int32, device=device),
            target_input=torch.zeros((B, k + 1), **long),
            target_num_tokens=torch.full((B,), k + 1, **long),
            temperature=torch.full((B,), float(sampling.temperature), dtype=torch.float32, device=device),
            top_k=torch.full((B,), int(sampling.top_k), dtype=torch.int32, device=device),
            top_p=torch.full((B,), float(sampling.top_p), dtype=torch.float32, device=device),
            seed=seeds.to(device=device, dtype=torch.int64).clone(),
            verify_offset=torch.zeros((B,), **long),
            draft_offset=torch.zeros((B,), **long),
            output_tokens=torch.full((B, k + 1), -1, **long),
            num_accepted=torch.zeros((B,), dtype=torch.int32, device=device),
            num_kept=torch.zeros((B,), **long),
        )

    def enable_tree(self) -> None:
        """Switch the k draft slots to a tree of N = k nodes (allocates tree_parents and tree_path)."""
        B, N, device = self.batch_size, self.k, self.token_buffer.device
        self.tree_parents = torch.full((B, N), -1, dtype=torch.int32, device=device)
        self.tree_path = torch.full((B, N), -1, dtype=torch.int32, device=device)
        self.draft_probs = None

    def set_step(self, step: int) -> None:
        """Point the Philox counters at step ``step`` (in place: the buffers stay the same)."""
        self.step = step
        self.verify_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_VERIFY_OFFSET)
        self.draft_offset.fill_(step * PHILOX_OFFSET_STRIDE + PHILOX_DRAFT_OFFSET)


def filtered_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) filtered by top-k then top-p and renormalised, in fp32 (one-hot at T = 0).

    The same filter as the verifier kernels (csrc/common/sampling_math.h): every logit tied with the
    k-th largest is kept; top-p keeps every logit >= the one at which the descending cumulative mass
    first reaches top_p times the mass left after top-k.

    logits [..., V] -> probs [..., V] fp32
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    max_logit = logits.amax(-1, keepdim=True)
    weights = torch.exp((logits - max_logit) / sampling.temperature)
    threshold = torch.full_like(max_logit, -float("inf"))
    if 0 < sampling.top_k < vocab:
        threshold = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        sorted_weights = torch.gather(weights, -1, order) * (sorted_logits >= threshold)
        cumulative = torch.cumsum(sorted_weights, dim=-1)
        reached = cumulative >= sampling.top_p * cumulative[..., -1:]
        cut = reached.int().argmax(-1, keepdim=True)  # first position reaching top_p of the mass
        threshold = torch.maximum(threshold, torch.gather(sorted_logits, -1, cut))
    weights = torch.where(logits >= threshold, weights, torch.zeros_like(weights))
    return weights / weights.sum(-1, keepdim=True)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The smallest index whose running sum of ``probs`` exceeds u times the total (the kernels' rule).

    probs [B, V] fp32, uniforms [B] fp32 in [0, 1) -> tokens [B] int64
    """
    cumulative = torch.cumsum(probs, dim=-1)
    target = (uniforms.to(cumulative.dtype) * cumulative[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last_positive)
