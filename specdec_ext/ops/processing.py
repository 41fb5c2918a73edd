"""Logits processing inside verification: process_logits (typed wrapper and fake kernel).

The OpenAI sampling surface (logit bias, presence / frequency / repetition penalties, a grammar
bitmask, min_p) applied in place to the logits of one verification pass, column by column, with each
column's draft prefix counted as generated (csrc/logits_processing.h holds the contract).
"""
from __future__ import annotations

from typing import Optional, TypedDict

import torch
from typing_extensions import Unpack

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .fake_checks import check_operand_devices
from .sampling import RowParam, row_tensor

# The per-row parameters: keyword -> the op's dtype ([B] tensors; numbers are broadcast).
_ROW_PARAMETERS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "temperature")


class ProcessorKeywords(TypedDict, total=False):
    """The processors ``process_logits`` takes by keyword (all optional, None = off)."""
    output_counts: Optional[torch.Tensor]
    prompt_mask: Optional[torch.Tensor]
    logit_bias: Optional[torch.Tensor]
    allowed: Optional[torch.Tensor]
    presence_penalty: RowParam
    frequency_penalty: RowParam
    repetition_penalty: RowParam
    min_p: RowParam
    temperature: RowParam


def process_logits(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    parents: Optional[torch.Tensor] = None,
    num_draft: RowParam,
    **processors: Unpack[ProcessorKeywords],
) -> torch.Tensor:
    """Apply the sampling processors to a verification pass's logits, in place, column by column.

    Column 0 of a row is the position after its pending token, column c >= 1 the position after the
    draft prefix that leads to it: ``draft_tokens[b, :c]`` for a chain, node c - 1 and its ancestors
    for a tree. At each column the prefix's tokens count as generated: count[t] = output_counts[b, t]
    + occurrences of t in the prefix, seen[t] = prompt_mask[b, t] or count[t] > 0. Then, for every
    token t, in vLLM's order (fp32 maths, stored back in the dtype of ``logits``):

    1. ``l = logit + logit_bias[t]``
    2. repetition penalty r (HF): if r != 1 and seen[t], ``l = l / r`` if l > 0 else ``l * r``
    3. ``l -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`` (OpenAI)
    4. grammar: ``l = -inf`` where ``allowed`` clears t's bit (a NaN logit stays NaN)
    5. min_p: with m the column's largest finite l, ``l = -inf`` where ``l < m + T * log(min_p)``,
       i.e. where softmax(l / T) gives t less than ``min_p`` times the top probability; only for
       0 < min_p and a finite T >= ``GREEDY_TEMPERATURE`` (greedy rows and T = inf: no cut).

    Columns past a row's ``num_draft`` are left untouched. A column where every token ends -inf
    stays so (the caller handles a grammar dead end); NaN logits stay NaN (the verifiers report
    them). With no processor given (bias, bitmask, penalties, min_p all None) nothing is read or
    written. Invalid values raise ``RuntimeError`` naming the argument (on CUDA after one host read,
    skipped during a CUDA graph capture).

    Parameters
    ----------
    logits : torch.Tensor
        The pass's logits, fp32, bf16 or fp16, contiguous; modified in place.
        Shape: [B, P, V]
    draft_tokens : torch.Tensor
        A chain's draft tokens, or a tree's nodes in topological order, int64, n = P - 1 (may be
        0); entries past a row's ``num_draft`` are not read.
        Shape: [B, n]
    parents : torch.Tensor, optional
        The tree (csrc/tree.h: -1 for a child of the root, ``parents[b, i] < i``), int32; None for
        a chain.
        Shape: [B, n]
    num_draft : int or torch.Tensor
        The drafts each row uses, int32 in [0, n].
        Shape: [B]
    output_counts : torch.Tensor, optional
        Occurrences of each token among the row's committed generated tokens, int32; None: zeros.
        Shape: [B, V]
    prompt_mask : torch.Tensor, optional
        Whether each token occurs in the row's prompt, bool; None: False.
        Shape: [B, V]
    logit_bias : torch.Tensor, optional
        Added to every column's logits, fp32 (-inf bans a token); None: 0.
        Shape: [B, V]
    allowed : torch.Tensor, optional
        A grammar bitmask per column (llguidance / xgrammar layout), int32, W = ceil(V / 32): token
        t is allowed at column c iff bit t % 32 of ``allowed[b, c, t // 32]`` is set; None: all.
        Shape: [B, P, W]
    presence_penalty, frequency_penalty : float or torch.Tensor, optional
        OpenAI's penalties, fp32, finite; None: 0.
        Shape: [B]
    repetition_penalty : float or torch.Tensor, optional
        HF's repetition penalty, fp32, finite and > 0; None or 1: off.
        Shape: [B]
    min_p : float or torch.Tensor, optional
        Keep tokens with at least ``min_p`` times the top probability, fp32 in [0, 1]; None or 0: off.
        Shape: [B]
    temperature : float or torch.Tensor, optional
        The rows' sampling temperatures, fp32 (used by min_p only); None: 1.
        Shape: [B]

    Returns
    -------
    torch.Tensor
        ``logits``, processed in place.
        Shape: [B, P, V]
    """
    unknown = set(processors) - set(ProcessorKeywords.__annotations__)
    if unknown:
        raise TypeError(f"process_logits() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    batch, device = (logits.shape[0] if logits.dim() else 0), logits.device
    rows = {name: row_tensor(processors.get(name), name, batch, torch.float32, device) for name in _ROW_PARAMETERS}
    torch.ops.specdec_ext.process_logits(
        logits,
        draft_tokens,
        parents,
        row_tensor(num_draft, "num_draft", batch, torch.int32, device),
        processors.get("output_counts"),
        processors.get("prompt_mask"),
        processors.get("logit_bias"),
        processors.get("allowed"),
        *(rows[name] for name in _ROW_PARAMETERS),
    )
    return logits


@torch.library.register_fake("specdec_ext::process_logits")
def _process_logits_fake(logits, *operands):
    check_operand_devices("process_logits", (logits, *operands))
