"""What every model runner (paged, lean, recompute) reads off a HF model and checks of its callers.

The runners share one interface (``start`` / ``forward`` / ``commit`` / ``commit_tree`` /
``truncate``); these helpers keep its argument checks and their messages the same everywhere.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

import torch


def output_vocab_size(model) -> int:
    """The size of the model's logits (its output embedding's rows; the config's vocab otherwise)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


# A model's sharding is set when it is loaded: its parameters are scanned once (the scan walks every module,
# 0.3 ms on the bundled target, and a generate() call asked four times)
_SCANNED_TP_SIZES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tensor_parallel_size(model) -> int:
    """Ranks the model's weights are sharded over (HF tensor parallelism: tp_plan / distributed_config),
    1 for a model held whole by this process."""
    size = getattr(model, "tp_size", None) or getattr(model, "_tp_size", None)
    if isinstance(size, int) and size > 1:
        return size
    try:
        return _SCANNED_TP_SIZES[model]
    except (KeyError, TypeError):  # (TypeError: not weakly referenceable)
        pass
    size = _scan_tp_size(model)
    try:
        _SCANNED_TP_SIZES[model] = size
    except TypeError:
        pass
    return size


def _scan_tp_size(model) -> int:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return 1
    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh.size()
    return 1


def text_config(config):
    """The text model's config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_start_prompts(prompts: Sequence[Sequence[int]], max_batch_size: int, max_seq_len: int) -> None:
    """``start``'s checks: at least one prompt, at most max_batch_size, none empty or too long."""
    if not prompts:
        raise ValueError("start: no prompts")
    if len(prompts) > max_batch_size:
        raise ValueError(f"start: {len(prompts)} prompts exceed max_batch_size={max_batch_size}")
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"start: prompt {b} is empty")
        if len(p) > max_seq_len:
            raise ValueError(f"start: prompt {b} has {len(p)} tokens, more than max_seq_len={max_seq_len}")


def check_extend_chunks(chunks: Sequence[Sequence[int]], lengths: Sequence[int], max_seq_len: int) -> None:
    """``extend_rows``'s checks: no empty chunk, none past max_seq_len (``lengths``: each row's length now)."""
    for i, (chunk, length) in enumerate(zip(chunks, lengths)):
        if len(chunk) == 0:
            raise ValueError(f"extend_rows: chunk {i} is empty")
        if length + len(chunk) > max_seq_len:
            raise ValueError(f"extend_rows: chunk {i} would take its row to {length + len(chunk)} tokens, more than "
                             f"max_seq_len={max_seq_len}")


def check_forward_inputs(input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor],
                         tree_parents: Optional[torch.Tensor], batch: int) -> Tuple[int, int, List[int]]:
    """``forward``'s checks; returns (B, T, tokens used per row). ``batch``: rows the runner holds
    (0 before ``start``). input_ids [B, T], num_tokens [B] or None, tree_parents [B, T-1] or None."""
    if batch == 0:
        raise ValueError("forward: call start() first")
    if input_ids.dim() != 2:
        raise ValueError(f"forward: input_ids must be [B, T], got shape {list(input_ids.shape)}")
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("forward: input_ids must hold at least one token per row (T >= 1)")
    if B != batch:
        raise ValueError(f"forward: input_ids has {B} rows, the runner holds {batch}")
    counts = [T] * B if num_tokens is None else [int(x) for x in num_tokens.tolist()]
    for b, c in enumerate(counts):
        if not 0 <= c <= T:
            raise ValueError(f"forward: num_tokens[{b}] = {c} is outside [0, {T}]")
    if tree_parents is not None and tuple(tree_parents.shape) != (B, max(T - 1, 0)):
        raise ValueError(f"forward: tree_parents must be [B, T-1] = [{B}, {T - 1}], got {list(tree_parents.shape)}")
    return B, T, counts


def check_row_counts(op: str, name: str, values: torch.Tensor, upper: Sequence[int], batch: int) -> List[int]:
    """``commit``'s num_kept (each row within its tentative tokens) and ``truncate``'s new_lengths (each
    row within its committed tokens): [B] counts, row b in [0, upper[b]]; one host read, returned as a list."""
    counts = [int(x) for x in values.tolist()]
    if len(counts) != batch:
        raise ValueError(f"{op}: {name} has {len(counts)} rows, the runner holds {batch}")
    for b, n in enumerate(counts):
        if not 0 <= n <= upper[b]:
            raise ValueError(f"{op}: {name}[{b}] = {n} is outside [0, {upper[b]}]")
    return counts
