"""PagedKVCache: a page pool per layer, a free-page allocator, block tables and lengths per row.

Storage (dtype and device of the model)::

    pool          [L, 2, num_pages, page_size, H, D]   pool[l] is layer l's [K, V] pool (the layout
                                                       of ops.kv_write); pool.view(2 L, ...) is what
                                                       ops.kv_compact moves for all layers at once
    block_tables  [max_batch, max_pages_per_row] int32 page of each row's logical page, -1 = none
    lengths       [max_batch] int64                    committed tokens per row

Logical position p of row b lives in slot ``block_tables[b, p // page_size] * page_size +
p % page_size``. A row owns exactly ceil(reserved / page_size) pages, where ``reserved`` is the most
positions it was sized for since its last rollback. Rollback is metadata: the length shrinks and whole
pages past it go back to the free list.

Shared prefixes (``fork``: the n choices of one request): a forked row refers to the source's full
pages below the fork length (a reference count per page) and gets its own copy of the partial page the
source would write next. Every write lands at or past a row's length, so a shared page is read only.
Copy-on-write keeps that true whatever happens next: a row whose length drops into a shared page
first gets its own copy of every shared page from there on (``_own_from``), and a page returns to the
free list when its last owner lets go.

The allocator and the lengths live on the host (Python lists, the source of truth); the device
tensors ``block_tables`` and ``lengths`` are refreshed from them after every change (one small copy,
never a device->host read).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .. import ops


class PoolFullError(ValueError):
    """The page pool has too few free pages for a request (names the row, needed and free pages)."""


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers and up to ``max_batch`` rows (see the module doc)."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, max_batch: int, max_pages_per_row: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_pages", num_pages), ("page_size", page_size),
                            ("max_batch", max_batch), ("max_pages_per_row", max_pages_per_row)):
            if int(value) < 1:
                raise ValueError(f"PagedKVCache: {name} must be >= 1, got {value}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.max_batch, self.max_pages_per_row = max_batch, max_pages_per_row
        self.device = torch.device(device)
        self.dtype = dtype
        # [L, 2, num_pages, page_size, H, D]; zero-initialised so that stale slots are finite.
        self.pool = torch.zeros((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim),
                                dtype=dtype, device=self.device)
        self.block_tables = torch.full((max_batch, max_pages_per_row), -1, dtype=torch.int32,
                                       device=self.device)           # [max_batch, P] int32
        self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # [max_batch]
        self._tables_host = torch.full((max_batch, max_pages_per_row), -1, dtype=torch.int32)
        self._lengths_host: List[int] = [0] * max_batch
        self._pages: List[List[int]] = [[] for _ in range(max_batch)]
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # a stack: page 0 comes first
        self._owners: List[int] = [0] * num_pages  # rows whose tables hold each page (> 1: a shared prefix page)
        self._forked = False  # whether fork ever ran (compact then checks for shared pages)

    # ------------------------------------------------------------------ queries
    @property
    def max_len(self) -> int:
        """Positions a row can hold: max_pages_per_row * page_size."""
        return self.max_pages_per_row * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def length(self, row: int) -> int:
        """Committed tokens of ``row`` (host value)."""
        return self._lengths_host[row]

    def host_lengths(self) -> List[int]:
        return list(self._lengths_host)

    def pages(self, row: int) -> List[int]:
        """The pages ``row`` owns, in logical order."""
        return list(self._pages[row])

    def layer(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s pool, K then V. Shape: [2, num_pages, page_size, H, D]."""
        return self.pool[layer_idx]

    def slot(self, row: int, position: int) -> int:
        return self._pages[row][position // self.page_size] * self.page_size + position % self.page_size

    # ------------------------------------------------------------------ allocation
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch:
            raise IndexError(f"PagedKVCache: row {row} is outside [0, {self.max_batch})")

    def reserve(self, needs: Sequence[Tuple[int, int]]) -> None:
        """Make each ``row`` own pages for ``positions`` positions, for (row, positions) in ``needs``.

        All or nothing: when the pool cannot hold every request, nothing is allocated and
        ``PoolFullError`` names the first row that does not fit, its needed and the free pages.
        A row never shrinks here (see :meth:`rollback`).
        """
        extra = []
        for row, positions in needs:
            self._check_row(row)
            if positions > self.max_len:
                raise ValueError(f"PagedKVCache: row {row} needs {positions} positions, more than "
                                 f"max_pages_per_row * page_size = {self.max_len}")
            pages = -(-positions // self.page_size)
            extra.append((row, max(0, pages - len(self._pages[row]))))
        total, free = 0, len(self._free)
        for row, count in extra:
            total += count
            if total > free:
                raise PoolFullError(
                    f"PagedKVCache: the page pool is full: row {row} needs {count} more page(s) "
                    f"({total} with the rows before it in this request) but only {free} of "
                    f"{self.num_pages} pages are free (page_size={self.page_size})")
        changed = False
        for row, count in extra:
            for _ in range(count):
                page = self._free.pop()
                self._owners[page] = 1
                self._tables_host[row, len(self._pages[row])] = page
                self._pages[row].append(page)
                changed = True
        if changed:
            self.block_tables.copy_(self._tables_host, non_blocking=True)

    def set_lengths(self, new_lengths: Sequence[Tuple[int, int]], *, free_pages: bool = True) -> None:
        """Set (row, length) pairs; with ``free_pages`` the whole pages past each length are freed."""
        changed_tables = False
        for row, length in new_lengths:
            self._check_row(row)
            if not 0 <= length <= len(self._pages[row]) * self.page_size:
                raise ValueError(f"PagedKVCache: row {row} cannot have length {length}: it owns "
                                 f"{len(self._pages[row])} page(s) of {self.page_size}")
            keep = -(-length // self.page_size) if free_pages else len(self._pages[row])
            changed_tables |= self._own_from(row, length // self.page_size, keep)  # before any change to the row
            self._lengths_host[row] = length
            while len(self._pages[row]) > keep:
                self._release(self._pages[row].pop())
                self._tables_host[row, len(self._pages[row])] = -1
                changed_tables = True
        if changed_tables:
            self.block_tables.copy_(self._tables_host, non_blocking=True)
        self.lengths.copy_(torch.tensor(self._lengths_host, dtype=torch.int64), non_blocking=True)

    def _release(self, page: int) -> None:
        """One owner lets go of ``page``; the last one returns it to the free list."""
        self._owners[page] -= 1
        if self._owners[page] == 0:
            self._free.append(page)

    def _own_from(self, row: int, first: int, end: Optional[int] = None) -> bool:
        """Copy-on-write: ``row`` gets its own copy of each shared page among its logical pages ``first`` ..
        ``end`` - 1 (default: all from ``first``: the pages it may write next). Returns whether its table
        changed. PoolFullError when the pool has no page for a copy (nothing changed then)."""
        end = len(self._pages[row]) if end is None else min(end, len(self._pages[row]))
        shared = [i for i in range(first, end) if self._owners[self._pages[row][i]] > 1]
        if not shared:
            return False
        if len(shared) > len(self._free):
            raise PoolFullError(f"PagedKVCache: the page pool is full: row {row} needs {len(shared)} page(s) to "
                                f"copy the shared pages it would write, but only {len(self._free)} of "
                                f"{self.num_pages} pages are free (page_size={self.page_size})")
        for i in shared:
            old, new = self._pages[row][i], self._free.pop()
            self.pool[:, :, new] = self.pool[:, :, old]
            self._owners[old] -= 1
            self._owners[new] = 1
            self._pages[row][i] = new
            self._tables_host[row, i] = new
        return True

    def fork(self, source: int, rows: Sequence[int]) -> None:
        """Each of ``rows`` (empty) takes ``source``'s committed tokens: the source's full pages are
        shared, the partial page (if any) is copied into a page of each row's own. All or nothing:
        PoolFullError when the pool has too few free pages for the copies."""
        self._check_row(source)
        length = self._lengths_host[source]
        full, partial = divmod(length, self.page_size)
        rows = [int(row) for row in rows]
        for row in rows:
            self._check_row(row)
            if row == source or self._pages[row] or self._lengths_host[row]:
                raise ValueError(f"PagedKVCache: fork into row {row}: it must be empty and not the source {source}")
        copies = len(rows) * (1 if partial else 0)
        if copies > len(self._free):
            raise PoolFullError(f"PagedKVCache: the page pool is full: forking row {source} into {len(rows)} "
                                f"row(s) copies {copies} partial page(s) but only {len(self._free)} of "
                                f"{self.num_pages} pages are free (page_size={self.page_size})")
        shared = self._pages[source][:full]
        self._forked = True
        for row in rows:
            pages = list(shared)
            for page in shared:
                self._owners[page] += 1
            if partial:
                new, old = self._free.pop(), self._pages[source][full]
                self.pool[:, :, new] = self.pool[:, :, old]
                self._owners[new] = 1
                pages.append(new)
            self._pages[row] = pages
            self._tables_host[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._lengths_host[row] = length
        self.block_tables.copy_(self._tables_host, non_blocking=True)
        self.lengths.copy_(torch.tensor(self._lengths_host, dtype=torch.int64), non_blocking=True)

    @property
    def num_shared_pages(self) -> int:
        """Pages held by more than one row (forked prefixes)."""
        return sum(count > 1 for count in self._owners)

    def rollback(self, row: int, new_length: int) -> None:
        """Shorten ``row`` to ``new_length`` committed tokens and free its pages past it."""
        if new_length > self._lengths_host[row]:
            raise ValueError(f"PagedKVCache: rollback of row {row} to {new_length} tokens, but it holds "
                             f"only {self._lengths_host[row]}")
        self.set_lengths([(row, new_length)])

    def free(self, row: int) -> None:
        """Release every page of ``row`` (length 0)."""
        self.set_lengths([(row, 0)])

    def free_all(self) -> None:
        self.set_lengths([(row, 0) for row in range(self.max_batch)])

    # ------------------------------------------------------------------ data
    def slot_mapping(self, row: int, start: int, count: int) -> List[int]:
        return [self.slot(row, p) for p in range(start, start + count)]

    def append(self, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append n tokens to ``row``: key/value [L, n, H, D] (all layers), committed at once."""
        n = key.shape[1]
        start = self._lengths_host[row]
        self.reserve([(row, start + n)])
        slots = torch.tensor([self.slot_mapping(row, start, n)], dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            ops.kv_write(key[layer].unsqueeze(0), value[layer].unsqueeze(0), slots, self.pool[layer])
        self.set_lengths([(row, start + n)], free_pages=False)

    def compact(self, src_positions: torch.Tensor, dst_start: torch.Tensor,
                new_lengths: Sequence[Tuple[int, int]], rows: Optional[int] = None) -> None:
        """Move kept positions of rows 0..B-1 to consecutive positions (all layers), then set lengths.

        src_positions [B, N] int64 (-1 ends a row), dst_start [B] int64 (see ops.kv_compact);
        ``new_lengths`` (row, length) pairs applied afterwards (pages past them are freed).
        """
        batch = src_positions.shape[0] if rows is None else rows
        if self._forked and any(count > 1 for count in self._owners):  # copy-on-write before the moves
            try:
                for row, start in enumerate(dst_start[:batch].tolist()):
                    self._own_from(row, int(start) // self.page_size)
            finally:  # (a PoolFullError for a later row leaves the earlier rows' copies in place: same data)
                self.block_tables.copy_(self._tables_host, non_blocking=True)
        L = self.num_layers
        flat = self.pool.view(L * 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        ops.kv_compact(flat, self.block_tables[:batch], src_positions, dst_start)
        self.set_lengths(new_lengths)

    def read(self, row: int, length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``row``'s first ``length`` (default: committed) positions: [L, n, H, D] each."""
        n = self._lengths_host[row] if length is None else length
        slots = torch.tensor(self.slot_mapping(row, 0, n), dtype=torch.int64, device=self.device)
        flat = self.pool.view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        return flat[:, 0, slots], flat[:, 1, slots]

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is free or held by the rows its count says, a page held
        by several rows lies wholly below each one's length (read only), the tables match and every length
        fits its pages (a test helper; reads device tensors)."""
        owner = {}
        for row, pages in enumerate(self._pages):
            assert len(set(pages)) == len(pages), f"row {row} holds a page twice"
            for index, page in enumerate(pages):
                owner.setdefault(page, []).append(row)
                if self._owners[page] > 1:
                    assert (index + 1) * self.page_size <= self._lengths_host[row], \
                        f"row {row} could write shared page {page} (logical page {index}, length {self._lengths_host[row]})"
            assert self._lengths_host[row] <= len(pages) * self.page_size, f"row {row} overflows its pages"
        for page, rows in owner.items():
            assert self._owners[page] == len(rows), f"page {page} is counted {self._owners[page]} times, held by {rows}"
        assert all(self._owners[page] == 0 for page in self._free), "a free page has owners"
        assert not (set(owner) & set(self._free)), "a page is both owned and free"
        assert len(self._free) == len(set(self._free)), "a page is free twice"
        assert len(owner) + len(self._free) == self.num_pages, "a page leaked"
        tables = self.block_tables.cpu()
        for row, pages in enumerate(self._pages):
            expect = pages + [-1] * (self.max_pages_per_row - len(pages))
            assert tables[row].tolist() == expect, f"row {row}: block table {tables[row].tolist()} != {expect}"
        assert self.lengths.cpu().tolist() == self._lengths_host, "device lengths differ from the host's"
