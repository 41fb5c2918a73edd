"""Tree ops: build_tree_mask, tree_verify (typed wrappers and fake kernels).

The tree layout (csrc/tree.h): ``parents [B, N]`` int32 holds the index of each node's parent among
the row's nodes, or -1 for a child of the root (the last committed token); nodes are in topological
order (``-1 <= parents[b, i] < i``); a row uses its first ``num_nodes[b]`` nodes and ignores the rest.
Depth is 1 for a child of the root. Outputs that hold a path have D = N slots (static shapes).

Each wrapper allocates the outputs (or takes them through ``out=``) and, unless ``check_status`` is
False, turns the per-row status codes into ``ValueError`` naming the argument (one host read).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from typing_extensions import Unpack

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .fake_checks import check_operand_devices
from .sampling import (RowParam, SamplingKeywords, raise_if_a_row_failed, row_tensor,
                       sampling_op_args, with_sampling_parameters_doc)


def build_tree_mask(
    parents: torch.Tensor,
    num_nodes: RowParam = None,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    check_status: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask and depths of a token tree per row.

    ``mask[b, i, j]`` is True when node j is node i or one of its ancestors (the root, the committed
    token, is not a node). Unused slots (``i >= num_nodes[b]``) see only themselves and have depth 0,
    so no attention row is empty. For an invalid row (a parent index not in [-1, i), or num_nodes
    outside [0, N]) the mask is all False and every depth entry holds the negative status code.
    The runners turn it into the attention visibility and positions of a tree forward
    (specdec_ext/runners/trees.py, layout.py).

    Parameters
    ----------
    parents : torch.Tensor
        Parent index of each node, -1 for a child of the root, int32, topological order.
        Shape: [B, N]
    num_nodes : int or torch.Tensor, optional
        Nodes used per row, int32, each in [0, N]; default N.
        Shape: [B]
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated (mask, depth).
    check_status : bool
        Raise ``ValueError`` for invalid rows (reads ``depth[:, 0]`` on the host).

    Returns
    -------
    mask : torch.Tensor
        Node i attends to node j, bool.
        Shape: [B, N, N]
    depth : torch.Tensor
        Depth of each node (1 for a child of the root, 0 for an unused slot), int32.
        Shape: [B, N]
    """
    if parents.dim() != 2:
        raise ValueError(f"build_tree_mask: parents must be a 2-D tensor [B, N], got shape {list(parents.shape)}")
    batch, nodes = parents.shape
    device = parents.device
    if out is None:
        mask = torch.empty((batch, nodes, nodes), dtype=torch.bool, device=device)
        depth = torch.empty((batch, nodes), dtype=torch.int32, device=device)
    else:
        mask, depth = out
    counts = row_tensor(num_nodes, "num_nodes", batch, torch.int32, device)
    torch.ops.specdec_ext.build_tree_mask(parents, counts, mask, depth)
    if check_status:
        if nodes > 0:
            raise_if_a_row_failed("build_tree_mask", depth[:, 0])
        elif counts is not None and bool((counts != 0).any()):
            raise_if_a_row_failed("build_tree_mask", torch.where(counts != 0, -10, 0))
    return mask, depth


@with_sampling_parameters_doc(
    "N", "column i < num_nodes[b] decides node i, column num_nodes[b] samples the recovered or bonus token "
    "by inverse CDF: a row's draws do not depend on the buffer's width N.")
