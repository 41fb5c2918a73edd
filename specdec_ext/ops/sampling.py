"""Sampling ops: chain_verify, sample_filtered, residual_probs, philox_uniforms (typed wrappers and fake kernels), and
the verifiers' shared arguments: per-row parameters and the sampling keywords (one definition for
chain_verify and tree_verify, which imports them from here: their types, defaults, seeds and
documentation).

Each wrapper allocates the outputs (or takes them through ``out=``), fills in per-row defaults and
turns the per-row status codes of the verifiers into errors. The decode loop passes preallocated
``out`` buffers and ``check_status=False`` so that a step stays free of host synchronisation.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple, TypedDict, Union

import numpy as np
import torch
from typing_extensions import Unpack

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .._status import raise_for_row_status
from .fake_checks import check_operand_devices

RowParam = Union[None, float, int, torch.Tensor]

# Temperatures below this are greedy (one-hot argmax, lowest index on ties) in every verifier, on
# every backend: kGreedyTemperature of csrc/common/sampling_math.h. Python-side filters mirror it.
GREEDY_TEMPERATURE = 1e-5


class SamplingKeywords(TypedDict, total=False):
    """The sampling keywords every verifier op takes (see ``with_sampling_parameters_doc``)."""
    temperature: RowParam
    top_k: RowParam
    top_p: RowParam
    seed: RowParam
    offset: RowParam
    uniforms: Optional[torch.Tensor]


# ------------------------------------------------------------------------ the verifiers' arguments
def python_number(value):
    """numpy's (and any numbers.Real's) scalars as Python ints / floats, as Python numbers are taken; a bool or
    anything else as given."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def row_tensor(value: RowParam, name: str, batch: int, dtype: torch.dtype, device: torch.device):
    """A [B] tensor from a scalar (broadcast to every row; numpy's too), a tensor, or None (op default)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    value = python_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")
    if not dtype.is_floating_point and not float(value).is_integer():  # (torch.full would truncate it)
        raise ValueError(f"{name} must be a whole number for the op's {str(dtype).replace('torch.', '')} rows, "
                         f"got {value!r}")
    try:
        return torch.full((batch,), value, dtype=dtype, device=device)
    except (RuntimeError, OverflowError):  # (torch: "value cannot be converted ... without overflow"; past int64)
        largest = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
        raise ValueError(f"{name}={value!r} does not fit the op's {str(dtype).replace('torch.', '')} rows "
                         f"(at most {largest} in magnitude)") from None


def saturated_top_k(top_k: RowParam) -> RowParam:
    """A top_k past int32 is off (as any top_k >= V is): int32's largest, which the op's rows hold (the op
    wrappers' and SamplingParams' one rule)."""
    limit = torch.iinfo(torch.int32).max
    top_k = python_number(top_k)
    return limit if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > limit else top_k


def default_seeds(batch: int, device: torch.device) -> Optional[torch.Tensor]:
    """One Philox seed per row from torch's default CPU generator (``torch.manual_seed`` reproduces
    them), on ``device``; None during a CUDA graph capture, where a host-to-device copy cannot run:
    the op then reports every sampling row (greedy rows need no draws)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    info = torch.iinfo(torch.int64)
    return torch.randint(info.min, info.max, (batch,), dtype=torch.int64).to(device)


def sampling_op_args(op: str, batch: int, device: torch.device, sampling: SamplingKeywords) -> Tuple:
    """The verifier op's (temperature, top_k, top_p, seed, offset, uniforms) from the wrapper's
    keywords: numbers broadcast to [B] tensors of the op's dtypes, seeds drawn when neither seed nor
    uniforms is given."""
    unknown = set(sampling) - set(SamplingKeywords.__annotations__)
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    seed, uniforms = sampling.get("seed"), sampling.get("uniforms")
    if seed is None and uniforms is None:
        seed = default_seeds(batch, device)
    return (row_tensor(sampling.get("temperature"), "temperature", batch, torch.float32, device),
            row_tensor(saturated_top_k(sampling.get("top_k")), "top_k", batch, torch.int32, device),
            row_tensor(sampling.get("top_p"), "top_p", batch, torch.float32, device),
            row_tensor(seed, "seed", batch, torch.int64, device),
            row_tensor(sampling.get("offset"), "offset", batch, torch.int64, device),
            uniforms)


