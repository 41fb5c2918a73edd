"""HeadsDrafter: Medusa-style heads on the target propose a token tree; no draft model.

The heads (specdec_ext/heads.py) read the target's hidden state h at the position whose logits gave
the pending token t+1 (the input of the target's LM head there) and give the log-probabilities of
tokens t+2 .. t+m+1, one distribution per depth that does not depend on the parent. The tree is grown
like a draft model's (drafters/tree_drafter.py ``grow_tree``: top-b per node over d <= m levels, the N
best nodes by cumulative log-probability), so it is the Cartesian product of the heads' top-b lists
pruned to N nodes. The candidates are a deterministic function of the target's past, so
``tree_verify(..., draft_probs=None)`` verifies them losslessly at any temperature.

Where h comes from: a forward pre-hook on the target's LM head keeps its input of the last target pass
made while its generation runs (``runners.head_hooks.HeadCapture``, bound to the thread resuming the loop by
``running()``, which a caller driving the drafter outside generate() must enter around its target passes: other
generations' calls on the same target neither feed it nor call it; registered when the drafter is made, removed
by ``close`` or when the drafter is collected; the lean runner calls a hooked LM head
module on the torch path and its hooks around the kernel's logits on the CPU kernels). After the prefill that is each prompt's last token ([B, 1, H], or [B, H]); after a
verify pass [B, N+1, H] (column 0 at the pending token, column i+1 at node i), and ``commit`` keeps
the column of the last accepted node (0 when none was accepted). The heads
therefore cost one small residual block and one LM-head product per depth per step and no extra target
pass.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional, Sequence

import torch

from ..heads import MedusaHeads, lm_head_of
from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from ..runners.head_hooks import HeadCapture
from .base import Drafter
from .calibration import NodeCalibration
from .model_drafter import active_processing
from .tree_drafter import DraftTree, beam_widths, grow_tree, observe_tree, tree_num_nodes


class HeadsDrafter(Drafter):
    """A token tree from heads on the target; ``slots`` is the number of nodes N' of every tree."""

    is_tree = True

    def __init__(self, target_model, heads: MedusaHeads, *, branch: int, depth: int, budget: int,
                 calibration: Optional[NodeCalibration] = None):
        heads.check_target(target_model)
        if depth > heads.num_heads:
            raise ValueError(f"draft tree depth {depth} exceeds the {heads.num_heads} heads (one head per depth)")
        self.widths = beam_widths(branch, depth, budget)
        self.branch, self.depth = branch, depth
        self.slots = tree_num_nodes(branch, depth, budget)
        self.heads = heads
        self.calibration = calibration  # None: rank by draft log-probability (EAGLE-2)
        self.tree: Optional[DraftTree] = None
        self.lm_head = lm_head_of(target_model)
        self._capture = HeadCapture()  # the LM head's input of the generation's last target pass
        self._hidden: Optional[torch.Tensor] = None  # [B, H]: h at the pending token's logits
        # removed by close() when the decode loop ends, or when the drafter is collected: a stream dropped before
        # its first piece never runs the loop (its hook stayed on the target for good)
        self._unhook = weakref.finalize(self, self.lm_head.register_forward_pre_hook(self._capture).remove)

    def close(self) -> None:
        """Remove the hook from the target's LM head (the decode loop calls this when it ends)."""
        self._unhook()

    @contextlib.contextmanager
    def running(self):
        """(``Drafter.running``) The capture keeps the passes of the thread resuming the loop."""
        self._capture.owner = threading.get_ident()
        try:
            yield
        finally:
            self._capture.owner = None

    # ------------------------------------------------------------------ the interface
    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        captured = self._capture.input  # the prefill scores each prompt's last token only: [B, 1, H] or [B, H]
        if captured is None:
            raise RuntimeError("HeadsDrafter: the target's prefill did not pass through its LM head on this thread")
        self._hidden = (captured[:, -1] if captured.dim() == 3 else captured).clone()  # [B, H]
        B, N, device = meta.batch_size, self.slots, meta.device
        self.token_ids = torch.zeros((B, N), dtype=torch.int64, device=device)  # [B, N]
        self.parents = torch.full((B, N), -1, dtype=torch.int32, device=device)  # [B, N]
        self.num_draft = torch.full((B,), N, dtype=torch.int32, device=device)  # [B]

    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        with torch.no_grad():
            logits = self.heads(self._hidden, self.lm_head).float()  # [B, m, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        processing = active_processing(meta)

        def frontier_logprobs(level, tokens, parents, frontier_index):
            if processing is None:
                return logprobs[:, level:level + 1]  # [B, 1, V]: the same children under every parent
            # processed, each node's children depend on its ancestors: [B, F, V]
            F = 1 if frontier_index is None else frontier_index.shape[1]
            frontier = logits[:, level:level + 1].expand(-1, F, -1)
            return torch.log_softmax(processing.apply_frontier(frontier, tokens, parents, frontier_index,
                                                               meta.temperature), dim=-1)

        self.tree = grow_tree(frontier_logprobs, self.widths, self.branch, self.slots, self.calibration)
        self.token_ids.copy_(self.tree.tokens)
        self.parents.copy_(self.tree.parents)
        return Proposal(self.token_ids, None, self.num_draft, parents=self.parents)

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Keep h at the last accepted node (column path[num_accepted - 1] + 1), or at the pending token;
        the step's outcome updates the node calibration."""
        observe_tree(self.calibration, self.tree, meta, verdict)
        hidden = self._capture.input  # [B, N+1, H] of the verify pass
        accepted = verdict.num_accepted.to(torch.int64).clamp(min=0)  # [B]
        last_node = verdict.path.to(torch.int64).gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]  # [B]
        column = torch.where(accepted > 0, last_node + 1, torch.zeros_like(last_node))  # [B]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        self._hidden = hidden[rows, column.to(hidden.device)].clone()  # [B, H]