def tree_verify(
    target_logits: torch.Tensor,
    tree_token_ids: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    *,
    num_nodes: RowParam = None,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    check_status: bool = True,
    **sampling: Unpack[SamplingKeywords],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a token tree per row, losslessly; returns the accepted root-to-node path.

    Starting at the root, the children of the current node are tried in index order against the
    target distribution p at the current node (softmax(logits / T) filtered by top-k then top-p):

    - with ``draft_probs`` (children drawn i.i.d. from the draft distribution q stored on them,
      SpecInfer's multi-step speculative sampling): accept child x with probability
      min(1, p(x) / q(x)); on rejection p <- normalise(max(0, p - q)) and the next child is tried;
    - without (deterministic candidates, e.g. the top-b of a drafter): accept x with probability
      p(x); on rejection x is removed from p (renormalised) and the next child is tried.

    An accepted child becomes the current node; when every child is rejected (the recovered token)
    or the current node is a leaf (the bonus token) one token is drawn from the current p. Greedy
    rows (T below ``GREEDY_TEMPERATURE``) follow the first child equal to argmax p and emit argmax p.
    The emitted tokens are distributed exactly as sampling from the filtered target. A chain tree
    (parents = [-1, 0, 1, ...]) gives exactly :func:`chain_verify`'s result with the same draws.

    Parameters
    ----------
    target_logits : torch.Tensor
        Target logits, fp32, bf16 or fp16: row 0 at the committed token (scores the children of the
        root), row i + 1 at node i (scores node i's children).
        Shape: [B, N+1, V]
    tree_token_ids : torch.Tensor
        The token of each node, int64, in [0, V) for the used nodes.
        Shape: [B, N]
    parents : torch.Tensor
        Parent index of each node, -1 for a child of the root, int32, topological order; a 1-D
        tensor is one tree shared by every row (expanded to [B, N], a copy).
        Shape: [B, N] or [N]
    draft_probs : torch.Tensor, optional
        Row i is the draft distribution node i was sampled from (shared by siblings), fp32. None for
        deterministic candidates. Checked where the walk reads it, as chain_verify's: q(x) at each child
        tried, a whole row only where a rejection resamples from it.
        Shape: [B, N, V]
    num_nodes : int or torch.Tensor, optional
        Nodes used per row, int32, each in [0, N]; default N.
        Shape: [B]
    {sampling_parameters}
    out : (torch.Tensor, torch.Tensor, torch.Tensor), optional
        Preallocated (path, tokens, num_accepted).
    check_status : bool
        Raise ``ValueError`` for rows with invalid input (reads ``num_accepted`` on the host).

    Returns
    -------
    path : torch.Tensor
        Accepted node indices from depth 1 down, then -1, int32 (D = N slots).
        Shape: [B, N]
    tokens : torch.Tensor
        Tokens of the accepted nodes, then the recovered or bonus token, then -1, int64.
        Shape: [B, N+1]
    num_accepted : torch.Tensor
        Accepted depth per row, int32 (the row emits num_accepted + 1 tokens); a negative status
        code for an invalid row when ``check_status`` is False.
        Shape: [B]
    """
    if target_logits.dim() != 3:
        raise ValueError(
            f"tree_verify: target_logits must be a 3-D tensor [B, N+1, V], got shape {list(target_logits.shape)}")
    batch, positions = target_logits.shape[0], target_logits.shape[1]
    nodes = max(positions - 1, 0)
    device = target_logits.device
    if parents.dim() == 1:
        parents = parents.expand(batch, -1).contiguous()
    if out is None:
        path = torch.empty((batch, nodes), dtype=torch.int32, device=device)
        tokens = torch.empty((batch, nodes + 1), dtype=torch.int64, device=device)
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    else:
        path, tokens, num_accepted = out
    torch.ops.specdec_ext.tree_verify(
        target_logits,
        tree_token_ids,
        parents,
        draft_probs,
        row_tensor(num_nodes, "num_nodes", batch, torch.int32, device),
        *sampling_op_args("tree_verify", batch, device, sampling),
        path,
        tokens,
        num_accepted,
    )
    if check_status:
        raise_if_a_row_failed("tree_verify", num_accepted)
    return path, tokens, num_accepted


# Fake kernels: both ops mutate their outputs in place and return nothing; the fakes repeat the
# device check (fake_checks.check_operand_devices).
@torch.library.register_fake("specdec_ext::build_tree_mask")
def _build_tree_mask_fake(parents, *operands):
    check_operand_devices("build_tree_mask", (parents, *operands))


@torch.library.register_fake("specdec_ext::tree_verify")
def _tree_verify_fake(target_logits, *operands):
    check_operand_devices("tree_verify", (target_logits, *operands))
