"""Where the tokens of one forward go and what they see: the one builder of positions, cache positions
and attention visibility, shared by every runner.

A forward appends T columns per row after the row's ``L[b]`` committed tokens. Row b uses the columns
``first[b] .. first[b] + n[b] - 1`` (token j = column first[b] + j); the other columns are padding.

    storage    token j is written at cache position L[b] + j
    position   its rotary position: L[b] + j (chain), or L[b] + depth[b, j] (tree: token 0 is the
               root at depth 0, a node sits one position below its parent)
    visible    it sees the prefix (cache positions < L[b]) and, of the new tokens, itself and the earlier
               ones (chain) or itself, the root and its ancestors (tree)
    window     a sliding-window layer of w positions sees only the visible keys whose position is within
               w of its own (``window_visible``): a tree node's window counts along its path, since
               its ancestors sit at their depths' positions

A padding column is not stored (``valid`` False) and sees cache position 0 only, so that no attention
row is empty (an all-masked row would make the softmax NaN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class StepLayout:
    """The layout of one forward (every tensor on the model's device)."""

    valid: torch.Tensor  # [B, T] bool: a real token, not padding
    storage: torch.Tensor  # [B, T] int64: cache position of the token (padding: a harmless in-row value)
    positions: torch.Tensor  # [B, T] int64: rotary position ids
    visible: torch.Tensor  # [B, T, S] bool: query column -> cache position it attends to
    key_positions: torch.Tensor  # [B, S] int64: the position of the token in each cache slot

    def window_visible(self, window: int) -> torch.Tensor:
        """``visible`` restricted to keys within ``window`` positions of the query (padding columns keep
        their one key). Shape: [B, T, S] bool."""
        near = self.positions.unsqueeze(2) - self.key_positions.unsqueeze(1) < window  # [B, T, S]
        return self.visible & (near | ~self.valid.unsqueeze(2))


def step_layout(lengths: torch.Tensor, num_tokens: torch.Tensor, columns: int, cache_positions: int,
                arange: torch.Tensor, first: Optional[torch.Tensor] = None,
                tree: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> StepLayout:
    """The layout of a forward over ``columns`` (T) columns against ``cache_positions`` (S) positions.

    lengths [B] int64 (committed tokens), num_tokens [B] int64 (n), first [B] int64 (default 0), tree:
    (ancestors [B, T, T] bool, depth [B, T] int64) from ``trees.token_tree_inputs`` or None for a chain;
    ``arange`` is a preallocated arange of at least max(T, S) on the device. No host reads.
    """
    B, T, S = lengths.shape[0], columns, cache_positions
    if tree is not None and first is not None:
        raise ValueError("step_layout: a tree forward starts at column 0 (first must be None)")
    j = arange[:T].unsqueeze(0).expand(B, T)  # [B, T] token index of each column
    if first is not None:
        j = j - first.unsqueeze(1)
    valid = (j >= 0) & (j < num_tokens.unsqueeze(1))  # [B, T]
    j = j.clamp(0, max(T - 1, 0))
    storage = lengths.unsqueeze(1) + j  # [B, T]
    rel = arange[:S].view(1, 1, S) - lengths.view(B, 1, 1)  # [B, 1, S]: new-token index of a cache position
    in_new = (rel >= 0) & (rel < num_tokens.view(B, 1, 1))
    slots = arange[:S].view(1, S).expand(B, S)  # [B, S]
    if tree is None:
        positions = storage
        sees_new = in_new & (rel <= j.unsqueeze(2))
        key_positions = slots
    else:  # a tree forward starts at column 0 (first is None): the column is the token index
        ancestors, depth = tree
        positions = lengths.unsqueeze(1) + depth
        sees_new = in_new & ancestors.gather(2, rel.clamp(0, T - 1).expand(B, T, S))
        new_token = rel[:, 0].clamp(0, T - 1)  # [B, S]
        key_positions = torch.where(rel[:, 0] >= 0, lengths.unsqueeze(1) + depth.gather(1, new_token), slots)
    visible = (rel < 0) | sees_new
    visible = torch.where(valid.unsqueeze(2), visible, arange[:S].view(1, 1, S) == 0)
    return StepLayout(valid, storage, positions, visible, key_positions)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible [B, T, S] bool -> the additive attention mask [B, 1, T, S] in ``dtype`` (0 where visible,
    the dtype's lowest value elsewhere: finite, so HF attention paths that add it stay finite)."""
    mask = torch.zeros((visible.shape[0], 1) + tuple(visible.shape[1:]), dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(dtype).min)
