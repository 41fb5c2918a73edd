"""Token trees on the runner side: the visibility and depth of a tree forward's tokens, and what
``commit_tree`` keeps (shared by the paged and lean runners).

Tree layout (csrc/tree.h): ``parents [B, N]`` int32, the index of each node's parent among the row's
nodes or -1 for a child of the root (the last committed token), in topological order
(``-1 <= parents[b, i] < i``). In a runner's tree forward token 0 is the root and token i + 1 is node i.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..ops import build_tree_mask


def token_tree_inputs(parents: torch.Tensor, counts: Sequence[int], tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Visibility and depth over the T tokens of a runner's tree forward (token 0 = the committed
    token, the root; token i + 1 = node i), for the model runners.

    parents [B, T-1] int32 (csrc/tree.h layout); counts [B]: tokens used per row (nodes = count - 1).
    Returns ancestors [B, T, T] bool (token j sees token i: i is j, the root, or an ancestor of j)
    and depth [B, T] int64 (0 for the root, a node's depth otherwise; its position offset).
    """
    B = parents.shape[0]
    device = parents.device
    nodes = torch.tensor([max(c - 1, 0) for c in counts], dtype=torch.int32, device=device)
    node_mask, node_depth = build_tree_mask(parents.to(torch.int32).contiguous(), nodes)
    ancestors = torch.zeros((B, tokens, tokens), dtype=torch.bool, device=device)
    ancestors[:, :, 0] = True
    ancestors[:, 1:, 1:] = node_mask
    depth = torch.zeros((B, tokens), dtype=torch.int64, device=device)
    depth[:, 1:] = node_depth
    return ancestors, depth


def tree_commit_plan(path: torch.Tensor, num_accepted: torch.Tensor, lengths: Sequence[int],
                     tentative: Sequence[int]) -> List[Tuple[List[int], int]]:
    """What a runner's commit_tree keeps, validated: per row (the storage positions of its accepted
    nodes in path order, to be moved to lengths[b] + 1, ...; the row's new length).

    A tree forward wrote token j of row b (token 0 the committed root, token i + 1 node i) at storage
    position lengths[b] + j; the row keeps the root and the nodes path[b, :num_accepted[b]], so node x
    moves from lengths[b] + 1 + x to the next free slot. A row whose forward had no tokens keeps nothing.
    path [B, N] int, num_accepted [B] int (host reads); raises ValueError naming the row.
    """
    acc = [int(x) for x in num_accepted.tolist()]
    B = len(lengths)
    if len(acc) != B or path.dim() != 2 or path.shape[0] != B:
        raise ValueError(f"commit_tree: path [B, N] and num_accepted [B] must have B = {B} rows")
    rows = path.tolist()
    plan = []
    for b in range(B):
        nodes = rows[b][: acc[b]] if acc[b] > 0 else []
        tent = tentative[b]
        if tent == 0:
            if acc[b] != 0:
                raise ValueError(f"commit_tree: row {b} had no tokens but num_accepted[{b}] = {acc[b]}")
            plan.append(([], lengths[b]))
            continue
        if not 0 <= acc[b] <= tent - 1 or any(not 0 <= x < tent - 1 for x in nodes) or \
                any(x >= y for x, y in zip(nodes, nodes[1:])):
            raise ValueError(f"commit_tree: row {b}: path {nodes} is not an increasing list of its "
                             f"{tent - 1} tree nodes")
        plan.append(([lengths[b] + 1 + x for x in nodes], lengths[b] + 1 + acc[b]))
    return plan