def with_sampling_parameters_doc(n: str, draws: str):
    """Decorator: the ``{sampling_parameters}`` line of a verifier's docstring becomes the numpydoc
    entries of the sampling keywords, for n draft slots; ``draws`` says what the uniforms decide."""
    def decorate(function):
        function.__doc__ = function.__doc__.replace("{sampling_parameters}", _sampling_parameters(n, draws))
        return function
    return decorate


def _sampling_parameters(n: str, draws: str) -> str:
    return f"""temperature : float or torch.Tensor, optional
        Sampling temperature per row, fp32; default 1. Below ``GREEDY_TEMPERATURE`` (1e-5, 0
        included) the row is greedy: p is one-hot at argmax (the lowest index on ties). ``inf`` is
        uniform over the finite logits (top-k / top-p then keep the largest logits).
        Shape: [B]
    top_k : int or torch.Tensor, optional
        Keep the k most likely tokens (ties at the k-th kept), int32; 0 is off (default).
        Shape: [B]
    top_p : float or torch.Tensor, optional
        Keep the smallest most-likely set with mass >= top_p (after top-k), fp32 in (0, 1]; 1 is off.
        Shape: [B]
    seed, offset : int or torch.Tensor, optional
        Philox key and counter per row, int64; draw c of a row is philox(seed, offset, c), so a row's
        result does not depend on the other rows. With neither ``seed`` nor ``uniforms`` one seed per
        row is drawn from torch's default CPU generator (``torch.manual_seed`` reproduces the call).
        Inside a CUDA graph capture nothing can be drawn: pass ``seed`` (greedy rows need none;
        sampling rows without draws fail with an error naming seed and uniforms).
        Shape: [B]
    uniforms : torch.Tensor, optional
        Explicit draws in [0, 1), fp32, used instead of ``seed``: {draws}
        Shape: [B, {n}+1]"""


def raise_if_a_row_failed(op: str, num_accepted: torch.Tensor) -> None:
    """A verifier's ``check_status``: one host read; a failed row (a negative status) raises ``ValueError``
    naming the argument (_status.py). Meta tensors hold shapes, no statuses: nothing to read."""
    if not num_accepted.is_meta and bool((num_accepted < 0).any()):
        raise_for_row_status(op, num_accepted)


