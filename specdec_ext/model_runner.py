"""PagedModelRunner: a HF causal LM over a PagedKVCache with ragged rows (the decode loop's model API).

Row b's committed tokens sit at positions 0 .. lengths[b]-1 of its pages. A ``forward`` writes the
K/V of its (up to T) tokens TENTATIVELY at storage positions lengths[b] + t; ``commit`` (chain) keeps
a prefix of them, ``commit_tree`` moves the accepted path next to token 0 with ``ops.kv_compact``;
anything not kept is rolled back by metadata only (lengths, freed pages). A forward without a commit
in between overwrites the previous tentative tokens.

Host/device: the lengths and the page allocator live on the host (the source of truth) and are
mirrored to device tensors. ``forward`` reads ``num_tokens`` (and, for trees, validates the parents)
on the host; ``commit`` / ``commit_tree`` / ``truncate`` read their arguments on the host. On the CPU
this costs nothing; on CUDA the decode loop reads the accept counts on the host anyway.

The model is switched to the ``"specdec_paged"`` attention implementation (which behaves as HF's
sdpa outside a paged forward).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import hf_paged
from .hf_paged import PagedCache, PagedStep
from .kv_cache import PagedKVCache, PoolFullError
from .runner_checks import check_forward_inputs, check_start_prompts, output_vocab_size, text_config
from .tree import token_tree_inputs, tree_commit_plan

__all__ = ["PagedModelRunner", "PoolFullError"]


class PagedModelRunner:
    """Runs a HF causal LM over a PagedKVCache with ragged rows."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, page_size: int = 16,
                 num_pages: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.model = model
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = text_config(model.config)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.vocab_size: int = output_vocab_size(model)   # logits last dim
        pages_per_row = -(-max_seq_len // page_size)
        if num_pages is None:
            num_pages = max_batch_size * pages_per_row
        self.kv = PagedKVCache(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                               num_pages=num_pages, page_size=page_size, max_batch=max_batch_size,
                               max_pages_per_row=pages_per_row, dtype=self.dtype, device=self.device)
        self.cache = PagedCache(self.kv)
        hf_paged.register()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(hf_paged.ATTN_IMPLEMENTATION)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self._cache_arg = hf_paged.cache_argument_name(model)
        # When True every forward gathers all max_pages_per_row pages per row, so the attention
        # shapes depend only on (B, T) (what CUDA-graph capture needs); False gathers only the pages
        # the longest row uses (less work on the CPU). Results are identical.
        self.static_kv: bool = False
        self._batch = 0
        self._tentative: List[int] = []          # tokens written by the last forward, per row
        self._tree = False                       # whether the last forward was a tree
        # Preallocated index vectors (sliced per step): positions within a step and within the pages.
        self._arange = torch.arange(max(max_seq_len, pages_per_row * page_size) + 1, device=self.device)

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row, int64 on the model's device. Shape: [B]."""
        return self.kv.lengths[: self._batch]

    def _host_lengths(self) -> List[int]:
        return self.kv.host_lengths()[: self._batch]

    # ------------------------------------------------------------------ core step
    def _run(self, input_ids: torch.Tensor, first_col: List[int], counts: List[int],
             ancestors: Optional[torch.Tensor], depth: Optional[torch.Tensor], logits_to_keep: int):
        """One forward. input_ids [B, T]; row b's token j (0 <= j < counts[b]) is column
        first_col[b] + j; ancestors [B, T, T] bool (token j sees token i) or None for a chain;
        depth [B, T] int64 (position offset of token j) or None for a chain (offset j)."""
        B, T = input_ids.shape
        lengths = self._host_lengths()
        for b in range(B):
            if lengths[b] + counts[b] > self.max_seq_len:
                raise ValueError(f"row {b} would hold {lengths[b] + counts[b]} tokens, more than "
                                 f"max_seq_len={self.max_seq_len}")
        self.kv.reserve([(b, lengths[b] + counts[b]) for b in range(B)])  # PoolFullError names the row
        dev, PS = self.device, self.page_size
        if self.static_kv:
            used_pages = self.kv.max_pages_per_row
        else:
            used_pages = max(1, -(-max(l + n for l, n in zip(lengths, counts)) // PS))
        S = used_pages * PS
        L = self.kv.lengths[:B]                                          # [B] int64
        first = torch.tensor(first_col, dtype=torch.int64, device=dev)   # [B]
        n = torch.tensor(counts, dtype=torch.int64, device=dev)          # [B]
        j = self._arange[:T].unsqueeze(0) - first.unsqueeze(1)           # [B, T] token index per column
        valid = (j >= 0) & (j < n.unsqueeze(1))                          # [B, T] real (non-padding) tokens
        j = j.clamp(0, max(T - 1, 0))
        pos = L.unsqueeze(1) + j                                         # [B, T] storage position
        tables = self.kv.block_tables[:B]                                # [B, P_max] int32
        page = tables.gather(1, (pos // PS).clamp(max=tables.shape[1] - 1)).long()
        slot_mapping = torch.where(valid, page * PS + pos % PS, -1)      # [B, T] int64
        gather_pages = tables[:, :used_pages].clamp(min=0).long()        # [B, P] int64
        # Visibility [B, T, S]: the prefix, then the row's own tentative tokens j' with j' <= j
        # (chain) or j' an ancestor-or-self of j (tree). Padding queries see slot 0 only.
        s = self._arange[:S].view(1, 1, S)
        rel = s - L.view(B, 1, 1)                                        # [B, 1, S] tentative index
        in_new = (rel >= 0) & (rel < n.view(B, 1, 1))
        if ancestors is None:
            sees_new = in_new & (rel <= j.unsqueeze(2))
        else:
            idx = rel.clamp(0, T - 1).expand(B, T, S)
            sees_new = in_new & ancestors.gather(2, idx)
        visible = (s < L.view(B, 1, 1)) | sees_new
        visible = torch.where(valid.unsqueeze(2), visible, s == 0)
        mask = torch.zeros((B, 1, T, S), dtype=self.dtype, device=dev)
        mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(self.dtype).min)
        position_ids = pos if depth is None else L.unsqueeze(1) + depth.gather(1, j)
        ids = torch.where(valid, input_ids, 0)
        self.cache.activate(PagedStep(slot_mapping, gather_pages, mask))
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                                 use_cache=True, logits_to_keep=logits_to_keep,
                                 **{self._cache_arg: self.cache})
        finally:
            self.cache.activate(None)
        self._tentative = list(counts)
        return out.logits.float()

    # ------------------------------------------------------------------ API
    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Free every row and prefill B ragged prompts; returns the logits at each prompt's last
        position, fp32 [B, V]. Afterwards lengths[b] = len(prompts[b])."""
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        self.kv.free_all()
        self._batch = B = len(prompts)
        T = max(len(p) for p in prompts)
        # Left-aligned padding: every prompt ends in the last column, so logits_to_keep=1 suffices.
        ids = torch.zeros((B, T), dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.as_tensor(list(p), dtype=torch.int64)
        counts = [len(p) for p in prompts]
        logits = self._run(ids.to(self.device), [T - c for c in counts], counts, None, None, 1)
        self.kv.set_lengths([(b, counts[b]) for b in range(B)])
        self._tentative = [0] * B
        return logits[:, -1]

    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append T tokens per row tentatively and return their logits, fp32 [B, T, V].

        input_ids [B, T] int64; num_tokens [B] (default T): row b's tokens past num_tokens[b] are
        padding (not kept, garbage logits). Chain: token t sits at position lengths[b] + t and sees
        the prefix and tokens 0..t. Tree: tree_parents [B, T-1] int32 (csrc/tree.h layout: node i is
        token i+1, -1 = child of token 0); token 0 (the last committed token, depth 0) and each node
        see the prefix, token 0 and their ancestors, at position lengths[b] + depth.
        Raises ValueError naming the row when it would exceed max_seq_len or the pool is full.
        """
        B, T, counts = check_forward_inputs(input_ids, num_tokens, tree_parents, self._batch)
        ancestors = depth = None
        if tree_parents is not None:
            ancestors, depth = token_tree_inputs(tree_parents.to(self.device), counts, T)
        input_ids = input_ids.to(self.device)
        logits = self._run(input_ids, [0] * B, counts, ancestors, depth, 0)
        self._tree = tree_parents is not None
        return logits

    def commit(self, num_kept: torch.Tensor) -> None:
        """After a chain forward: row b keeps its first num_kept[b] tentative tokens (lengths[b] +=
        num_kept[b]) and rolls back the rest. num_kept [B] int."""
        kept = [int(x) for x in num_kept.tolist()]
        if len(kept) != self._batch:
            raise ValueError(f"commit: num_kept has {len(kept)} rows, the runner holds {self._batch}")
        lengths = self._host_lengths()
        for b, k in enumerate(kept):
            if not 0 <= k <= self._tentative[b]:
                raise ValueError(f"commit: num_kept[{b}] = {k} is outside [0, {self._tentative[b]}]")
        self.kv.set_lengths([(b, lengths[b] + kept[b]) for b in range(self._batch)])
        self._tentative = [0] * self._batch

    def commit_tree(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree forward: keep token 0 and the accepted nodes path[b, :num_accepted[b]] (node
        indices, tree_verify's path), moved to consecutive positions: lengths[b] += 1 + num_accepted[b].
        A row whose forward had num_tokens = 0 keeps nothing. path [B, N] int, num_accepted [B] int."""
        B = self._batch
        if not self._tree:
            raise ValueError("commit_tree: the last forward was not a tree forward")
        lengths = self._host_lengths()
        plan = tree_commit_plan(path, num_accepted, lengths, self._tentative)
        width = max([1] + [len(moves) for moves, _ in plan])
        src = torch.full((B, width), -1, dtype=torch.int64)
        for b, (moves, _) in enumerate(plan):
            src[b, : len(moves)] = torch.tensor(moves, dtype=torch.int64)
        new_lengths = [(b, length) for b, (_, length) in enumerate(plan)]
        dst = torch.tensor([l + 1 for l in lengths], dtype=torch.int64, device=self.device)
        self.kv.compact(src.to(self.device), dst, new_lengths, rows=B)
        self._tentative = [0] * B
        self._tree = False

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to shorter committed lengths (never grows). new_lengths [B] int."""
        target = [int(x) for x in new_lengths.tolist()]
        if len(target) != self._batch:
            raise ValueError(f"truncate: new_lengths has {len(target)} rows, the runner holds {self._batch}")
        lengths = self._host_lengths()
        for b, n in enumerate(target):
            if not 0 <= n <= lengths[b]:
                raise ValueError(f"truncate: new_lengths[{b}] = {n} is outside [0, {lengths[b]}]")
        self.kv.set_lengths(list(enumerate(target)))
        self._tentative = [0] * self._batch
