"""Paged KV cache ops: kv_write, kv_compact (typed wrappers and fake kernels).

Pool layout: ``kv_cache [X, num_pages, page_size, H, D]`` contiguous (fp32, bf16 or fp16); X = 2
(K then V) for one layer, or 2 * num_layers for a whole model's pool ``[L, 2, ...]`` viewed as one
tensor. Slot s is (page s // page_size, offset s % page_size). Both ops write in place and never
synchronise with the host; invalid slots and positions are skipped on the device (the wrappers can
validate them on the host). The contract is csrc/kv_cache.h.
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .fake_checks import check_operand_devices


def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    check_slots: bool = False,
) -> torch.Tensor:
    """Scatter the K/V of T new tokens per row into their slots of a layer's page pool (in place).

    ``kv_cache[0].view(-1, H, D)[slot_mapping[b, t]] = key[b, t]`` and likewise for ``value`` into
    ``kv_cache[1]``, for every token whose slot is >= 0 (negative slots are padding: skipped).

    Parameters
    ----------
    key, value : torch.Tensor
        New keys and values, the dtype of ``kv_cache``; any strides (HF's ``[B, H, T, D]`` states
        ``.transpose(1, 2)`` are accepted without a copy).
        Shape: [B, T, H, D]
    slot_mapping : torch.Tensor
        Slot of each token, int64; -1 skips the token. Slots past the pool are skipped as well.
        Shape: [B, T]
    kv_cache : torch.Tensor
        The layer's pool, K then V, written in place.
        Shape: [2, num_pages, page_size, H, D]
    check_slots : bool
        Raise ``ValueError`` when a slot is >= num_pages * page_size (reads the slots on the host).

    Returns
    -------
    torch.Tensor
        ``kv_cache``.
        Shape: [2, num_pages, page_size, H, D]
    """
    if check_slots and kv_cache.dim() == 5 and slot_mapping.numel():
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(f"kv_write: slot_mapping holds slot {top} but the pool has {num_slots} slots")
    torch.ops.specdec_ext.kv_write(key, value, slot_mapping, kv_cache)
    return kv_cache


def kv_compact(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    src_positions: torch.Tensor,
    dst_start: torch.Tensor,
) -> torch.Tensor:
    """Per row, move the K/V at the given logical positions to consecutive positions (in place).

    For each row b and j = 0, 1, ... until the first negative entry of ``src_positions[b]``:
    logical position ``src_positions[b, j]`` is copied to ``dst_start[b] + j`` (through the row's
    block table, in every X slice of the pool), as if the copies ran in order. After a tree
    verification: sources are the accepted path's storage positions (strictly increasing) and
    ``dst_start`` the position right after token 0, so no copy reads a slot an earlier one wrote.
    Positions outside the row's block table (or mapping to a page outside the pool) are skipped.

    Parameters
    ----------
    kv_cache : torch.Tensor
        One layer's pool ``[2, ...]`` or all layers' ``[2 L, ...]``, written in place.
        Shape: [X, num_pages, page_size, H, D]
    block_tables : torch.Tensor
        Page of each row's logical page index, int32 (-1 = none).
        Shape: [B, P]
    src_positions : torch.Tensor
        Logical positions to keep, in order, int64; -1 ends the row.
        Shape: [B, N]
    dst_start : torch.Tensor
        First destination position per row, int64.
        Shape: [B]

    Returns
    -------
    torch.Tensor
        ``kv_cache``.
        Shape: [X, num_pages, page_size, H, D]
    """
    torch.ops.specdec_ext.kv_compact(kv_cache, block_tables, src_positions, dst_start)
    return kv_cache


# Fake kernels: both ops mutate kv_cache in place and return nothing; they repeat the device check (a mixed-device
# call reaches them when one argument is a meta tensor: fake_checks.check_operand_devices).
@torch.library.register_fake("specdec_ext::kv_write")
def _kv_write_fake(key, value, slot_mapping, kv_cache):
    check_operand_devices("kv_write", (key, value, slot_mapping, kv_cache))


@torch.library.register_fake("specdec_ext::kv_compact")
def _kv_compact_fake(kv_cache, block_tables, src_positions, dst_start):
    check_operand_devices("kv_compact", (kv_cache, block_tables, src_positions, dst_start))
