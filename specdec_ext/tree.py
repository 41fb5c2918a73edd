"""Token trees for a Hugging Face target: tree builders, the 4D attention mask and position ids of a
tree forward, and a bit-packed ancestor mask.

Tree layout (csrc/tree.h): ``parents [B, N]`` int32, the index of each node's parent among the row's
nodes or -1 for a child of the root (the last committed token), in topological order
(``-1 <= parents[b, i] < i``); row b uses its first ``num_nodes[b]`` nodes. Depth is 1 for a child
of the root.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from .ops import build_tree_mask

__all__ = ["chain_parents", "full_tree_parents", "tree_attention_inputs", "trim_verify_outputs",
           "pack_tree_mask", "unpack_tree_mask"]


def chain_parents(k: int, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Parents of a chain of k nodes: [-1, 0, 1, ..., k-2].

    Returns
    -------
    torch.Tensor
        int32. Shape: [k]
    """
    return torch.arange(-1, k - 1, dtype=torch.int32, device=device)


def full_tree_parents(widths: Sequence[int], device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Parents of a full tree where every node at depth d has ``widths[d]`` children (the root is at
    depth 0), nodes numbered level by level (breadth first), children of a node consecutive.

    ``full_tree_parents([2, 2])`` is ``[-1, -1, 0, 0, 1, 1]``; ``widths = [1] * k`` is a chain.

    Returns
    -------
    torch.Tensor
        int32, N = w0 + w0*w1 + ... nodes. Shape: [N]
    """
    parents = []
    level = [-1]
    for width in widths:
        if width < 0:
            raise ValueError(f"full_tree_parents: widths must be >= 0, got {list(widths)}")
        next_level = []
        for node in level:
            for _ in range(width):
                next_level.append(len(parents))
                parents.append(node)
        level = next_level
    return torch.tensor(parents, dtype=torch.int32, device=device)


def tree_attention_inputs(
    parents: torch.Tensor,
    prefix_lengths: torch.Tensor,
    num_nodes=None,
    *,
    past_length: Optional[int] = None,
    with_root: bool = False,
    dtype: torch.dtype = torch.float32,
    as_bool: bool = False,
    mask_and_depth: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 4D attention mask and position ids of one target forward over a token tree.

    Key layout: ``past_length`` cache slots, row b's prefix in the first ``prefix_lengths[b]`` of
    them (the rest are padding, hidden), followed by the Q new tokens of this forward. Every new
    token sees the whole prefix; a node sees itself and its ancestors.

    - ``with_root=False`` (Q = N): the committed token is the last prefix token (already in the
      cache); node positions are ``prefix_lengths + depth - 1``.
    - ``with_root=True`` (Q = N + 1): the committed token is fed first (query 0, position
      ``prefix_lengths``, seen by every node); node i is query i + 1 at ``prefix_lengths + depth``.
      Its logits are then exactly tree_verify's target_logits [B, N+1, V].

    Unused slots (``i >= num_nodes[b]``) see the prefix and themselves and sit at the position of a
    depth-1 node; their outputs are ignored.

    Parameters
    ----------
    parents : torch.Tensor
        Parent index of each node, -1 for a child of the root, int32.
        Shape: [B, N]
    prefix_lengths : torch.Tensor
        Tokens of each row already in the cache, integer.
        Shape: [B]
    num_nodes : int or torch.Tensor, optional
        Nodes used per row, int32; default N.
        Shape: [B]
    past_length : int, optional
        Cache slots before the new tokens; default ``max(prefix_lengths)`` (one host read).
    with_root : bool
        Whether the committed token is the first new token of this forward (see above).
    dtype : torch.dtype
        dtype of the additive mask (the model's dtype): 0 where visible, ``finfo(dtype).min`` elsewhere.
    as_bool : bool
        Return a bool mask (True = visible) instead. Not every HF attention path handles a bool 4D
        mask correctly (the eager path does not): prefer the additive form for HF models.
    mask_and_depth : (torch.Tensor, torch.Tensor), optional
        The output of :func:`specdec_ext.ops.build_tree_mask` for ``parents``, if already computed.

    Returns
    -------
    attention_mask : torch.Tensor
        Additive float mask (or bool with ``as_bool``).
        Shape: [B, 1, Q, past_length + Q]
    position_ids : torch.Tensor
        Position of each new token, int64.
        Shape: [B, Q]
    """
    if mask_and_depth is None:
        mask_and_depth = build_tree_mask(parents, num_nodes)
    tree_mask, depth = mask_and_depth
    batch, nodes = depth.shape
    device = depth.device
    prefix = prefix_lengths.to(device=device, dtype=torch.int64)
    if past_length is None:
        past_length = int(prefix.max()) if batch > 0 else 0
    queries = nodes + 1 if with_root else nodes
    visible = torch.zeros((batch, queries, past_length + queries), dtype=torch.bool, device=device)
    slots = torch.arange(past_length, device=device)
    visible[:, :, :past_length] = (slots[None, :] < prefix[:, None])[:, None, :]
    node_depth = depth.to(torch.int64).clamp(min=1)  # unused slots: a depth-1 position
    if with_root:
        visible[:, :, past_length] = True  # the committed token: query 0, seen by every node
        visible[:, 1:, past_length + 1:] = tree_mask
        positions = torch.cat([prefix[:, None], prefix[:, None] + node_depth], dim=1)
    else:
        visible[:, :, past_length:] = tree_mask
        positions = prefix[:, None] + node_depth - 1
    visible = visible[:, None]
    if as_bool:
        return visible, positions
    attention_mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    attention_mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return attention_mask, positions


def trim_verify_outputs(path: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor):
    """Drop the trailing all-empty columns of tree_verify's outputs (they have D = N slots so that the
    op keeps static shapes): path [B, d], tokens [B, d + 1] with d = max(num_accepted, 0) over rows.
    Reads num_accepted on the host; views, no copy.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        path, int32. Shape: [B, d]; tokens, int64. Shape: [B, d+1]
    """
    d = int(num_accepted.max().clamp(min=0)) if num_accepted.numel() else 0
    return path[:, :d], tokens[:, :d + 1]


_BITS = 64


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack an ancestor mask: bit (j % 64) of word j // 64 of ``packed[b, i]`` is ``mask[b, i, j]``.

    Parameters
    ----------
    mask : torch.Tensor
        bool.
        Shape: [B, N, N]

    Returns
    -------
    torch.Tensor
        int64 words (bit 63 is the sign bit). Shape: [B, N, ceil(N / 64)]
    """
    batch, rows, nodes = mask.shape
    words = (nodes + _BITS - 1) // _BITS
    padded = torch.zeros((batch, rows, words * _BITS), dtype=torch.int64, device=mask.device)
    padded[:, :, :nodes] = mask.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(_BITS, dtype=torch.int64, device=mask.device),
                                       torch.arange(_BITS, device=mask.device))
    return (padded.view(batch, rows, words, _BITS) * weights).sum(-1)


def unpack_tree_mask(packed: torch.Tensor, nodes: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: int64 [B, N, ceil(N/64)] -> bool [B, N, nodes]."""
    shifts = torch.arange(_BITS, device=packed.device)
    bits = torch.bitwise_and(torch.bitwise_right_shift(packed[..., None], shifts), 1)
    return bits.flatten(-2)[..., :nodes].bool()