# ------------------------------------------------------------------------------------------ the ops
@with_sampling_parameters_doc(
    "k", "column i < num_draft[b] decides draft position i, column num_draft[b] samples the recovered or "
    "bonus token by inverse CDF (the smallest index whose running sum exceeds u times the total mass): a "
    "row's draws do not depend on the buffer's width k.")
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
        drafters (n-gram lookup, greedy drafts): q is then one-hot at the drafted token. Checked where the
        walk reads it (``ROW_STATUS_MESSAGES[-2]``): q(x) at each verified draft x, and a whole row only where
        a rejection resamples from it (an accepted position's other entries are never read).
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
    # (a tensor of another rank reaches the op, whose message names it)
    batch = target_logits.shape[0] if target_logits.dim() else 0
    positions = target_logits.shape[1] if target_logits.dim() > 1 else 0
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
        raise_if_a_row_failed("chain_verify", num_accepted)
    return tokens, num_accepted


def sample_filtered(
    logits: torch.Tensor,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    check_status: bool = True,
    **sampling: Unpack[SamplingKeywords],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from its filtered distribution, which is returned too: a drafter's
    sampled step, with the q the verifier then needs.

    Row b's distribution is the one the verifiers use for the target: softmax(logits / T) filtered by
    top-k then top-p (one-hot at the argmax, the lowest index on ties, for a greedy row). The token is
    drawn by inverse CDF (the smallest index whose running sum exceeds u times the total mass) at
    draw 0 of the row.

    Parameters
    ----------
    logits : torch.Tensor
        Draft logits, fp32, bf16 or fp16 (already processed: penalties, masks).
        Shape: [B, V]
    temperature, top_k, top_p, seed, offset : optional
        As for ``chain_verify``; one draw per row: philox(seed[b], offset[b], 0).
        Shape: [B]
    uniforms : torch.Tensor, optional
        Explicit draws in [0, 1), fp32, instead of ``seed``.
        Shape: [B, 1]
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated (probs, tokens); ``probs`` needs unit stride along V only, so a column
        ``buffer[:, i]`` of a [B, k, V] buffer can take it.
    check_status : bool
        Raise ``ValueError`` for rows with invalid input (reads ``tokens`` on the host).

    Returns
    -------
    probs : torch.Tensor
        The filtered distribution of each row, fp32 (all NaN for an invalid row).
        Shape: [B, V]
    tokens : torch.Tensor
        The drawn token per row, int64; a negative status code for an invalid row when
        ``check_status`` is False.
        Shape: [B]
    """
    batch = logits.shape[0] if logits.dim() > 0 else 0
    device = logits.device
    if out is None:
        probs = torch.empty(tuple(logits.shape), dtype=torch.float32, device=device)
        tokens = torch.empty((batch,), dtype=torch.int64, device=device)
    else:
        probs, tokens = out
    torch.ops.specdec_ext.sample_filtered(logits, *sampling_op_args("sample_filtered", batch, device, sampling),
                                          probs, tokens)
    if check_status:
        raise_if_a_row_failed("sample_filtered", tokens)
    return probs, tokens


# How far a probability row's sum may stray from 1 (float32 rows; bfloat16 and float16 rows round each entry to 8
# or 11 significant bits)
PROBABILITY_SUM_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _check_probabilities(name: str, probs: torch.Tensor) -> None:
    if probs.is_meta or not probs.is_floating_point() or probs.numel() == 0:  # (meta: shapes only)
        return
    if not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError(f"residual_probs: {name} must hold probabilities in [0, 1] (no NaN)")
    tolerance = PROBABILITY_SUM_TOLERANCE.get(probs.dtype, 1e-3)
    sums = probs.float().sum(dim=-1)
    if not bool(((sums - 1).abs() <= tolerance).all()):
        worst = float(sums.flatten()[(sums - 1).abs().flatten().argmax()])
        raise ValueError(f"residual_probs: every row of {name} must sum to 1 (within {tolerance}), one sums to "
                         f"{worst:.6g} (check_values=False skips this check)")


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
        Preallocated fp32 output, sharing no memory with the inputs (a row's mass is summed before it is written).
    check_values : bool
        Check that both inputs lie in [0, 1] without NaN and that each row sums to 1 (within
        ``PROBABILITY_SUM_TOLERANCE`` of its dtype; reads a flag on the host; meta tensors are not read).

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
    if isinstance(num_draws, bool) or not isinstance(num_draws, int) or num_draws < 0:
        raise ValueError(f"philox_uniforms: num_draws must be an int >= 0, got {num_draws!r}")
    out = torch.empty((seed.shape[0] if seed.dim() else 0, num_draws), dtype=torch.float32, device=seed.device)
    torch.ops.specdec_ext.philox_uniforms(seed, offset, out)
    return out


# Fake kernels: every op mutates its outputs in place and returns nothing; the fakes repeat the device check
# (fake_checks.check_operand_devices), which is the one a mixed-device call reaches when one argument is a meta tensor.
@torch.library.register_fake("specdec_ext::chain_verify")
def _chain_verify_fake(target_logits, *operands):
    check_operand_devices("chain_verify", (target_logits, *operands))


@torch.library.register_fake("specdec_ext::sample_filtered")
def _sample_filtered_fake(logits, *operands):
    check_operand_devices("sample_filtered", (logits, *operands))


@torch.library.register_fake("specdec_ext::residual_probs")
def _residual_probs_fake(target_probs, draft_probs, out):
    check_operand_devices("residual_probs", (target_probs, draft_probs, out))


@torch.library.register_fake("specdec_ext::philox_uniforms")
def _philox_uniforms_fake(seed, offset, out):
    check_operand_devices("philox_uniforms", (seed, offset, out), reference=2)
