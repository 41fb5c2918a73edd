"""Sampling ops: chain_verify, residual_probs, philox_uniforms (typed wrappers and fake kernels).

Each wrapper allocates the outputs (or takes them through ``out=``), fills in per-row defaults and
turns the per-row status codes of the verifiers into errors. The decode loop passes preallocated
``out`` buffers and ``check_status=False`` so that a step stays free of host synchronisation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from typing_extensions import Unpack

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .._status import raise_for_row_status
from ._common import (RowParam, SamplingKeywords, check_same_device, row_tensor, sampling_op_args,
                      with_sampling_parameters_doc)


@with_sampling_parameters_doc(
    "k", "column i < k decides draft position i, column k samples the recovered or bonus token by "
    "inverse CDF (the smallest index whose running sum exceeds u times the total mass).")
def chain_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    *,
    num_draft: RowParam = None,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    check_status: bool = True,
    **sampling: Unpack[SamplingKeywords],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of draft tokens per row, losslessly (fused rejection sampling).

    At each draft position i the draft token x is accepted with probability min(1, p_i(x) / q_i(x)),
    where p_i is the target distribution softmax(logits / T) filtered by top-k then top-p; at the first
    rejection the recovered token is drawn from normalise(max(0, p_i - q_i)); if every drafted token is
    accepted the bonus token is drawn from p at the next position. Greedy rows (T below
    ``GREEDY_TEMPERATURE``) accept while the draft equals argmax p (the lowest index on ties) and
    emit argmax p. The emitted tokens are distributed exactly as sampling from the filtered target.

    Parameters
    ----------
    target_logits : torch.Tensor
        Target logits at the k draft positions and the bonus position, fp32, bf16 or fp16.
        Shape: [B, k+1, V]
    draft_token_ids : torch.Tensor
        Drafted tokens, int64. Entries past a row's ``num_draft`` are ignored.
        Shape: [B, k]
    draft_probs : torch.Tensor, optional
        The (filtered) distribution each draft token was sampled from, fp32. None for deterministic
        drafters (n-gram lookup, greedy drafts): q is then one-hot at the drafted token.
        Shape: [B, k, V]
    num_draft : int or torch.Tensor, optional
        Drafted tokens per row (ragged batches), int32, each in [0, k]; default k.
        Shape: [B]
    {sampling_parameters}
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated (tokens, num_accepted).
    check_status : bool
        Raise ``ValueError`` for rows with invalid input (reads ``num_accepted`` on the host).

    Returns
    -------
    tokens : torch.Tensor
        Accepted draft tokens, then the recovered or bonus token, then -1, int64.
        Shape: [B, k+1]
    num_accepted : torch.Tensor
        Accepted draft tokens per row, int32 (the row emits num_accepted + 1 tokens); a negative
        status code for an invalid row when ``check_status`` is False.
        Shape: [B]
    """
    batch, positions = target_logits.shape[0], target_logits.shape[1] if target_logits.dim() > 1 else 0
    device = target_logits.device
    if out is None:
        tokens = torch.empty((batch, positions), dtype=torch.int64, device=device)
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    else:
        tokens, num_accepted = out
    torch.ops.specdec_ext.chain_verify(
        target_logits,
        draft_token_ids,
        draft_probs,
        row_tensor(num_draft, "num_draft", batch, torch.int32, device),
        *sampling_op_args("chain_verify", batch, device, sampling),
        tokens,
        num_accepted,
    )
    if check_status:
        raise_for_row_status("chain_verify", num_accepted)
    return tokens, num_accepted


def _check_probabilities(name: str, probs: torch.Tensor) -> None:
    if probs.is_floating_point() and not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError(f"residual_probs: {name} must hold probabilities in [0, 1] (no NaN)")


def residual_probs(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    check_values: bool = True,
) -> torch.Tensor:
    """The residual distribution normalise(max(0, p - q)) over the last dimension.

    Where the residual mass is zero (p == q, so a rejection cannot happen) the result is p itself.

    Parameters
    ----------
    target_probs : torch.Tensor
        Target distribution p, fp32, bf16 or fp16.
        Shape: [..., V]
    draft_probs : torch.Tensor
        Draft distribution q, same dtype as ``target_probs``.
        Shape: [..., V]
    out : torch.Tensor, optional
        Preallocated fp32 output.
    check_values : bool
        Check that both inputs lie in [0, 1] without NaN (reads a flag on the host).

    Returns
    -------
    torch.Tensor
        The residual distribution, fp32.
        Shape: [..., V]
    """
    if check_values:
        _check_probabilities("target_probs", target_probs)
        _check_probabilities("draft_probs", draft_probs)
    if out is None:
        out = torch.empty(target_probs.shape, dtype=torch.float32, device=target_probs.device)
    torch.ops.specdec_ext.residual_probs(target_probs, draft_probs, out)
    return out


def philox_uniforms(seed: torch.Tensor, offset: torch.Tensor, num_draws: int) -> torch.Tensor:
    """The uniforms the verifiers draw: ``out[b, c] = philox4x32_10(seed[b], offset[b], c)``.

    Parameters
    ----------
    seed, offset : torch.Tensor
        Philox key and counter per row, int64.
        Shape: [B]
    num_draws : int
        Draws per row (C).

    Returns
    -------
    torch.Tensor
        Uniforms in [0, 1 - 2^-24], fp32.
        Shape: [B, C]
    """
    out = torch.empty((seed.shape[0] if seed.dim() else 0, num_draws), dtype=torch.float32, device=seed.device)
    torch.ops.specdec_ext.philox_uniforms(seed, offset, out)
    return out


# Fake kernels: every op mutates its outputs in place and returns nothing; the fakes repeat the
# device check, which is the one a mixed-device call reaches when one argument is a meta tensor.
@torch.library.register_fake("specdec_ext::chain_verify")
def _chain_verify_fake(target_logits, draft_token_ids, draft_probs, num_draft, temperature, top_k,
                       top_p, seed, offset, uniforms, tokens, num_accepted):
    check_same_device("chain_verify", "target_logits", target_logits, draft_token_ids=draft_token_ids,
                      draft_probs=draft_probs, num_draft=num_draft, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=seed, offset=offset, uniforms=uniforms, tokens=tokens,
                      num_accepted=num_accepted)


@torch.library.register_fake("specdec_ext::residual_probs")
def _residual_probs_fake(target_probs, draft_probs, out):
    check_same_device("residual_probs", "target_probs", target_probs, draft_probs=draft_probs, out=out)


@torch.library.register_fake("specdec_ext::philox_uniforms")
def _philox_uniforms_fake(seed, offset, out):
    check_same_device("philox_uniforms", "out", out, seed=seed, offset=offset)
