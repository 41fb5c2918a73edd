"""EagleDrafter: EAGLE-3 drafts from the target's own hidden states (eagle/model.py), chains or trees.

State per row (B rows; L[b] the target's committed tokens, the pending token at position L[b] unfed):

    fed[b]      draft positions 0 .. fed[b] - 1 hold the target's own features (the taps of the
                target runner, runners/taps.py) with the next token: position t = (g_t, token t + 1)
    last[b]     the draft layer's output at position fed[b] - 1: it predicts the token after the pending one

Per step:

1. feed   positions fed[b] .. L[b] - 1 in one ragged pass: their tapped states (fc) with the tokens at
          t + 1 (the last of them is the pending token); fed[b] = L[b]; ``last`` = the output at L[b] - 1
2. chain  k times: draft logits = lm_head(norm(out)) over the draft vocabulary, mapped to target ids
          (-inf elsewhere); greedy: argmax; T > 0: q = the loop's filter of them (zero outside the
          draft vocabulary, so verification stays lossless), a Philox draw of (seed, draft offset);
          then the drafted token with ``out`` as its feature at position L[b] + i (tentative slots)
   tree   EAGLE-2's dynamic tree (drafters/tree_drafter.py ``grow_tree``): the frontier's children by
          cumulative draft log-probability, b per node over d levels, the N best kept; each frontier
          node is fed with its parent's output at position L[b] + depth - 1, in slot L[b] + its
          expansion index, seeing the prefix and its ancestors
3. commit nothing to undo: draft slots from fed[b] on are tentative and the next feed overwrites them
          with the target's features of what it accepted (rollback is ``fed``, and the target's taps
          roll back with its cache)

The features come from the target runner built with ``hidden_taps`` = the head's layer ids (the plan
resolves it: ``RunnerCapabilities.hidden_taps``). Adaptive k: ``skip`` needs nothing (the next feed
catches up on every committed token).

Fixed shapes (``fixed_shapes=True``: chains under CUDA graphs): the prompt is fed at ``prefill``
(generate()) or by ``catch_up`` before the first drafting step after rows joined or steps were skipped
(the server, between steps), every feed inside a step is k + 1 positions wide (a step commits at most
k + 1 tokens per row; rows with fewer repeat their last one into tentative slots) and the draft layer
attends over its whole cache under the mask, so a propose reads no host value and has the same shapes
at every step. ``fed`` lives on the device in both modes. Device steps (the server under graphs):
the draft cache is allocated whole, so ``reserve_step`` and ``sync_host`` have nothing to do.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import ops
from ..drafters.base import Drafter
from ..drafters.model_drafter import active_processing, draft_uniforms, sample_draft
from ..drafters.tree_drafter import beam_widths, draw_without_replacement, grow_tree, tree_num_nodes
from ..metadata import Proposal, SpecDecodeMetadata, Verdict
from ..processing import ProcessingState
from ..sampling import filtered_probs
from .checkpoints import check_target
from .kernels import kernel_greedy_chain, kernels_apply
from .model import Eagle3Model, EagleKV

__all__ = ["EagleDrafter"]

CACHE_SLACK = 8  # draft cache slots past the token buffer's and the step's


class EagleDrafter(Drafter):
    """EAGLE-3 chains (``k``) or trees (``tree=(b, d, N)``) over ``target``, a runner with hidden taps."""

    device_steps = True  # chains propose on the device (with fixed_shapes: what a captured step needs)

    def __init__(self, target, head: Eagle3Model, *, k: int = 4, tree=None, fixed_shapes: bool = False):
        if not target.capabilities.hidden_taps:
            raise ValueError("EagleDrafter needs a target runner built with hidden_taps= (the head's layer ids)")
        if tuple(target.hidden_taps) != tuple(head.config.layer_ids or ()):
            raise ValueError(f"the target runner taps layers {tuple(target.hidden_taps)}, the EAGLE head was "
                             f"trained on layers {head.config.layer_ids}")
        check_target(head.config, target.model)  # hidden size, vocabulary, layers: EagleMismatchError
        self.target, self.head, self.model = target, head, head
        self.is_tree = tree is not None
        if fixed_shapes and self.is_tree:
            raise ValueError("EagleDrafter: fixed shapes (CUDA graphs) run chains, not trees")
        self.fixed_shapes = bool(fixed_shapes)
        if self.is_tree:
            self.branch, self.depth, budget = tree
            self.widths = beam_widths(self.branch, self.depth, budget)
            self.slots = tree_num_nodes(self.branch, self.depth, budget)
        else:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"EagleDrafter: k must be an int >= 1, got {k!r}")
            self.slots = k
        self.vocab_size = head.config.vocab_size
        self.cache: Optional[EagleKV] = None
        self.fed: Optional[torch.Tensor] = None  # [B] int64: draft positions holding the target's features
        self.last: Optional[torch.Tensor] = None  # [B, h]
        self.probs: Optional[torch.Tensor] = None
        self._behind = False  # rows joined or steps were skipped since the last feed: catch_up feeds them

    # ------------------------------------------------------------------ lifecycle
    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        self._allocate(meta)
        if self.fixed_shapes:  # the prompt's features now: the steps' feeds are k + 1 wide
            self.feed(meta, width=None)

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        """Continuous batching (chains): rows join. Nothing runs here: the next ``feed`` reads their prompts'
        features from the target runner's taps (written by its start_rows / extend_rows)."""
        if self.is_tree:
            raise ValueError("continuous batching runs EAGLE chains, not trees")
        if self.cache is None or self.fed.shape[0] != meta.token_buffer.shape[0]:
            self._allocate(meta)
        self._reset(rows)
        self._behind = True

    def free_rows(self, rows: Sequence[int]) -> None:
        if self.last is None:  # (no row has joined the head yet: a server's first row ended at its prefill)
            return
        self._reset(rows)

    def _reset(self, rows: Sequence[int]) -> None:
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.last.device)
        self.fed[index] = 0
        self.last[index] = 0.0

    def _allocate(self, meta: SpecDecodeMetadata) -> None:
        """The draft cache, the per-row state and the proposal buffers for the loop's rows (every slot)."""
        B, S = meta.token_buffer.shape
        device = meta.device
        extra = sum(self.widths) if self.is_tree else self.slots
        self.cache = EagleKV(self.head.config, B, S + extra + CACHE_SLACK, device)
        self.fed = torch.zeros((B,), dtype=torch.int64, device=device)
        self.last = torch.zeros((B, self.head.config.hidden_size), dtype=torch.float32, device=device)
        self.token_ids = torch.zeros((B, self.slots), dtype=torch.int64, device=device)  # [B, n]
        self.num_draft = torch.full((B,), self.slots, dtype=torch.int32, device=device)  # [B]
        self.parents = torch.full((B, self.slots), -1, dtype=torch.int32, device=device) if self.is_tree else None
        self.probs = None

    def skip(self, meta: SpecDecodeMetadata) -> None:
        """Adaptive k: nothing to do (the next feed, or ``catch_up`` with fixed shapes, catches up)."""
        self._behind = True

    def catch_up(self, meta: SpecDecodeMetadata) -> None:
        """Fixed shapes, between steps: feed every committed position not yet fed (rows that joined, steps
        that were skipped), so that a captured propose's k + 1-wide feed covers the next step's."""
        if self._behind and self.fixed_shapes:
            self.feed(meta, None)
        self._behind = False

    def reserve_step(self, width: int, drafts: int) -> None:
        """Device steps: nothing to reserve (the draft cache is allocated whole; the taps are the target's)."""

    def sync_host(self) -> None:
        """Device steps: no host state to bring back."""

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        """Nothing to roll back (module docstring): slots past ``fed`` are tentative."""

    def checkpoint(self):
        """Undo for the cost probes: ``fed`` and ``last`` as they are now (restored in place: a captured
        step reads these tensors)."""
        if self.fed is None:
            return None
        fed, last = self.fed.clone(), self.last.clone()

        def undo() -> None:
            self.fed.copy_(fed)
            self.last.copy_(last)

        return undo

    # ------------------------------------------------------------------ feeding the target's features
    def feed(self, meta: SpecDecodeMetadata, width: Optional[int] = None) -> None:
        """Draft positions fed[b] .. L[b] - 1 from the target's tapped states (step 1 of the docstring),
        ``width`` positions per row (None: as many as the row furthest behind needs, one host read, in
        passes that fit every row's cache: a pass writes its width at every row's fed, and a long prompt
        joining beside a row near the end of its cache would not fit in one)."""
        B = meta.batch_size  # (a continuous batch's view: its rows 0 .. width - 1)
        rows = torch.arange(B, device=meta.device)
        while True:
            block = self._feed_block(meta, width)
            if block is None:
                return
            tokens, g, taken, _ = block
            with torch.no_grad():
                out = self.head.block(tokens, g, self.fed[:B], self.cache, span=self._span)  # [B, W, h]
            self.last[:B] = torch.where((taken > 0)[:, None], out[rows, (taken - 1).clamp(min=0)], self.last[:B])
            self.fed[:B] += taken
            if width is not None:
                return

    def _feed_block(self, meta: SpecDecodeMetadata, width: Optional[int]):
        """One feed pass's inputs: (tokens [B, W], features g = fc(tapped states) [B, W, h], taken [B] the
        positions it feeds per row, done: whether it feeds every position left), or None when there is
        nothing to feed. ``width``: as ``feed``'s."""
        B, device = meta.batch_size, meta.device
        lengths = torch.zeros((B,), dtype=torch.int64, device=device)
        held = self.target.lengths[:B]
        lengths[: held.shape[0]] = held.to(device)  # [B] (rows the runner does not hold: 0)
        fed = self.fed[:B]  # [B]
        count = (lengths - fed).clamp(min=0)  # [B]
        if width is None:  # one host read: the furthest behind, and the room left past the furthest fed
            behind, furthest = torch.stack([count.max(), fed.max()]).tolist()
            W = min(behind, self.cache.capacity - furthest)
        else:
            W = behind = width
        if W <= 0:
            return None
        slots = fed[:, None] + torch.arange(W, device=device)  # [B, W] (past a row's count: padding)
        real = slots.clamp(max=(lengths - 1).clamp(min=0)[:, None])  # [B, W] positions read
        states = self.target.tapped_states(real)  # [B, W, n * H_t]
        tokens = torch.gather(meta.token_buffer[:B], 1, real + 1)  # the token at t + 1
        with torch.no_grad():
            g = self.head.fuse(states)  # [B, W, h]
        return tokens, g, count.clamp(max=W), W >= behind

    @property
    def _span(self) -> Optional[int]:
        """Draft cache slots a chain pass attends over: all of them with fixed shapes, else as far as it reaches."""
        return self.cache.capacity if self.fixed_shapes else None

    # ------------------------------------------------------------------ chains
    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        processing = active_processing(meta)
        fused = (meta.all_greedy and not self.is_tree and not self.fixed_shapes and kernels_apply(self.head)
                 and (budget is None or max(budget, default=0) >= 1) and processing is None)
        block = self._feed_block(meta, None) if fused else None
        if block is not None and not block[3]:  # the feed needs more than one pass (cache room): feed first
            self.feed(meta)
            block = None
        if not fused:
            self.feed(meta, self.slots + 1 if self.fixed_shapes else None)
        self._behind = False
        if self.is_tree:
            return self._propose_tree(meta)
        k, B, greedy = self.slots, meta.batch_size, meta.all_greedy
        steps = k if budget is None else min(k, max(budget, default=0))
        if budget is None:
            self.num_draft[:B].fill_(k)
        elif len(set(budget)) == 1:  # one length for every row: no host data (what a capture can hold)
            self.num_draft[:B].fill_(min(k, budget[0]))
        else:
            self.num_draft[:B].copy_(torch.tensor([min(k, b) for b in budget], dtype=torch.int32))
        if not greedy and self.probs is None:  # every slot's row: a continuous batch's view widens later
            self.probs = torch.zeros((self.token_ids.shape[0], k, self.vocab_size), dtype=torch.float32,
                                     device=meta.device)
        uniforms = None if greedy else draft_uniforms(meta, k)  # [k, B, 1]
        fed = self.fed[:B]
        out = self.last[:B]
        with torch.no_grad():
            if fused:  # the feed's pass and the chain in one call (eagle/kernels.py kernel_greedy_chain)
                kernel_greedy_chain(self.head, self.token_ids[:B], steps, out, fed, self.cache,
                                    feed=None if block is None else block[:3])
                if block is not None:
                    self.fed[:B] += block[2]
            elif greedy and steps >= 1 and processing is None:
                self.head.greedy_chain(self.token_ids[:B], steps, out, fed, self.cache, span=self._span)
            counts = processing.draft_counts() if processing is not None else None
            for i in range(0 if greedy and processing is None else steps):
                logits = self.head.to_target_logits(self.head.head(out))  # [B, V]: q is 0 off the draft vocabulary
                if processing is not None:  # the head proposes from its processed q', as the target verifies p'
                    logits = processing.apply_draft_step(logits, self.token_ids[:B, :i], meta.temperature, counts)
                if greedy:
                    token = logits.argmax(-1)  # [B]
                else:
                    token = sample_draft(logits, meta, uniforms[i], self.probs[:B, i])
                self.token_ids[:B, i].copy_(token)
                ProcessingState.add_drafted(counts, token)
                if i + 1 < steps:  # the drafted token with the layer's own output, at slot fed + i
                    out = self.head.block(token[:, None], out[:, None], fed + i, self.cache, span=self._span)[:, 0]
        probs = None if greedy else self.probs[:B]
        return Proposal(self.token_ids[:B], probs, self.num_draft[:B], longest=None if budget is None else steps)

    # ------------------------------------------------------------------ trees
    def _propose_tree(self, meta: SpecDecodeMetadata) -> Proposal:
        B, device = meta.batch_size, meta.device
        fed = self.fed[:B]
        node_out = torch.zeros((B, sum(self.widths), self.head.config.hidden_size), device=device)
        processing = active_processing(meta)

        def frontier_logprobs(level, tokens, parents, frontier_index):
            with torch.no_grad():
                if level == 0:
                    out = self.last[:B, None]  # [B, 1, h]
                else:
                    out = self._feed_frontier(level, tokens, parents, frontier_index, fed, node_out)
                logits = self.head.to_target_logits(self.head.head(out))  # [B, F, V]
                if processing is not None:  # each node's children from its processed q', as the target verifies p'
                    logits = processing.apply_frontier(logits, tokens, parents, frontier_index, meta.temperature)
                return torch.log_softmax(logits, dim=-1)  # [B, F, V]

        sample_children = None if meta.all_greedy else self._sampler(meta)
        tree = grow_tree(frontier_logprobs, self.widths, self.branch, self.slots, None, sample_children)
        self.token_ids.copy_(tree.tokens)
        self.parents.copy_(tree.parents)
        self.num_draft.fill_(self.slots)
        return Proposal(self.token_ids, tree.probs, self.num_draft, parents=self.parents)

    def _feed_frontier(self, level: int, tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor,
                       fed: torch.Tensor, node_out: torch.Tensor) -> torch.Tensor:
        """Feed the frontier nodes [B, F] (expansion indices) with their parents' outputs: rotary position
        fed + level - 1, slot fed + index, seeing the prefix and their ancestors. Returns their outputs [B, F, h]."""
        B, F = frontier.shape
        device = tokens.device
        parent = parents.gather(1, frontier)  # [B, F], -1 = the root
        g = torch.where((parent < 0)[:, :, None], self.last[:B, None].expand(B, F, -1),
                        node_out.gather(1, parent.clamp(min=0)[:, :, None].expand(-1, -1, node_out.shape[-1])))
        slots = fed[:, None] + frontier  # [B, F]
        S = int(slots.max()) + 1
        visible = (torch.arange(S, device=device)[None, None, :] < fed[:, None, None]).expand(B, F, S).clone()
        node, rows = frontier, torch.arange(B, device=device)[:, None].expand(B, F)
        for _ in range(level):  # the node and its ancestors
            on = node >= 0
            visible[rows[on], torch.arange(F, device=device).expand(B, F)[on], (fed[:, None] + node)[on]] = True
            node = torch.where(on, parents.gather(1, node.clamp(min=0)), node)
        positions = (fed + level - 1)[:, None].expand(B, F)
        out = self.head.step(tokens.gather(1, frontier), g, positions, self.cache, slots, visible)
        node_out.scatter_(1, frontier[:, :, None].expand(-1, -1, out.shape[-1]), out)
        return out

    def _sampler(self, meta: SpecDecodeMetadata):
        """Children drawn without replacement from the filtered q (T > 0), Philox (seed, draft offset)
        columns per level as TreeModelDrafter draws them."""
        b, sampling = self.branch, meta.sampling
        frontier = [1] + self.widths[:-1]
        uniforms = ops.philox_uniforms(meta.seed, meta.draft_offset, b * sum(frontier))
        starts = [b * sum(frontier[:level]) for level in range(len(frontier))]

        def sample_children(level, logprobs):
            B, F, _ = logprobs.shape
            u = uniforms[:, starts[level]:starts[level] + F * b].reshape(B, F, b)
            q = filtered_probs(logprobs, sampling)
            fallback = torch.softmax(logprobs / sampling.temperature, dim=-1)
            return draw_without_replacement(q, fallback, u)

        return sample_children
