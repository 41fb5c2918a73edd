"""PagedModelRunner: a HF causal LM over a PagedKVCache with ragged rows (the ``ModelRunner`` protocol).

Row b's committed tokens sit at positions 0 .. lengths[b]-1 of its pages. A ``forward`` writes the
K/V of its (up to T) tokens TENTATIVELY at positions lengths[b] + t; ``commit`` (chain) keeps a prefix
of them, ``commit_tree`` moves the accepted path next to token 0 with ``ops.kv_compact``; anything not
kept is rolled back by metadata only (lengths, freed pages). A forward without a commit in between
overwrites the previous tentative tokens. Positions, cache slots and the attention mask come from
``layout.step_layout``, as in every runner.

Hidden-state taps (``hidden_taps=...``, runners/taps.py): forward pre-hooks on the tapped decoder
layers keep their inputs during this runner's forwards, written per row and logical position beside the
pages (device work only: a captured chain forward writes them too); ``commit_tree`` moves the accepted
path's with the keys and values.

Two modes:

* host mode (the default): the lengths and the page allocator live on the host (the source of truth)
  and are mirrored to device tensors. ``forward`` reads ``num_tokens`` on the host and reserves pages
  as rows grow, and attention reads only the pages the longest row uses; ``commit`` / ``truncate`` read
  their arguments on the host. On the CPU this costs nothing.
* static-shapes mode (``static_shapes=True``: what a CUDA-graph-captured decode step needs): after the
  prefill every row owns all the pages it can ever use, so the block tables never change, the
  lengths live in the device tensor ``kv.lengths`` only, and a chain ``forward`` / ``commit`` /
  ``truncate`` is device work over shapes fixed by (B, T): no host read, no allocation from Python
  lists. The preconditions the host mode checks (num_kept within the tentative tokens, no row past
  max_seq_len) are the caller's there; a token that would land past a row's pages is not written.
  Anything that needs the host (a tree forward, ``commit_tree``) first copies the device lengths to
  the host allocator (``sync_host``) and continues in host mode until the next ``start``.
* one device step at a time (``reserve_step``: continuous batching under CUDA graphs, serve/batcher.py):
  the host gives every row in use the pages the next step can write (its length + the step's tokens)
  and the following chain forwards / commits / truncates run as in static-shapes mode, over a fixed
  batch width and every page slot of a row (free pages read as -1 and write nowhere); ``sync_host``
  ends the step (one read of the lengths; the pages past them go back to the pool). Rows join and
  leave between steps, in host mode.

The model is switched to the ``"specdec_paged"`` attention implementation (which behaves as HF's
sdpa outside a paged forward). The page pool is sized from the keys and values the model produces
(support.kv_layout); a model the paged attention cannot run is refused at construction
(support.UnsupportedModelError, naming the architecture and the missing feature).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from . import hf_paged
from .capabilities import RunnerCapabilities
from .checks import check_forward_inputs, check_row_counts, check_start_prompts, output_vocab_size
from .hf_paged import PagedCache, PagedStep
from .kv_cache import PagedKVCache, PoolFullError
from .layout import additive_mask, step_layout
from .rows import RowsInUse
from .support import kv_layout
from .taps import LayerInputHooks, TapBuffer, check_tap_layers, decoder_layers_of
from .trees import token_tree_inputs, tree_commit_plan

__all__ = ["PagedModelRunner", "PoolFullError", "DEFAULT_PAGE_SIZE"]

DEFAULT_PAGE_SIZE = 16  # positions per page


class PagedModelRunner:
    """Runs a HF causal LM over a PagedKVCache with ragged rows (see the module docstring)."""

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, page_size: int = DEFAULT_PAGE_SIZE,
                 num_pages: Optional[int] = None, static_shapes: bool = False,
                 hidden_taps: Optional[Sequence[int]] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.model = model
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        layout = kv_layout(model, max_seq_len)  # the cache shapes the model produces (UnsupportedModelError names why not)
        self.device, self.dtype = next(model.parameters()).device, layout.dtype
        self.vocab_size: int = output_vocab_size(model)  # logits last dim
        pages_per_row = -(-max_seq_len // page_size)
        full_pool = max_batch_size * pages_per_row
        if num_pages is None:
            num_pages = full_pool
        if static_shapes and num_pages < full_pool:
            raise ValueError(f"static_shapes needs every row to own all its pages: num_pages={num_pages} < "
                             f"max_batch_size * pages per row = {full_pool}")
        self.static_shapes = bool(static_shapes)
        self.kv = PagedKVCache(num_layers=layout.num_layers, num_kv_heads=layout.heads, head_dim=layout.head_dim,
                               num_pages=num_pages, page_size=page_size, max_batch=max_batch_size,
                               max_pages_per_row=pages_per_row, dtype=self.dtype, device=self.device)
        self.cache = PagedCache(self.kv, layout)
        hf_paged.register()
        hf_paged.keep_original_implementation(model)
        hf_paged.install_alibi(model)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(hf_paged.ATTN_IMPLEMENTATION)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self._cache_arg = hf_paged.cache_argument_name(model)
        self._batch = 0
        self._device_lengths = False  # static-shapes mode in flight: kv.lengths is the truth, the host's is stale
        self._tentative: List[int] = []  # tokens written by the last forward, per row (host mode)
        self._tree = False  # whether the last forward was a tree
        self._in_use = RowsInUse(max_batch_size)  # continuous batching: start_rows / free_rows
        self._arange = torch.arange(max(max_seq_len, pages_per_row * page_size) + 1, device=self.device)  # positions
        self._rows = torch.arange(max_batch_size, device=self.device)  # (rows: a batch may outnumber the positions)
        self._taps, self._tap_hooks = self._make_taps(model, hidden_taps)

    def _make_taps(self, model, hidden_taps):
        """Hidden-state taps (runners/taps.py): a buffer over logical positions (a scratch slot past
        max_seq_len) and pre-hooks on the tapped decoder layers, live during this runner's forwards."""
        if hidden_taps is None:
            return None, None
        ids = check_tap_layers(hidden_taps, len(decoder_layers_of(model)))
        hidden = int(model.get_input_embeddings().weight.shape[1])
        buffer = TapBuffer(ids, hidden, self.max_batch_size, self.max_seq_len + 2, self.device)
        hooks = LayerInputHooks(model, ids)
        weakref.finalize(self, hooks.remove)  # (they sat on the model for good, one more set per runner)
        return buffer, hooks

    @property
    def hidden_taps(self):
        return None if self._taps is None else self._taps.layers

    def tapped_states(self, positions: torch.Tensor) -> torch.Tensor:
        """The tapped hidden states (runners/taps.py) of row b's committed tokens at ``positions[b]``
        (< lengths[b]; others are unspecified): positions [B, W] int64 -> [B, W, n * H] fp32."""
        if self._taps is None:
            raise ValueError("tapped_states: this runner was built without hidden_taps")
        return self._taps.gather(self._rows[: positions.shape[0]], positions.clamp(max=self.max_seq_len))

    # ------------------------------------------------------------------ state
    @property
    def capabilities(self) -> RunnerCapabilities:
        """Device steps (``reserve_step`` / ``sync_host``) in host mode; the static-shapes mode gives every
        row all its pages up front instead."""
        return RunnerCapabilities(device_steps=not self.static_shapes, hidden_taps=self._taps is not None)

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row, int64 on the model's device. Shape: [B]."""
        return self.kv.lengths[: self._batch]

    def sync_host(self) -> None:
        """Static-shapes mode or a ``reserve_step``: copy the device lengths to the host allocator (one
        device->host read) and free the pages past them; the runner is in host mode afterwards (until the
        next ``start`` in static-shapes mode, the next ``reserve_step`` otherwise), over the rows in use."""
        if not self._device_lengths:
            return
        self.kv.set_lengths(list(enumerate(int(n) for n in self.lengths.tolist())))
        self._batch = self._in_use.width
        self._tentative = [0] * self._batch
        self._device_lengths = False

    def reserve_step(self, width: int, tokens: int) -> None:
        """Continuous batching under CUDA graphs: give every row in use pages for ``tokens`` more
        positions (its host length + tokens, at most max_seq_len; a token past a row's pages is not
        written, so the caller sizes its requests to fit, as serve/budget.py does), and run the next
        chain forwards, commits and truncates on the device over rows 0..width-1 (rows not in use hold
        nothing and commit nothing), until ``sync_host``. PoolFullError (nothing allocated) when the
        pool cannot hold the pages."""
        if self.static_shapes:
            raise ValueError("reserve_step: the static-shapes mode already gives every row all its pages")
        if not self._in_use.width <= width <= self.max_batch_size:
            raise ValueError(f"reserve_step: width {width} must cover the rows in use (up to row "
                             f"{self._in_use.width - 1}) and be at most max_batch_size={self.max_batch_size}")
        if tokens < 1:
            raise ValueError(f"reserve_step: tokens must be >= 1, got {tokens}")
        self.sync_host()
        lengths = self.kv.host_lengths()
        self.kv.reserve([(row, min(lengths[row] + tokens, self.max_seq_len)) for row in self._in_use.rows])
        self._batch = width
        self._device_lengths = True

    # ------------------------------------------------------------------ core step
    def _run(self, input_ids: torch.Tensor, num_tokens: torch.Tensor, pages: int, *,
             first: Optional[torch.Tensor] = None, tree=None, logits_to_keep: int = 0,
             cache_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One forward over the first ``pages`` pages of each row: input_ids [B, T], num_tokens [B] int64
        and first [B] int64 on the device (see layout.step_layout); cache_rows [B] int64: the cache row
        of each batch row (start_rows), None: rows 0..B-1. Logits fp32 [B, T or keep, V]."""
        B, T = input_ids.shape
        PS = self.page_size
        S = pages * PS
        lengths = self.lengths if cache_rows is None else self.kv.lengths[cache_rows]  # [B]
        layout = step_layout(lengths, num_tokens, T, S, self._arange, first=first, tree=tree)
        tables = self.kv.block_tables[:B] if cache_rows is None else self.kv.block_tables[cache_rows]  # [B, P_max]
        page = tables.gather(1, (layout.storage // PS).clamp(max=tables.shape[1] - 1)).long()
        stored = layout.valid & (layout.storage < self.kv.max_len) & (page >= 0)
        slot_mapping = torch.where(stored, page * PS + layout.storage % PS, -1)  # [B, T] int64
        gather_pages = tables[:, :pages].clamp(min=0).long()  # [B, P] int64
        mask = additive_mask(layout.visible, self.dtype)  # [B, 1, T, S]
        ids = torch.where(layout.valid, input_ids, 0)
        self.cache.activate(PagedStep(slot_mapping, gather_pages, mask, layout, self.cache.layout.windows))
        captured: Dict[int, torch.Tensor] = {}  # tapped layer -> its input [B, T, H] in this forward
        try:
            with torch.no_grad(), (self._tap_hooks.capturing(captured) if self._taps is not None
                                   else contextlib.nullcontext()):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=layout.positions,
                                 use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_arg: self.cache})
        finally:
            self.cache.activate(None)
        if self._taps is not None:
            rows = self._rows[:B] if cache_rows is None else cache_rows
            self._taps.write_valid(rows, layout.storage, layout.valid & (layout.storage < self.max_seq_len),
                                   [captured[i] for i in self._taps.layers])
        return out.logits.float()

    def _reserve(self, counts: Sequence[int]) -> int:
        """Host mode: give each row pages for its new tokens; returns the pages the longest row uses."""
        lengths = self.kv.host_lengths()[: self._batch]
        for b, count in enumerate(counts):
            if lengths[b] + count > self.max_seq_len:
                raise ValueError(f"row {b} would hold {lengths[b] + count} tokens, more than "
                                 f"max_seq_len={self.max_seq_len}")
        self.kv.reserve([(b, lengths[b] + counts[b]) for b in range(self._batch)])  # PoolFullError names the row
        return max(1, -(-max(l + n for l, n in zip(lengths, counts)) // self.page_size))

    # ------------------------------------------------------------------ API
    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Free every row and prefill B ragged prompts; returns the logits at each prompt's last
        position, fp32 [B, V]. Afterwards lengths[b] = len(prompts[b])."""
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        self._device_lengths = False
        self.kv.free_all()
        self._batch = B = len(prompts)
        counts = [len(p) for p in prompts]
        pages = self._reserve(counts)
        logits = self._prefill(prompts, pages, None)
        self.kv.set_lengths([(b, counts[b]) for b in range(B)])
        self._tentative = [0] * B
        self._in_use.reset(B)
        if self.static_shapes:
            self.kv.reserve([(b, self.kv.max_len) for b in range(B)])
            self._device_lengths = True
        return logits

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Continuous batching (host mode): prefill free ``rows`` with ``prompts`` while the other rows
        keep their pages; returns the logits at each prompt's last position, fp32 [n, V]. The batch then
        spans up to the highest row in use (runners/rows.py). PoolFullError (nothing allocated) when the
        pool cannot hold the prompts."""
        if self.static_shapes:
            raise ValueError("start_rows: the static-shapes (CUDA-graph) mode gives every row all its pages; "
                             "continuous batching needs host mode (static_shapes=False)")
        check_start_prompts(prompts, self.max_batch_size, self.max_seq_len)
        self.sync_host()
        rows = self._in_use.check_free("start_rows", rows, len(prompts))
        counts = [len(p) for p in prompts]
        self.kv.reserve(list(zip(rows, counts)))  # a free row owns no pages
        pages = -(-max(counts) // self.page_size)
        try:
            logits = self._prefill(prompts, pages, torch.tensor(rows, dtype=torch.int64, device=self.device))
        except BaseException:
            self.kv.set_lengths([(row, 0) for row in rows])  # give the pages back
            raise
        self.kv.set_lengths(list(zip(rows, counts)))
        self._in_use.add(rows)
        self._batch = self._in_use.width
        self._tentative = [0] * self._batch
        return logits

    def fork_rows(self, source: int, rows: Sequence[int]) -> None:
        """Continuous batching (host mode, between steps): free ``rows`` take row ``source``'s committed
        tokens without a forward. They share its full pages (PagedKVCache.fork: copy-on-write, each row
        copies only the partial page it will write next); the logits at the last token are the source's.
        PoolFullError (nothing changed) when the pool has no room for the copies."""
        self.sync_host()
        if int(source) not in self._in_use:
            raise ValueError(f"fork_rows: source row {source} is not in use (start_rows it first)")
        rows = self._in_use.check_free("fork_rows", rows, len(rows))
        self.kv.fork(int(source), rows)
        if self._taps is not None:
            length = self.kv.length(int(source))
            self._taps.states[rows, :length] = self._taps.states[int(source), :length]
        self._in_use.add(rows)
        self._batch = self._in_use.width
        self._tentative = [0] * self._batch

    def hold_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching (host mode): free ``rows`` count as in use with no pages, without a forward
        (the batch spans them; each is a free row inside the width until free_rows)."""
        self.sync_host()
        rows = self._in_use.check_free("hold_rows", rows, len(rows))
        self._in_use.add(rows)
        self._batch = self._in_use.width
        self._tentative = [0] * self._batch

    def free_rows(self, rows: Sequence[int]) -> None:
        """Continuous batching: release ``rows`` and their pages at once; the batch shrinks to the
        highest row still in use."""
        self.sync_host()
        rows = self._in_use.remove("free_rows", rows)
        self.kv.set_lengths([(row, 0) for row in rows])
        self._batch = self._in_use.width
        self._tentative = [0] * self._batch

    def _prefill(self, prompts: Sequence[Sequence[int]], pages: int, cache_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits at each prompt's last position [n, V]; the prompts' K/V go to cache rows ``cache_rows``
        (None: 0..n-1), whose pages are reserved."""
        T = max(len(p) for p in prompts)
        # Left-aligned padding: every prompt ends in the last column, so logits_to_keep=1 suffices.
        ids = torch.zeros((len(prompts), T), dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.as_tensor(list(p), dtype=torch.int64)
        n = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        logits = self._run(ids.to(self.device), n.to(self.device), pages, first=(T - n).to(self.device),
                           logits_to_keep=1, cache_rows=cache_rows)
        return logits[:, -1]

    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append T tokens per row tentatively and return their logits, fp32 [B, T, V].

        input_ids [B, T] int64; num_tokens [B] (default T): row b's tokens past num_tokens[b] are
        padding (not kept, garbage logits). Chain: token t sits at position lengths[b] + t and sees
        the prefix and tokens 0..t. Tree: tree_parents [B, T-1] int32 (csrc/tree.h layout: node i is
        token i+1, -1 = child of token 0); token 0 (the last committed token, depth 0) and each node
        see the prefix, token 0 and their ancestors, at position lengths[b] + depth.
        Raises ValueError naming the row when it would exceed max_seq_len or the pool is full
        (host mode).
        """
        if self._device_lengths and tree_parents is None:
            return self._device_forward(input_ids, num_tokens)
        self.sync_host()
        B, T, counts = check_forward_inputs(input_ids, num_tokens, tree_parents, self._batch)
        pages = self._reserve(counts)
        tree = None
        if tree_parents is not None:
            tree = token_tree_inputs(tree_parents.to(self.device), counts, T)
        n = torch.tensor(counts, dtype=torch.int64).to(self.device)
        logits = self._run(input_ids.to(self.device), n, pages, tree=tree)
        self._tentative = list(counts)
        self._tree = tree_parents is not None
        return logits

    def _device_forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """Static-shapes chain forward over every page of each row: device work only."""
        B, T = input_ids.shape
        if B != self._batch:
            raise ValueError(f"forward: input_ids has {B} rows, the runner holds {self._batch}")
        if num_tokens is None:
            num_tokens = self._arange[T].expand(B)
        return self._run(input_ids, num_tokens.to(torch.int64), self.kv.max_pages_per_row)

    def commit(self, num_kept: torch.Tensor) -> None:
        """After a chain forward: row b keeps its first num_kept[b] tentative tokens (lengths[b] +=
        num_kept[b]) and rolls back the rest. num_kept [B] int."""
        if self._device_lengths:
            self.lengths.add_(num_kept.to(torch.int64))
            return
        kept = check_row_counts("commit", "num_kept", num_kept, self._tentative, self._batch)
        lengths = self.kv.host_lengths()
        self.kv.set_lengths([(b, lengths[b] + kept[b]) for b in range(self._batch)])
        self._tentative = [0] * self._batch

    def commit_tree(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree forward: keep token 0 and the accepted nodes path[b, :num_accepted[b]] (node
        indices, tree_verify's path), moved to consecutive positions: lengths[b] += 1 + num_accepted[b].
        A row whose forward had num_tokens = 0 keeps nothing. path [B, N] int, num_accepted [B] int."""
        B = self._batch
        if not self._tree:
            raise ValueError("commit_tree: the last forward was not a tree forward")
        lengths = self.kv.host_lengths()[:B]
        plan = tree_commit_plan(path, num_accepted, lengths, self._tentative)
        width = max([1] + [len(moves) for moves, _ in plan])
        src = torch.full((B, width), -1, dtype=torch.int64)
        for b, (moves, _) in enumerate(plan):
            src[b, : len(moves)] = torch.tensor(moves, dtype=torch.int64)
        new_lengths = [(b, length) for b, (_, length) in enumerate(plan)]
        dst = torch.tensor([l + 1 for l in lengths], dtype=torch.int64, device=self.device)
        self.kv.compact(src.to(self.device), dst, new_lengths, rows=B)
        if self._taps is not None:
            for b, (moves, _) in enumerate(plan):
                if moves:
                    self._taps.move(b, torch.tensor(moves, device=self.device),
                                    self._arange[lengths[b] + 1: lengths[b] + 1 + len(moves)])
        self._tentative = [0] * B
        self._tree = False

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to shorter committed lengths (never grows). new_lengths [B] int."""
        if self._device_lengths:
            self.lengths.copy_(torch.minimum(new_lengths.to(torch.int64), self.lengths))
            return
        target = check_row_counts("truncate", "new_lengths", new_lengths, self.kv.host_lengths(), self._batch)
        self.kv.set_lengths(list(enumerate(target)))
        self._tentative = [0] * self._batch
