"""PagedKVCache under random sequences of append / rollback / compact / free / fork (a hypothesis state
machine): after every step no page is leaked or held by more rows than its count, a shared page is
below every holder's length, the block tables and lengths match the
allocator, and every row reads back exactly what a plain list model of it holds."""
import numpy as np
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specdec_ext.runners.kv_cache import PagedKVCache, PoolFullError

L, H, D = 2, 1, 2
NUM_PAGES, PAGE_SIZE, MAX_BATCH, MAX_PAGES = 8, 3, 3, 5


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=NUM_PAGES,
                                  page_size=PAGE_SIZE, max_batch=MAX_BATCH, max_pages_per_row=MAX_PAGES)
        self.rows = [[] for _ in range(MAX_BATCH)]  # per row: list of (K [L, H, D], V [L, H, D]) arrays
        self.counter = 0

    def _tokens(self, n):
        data = np.arange(self.counter, self.counter + 2 * L * n * H * D, dtype=np.float32)
        self.counter += data.size
        data = data.reshape(2, L, n, H, D)
        return data[0], data[1]

    @rule(row=st.integers(0, MAX_BATCH - 1), n=st.integers(1, 7))
    def append(self, row, n):
        if len(self.rows[row]) + n > MAX_PAGES * PAGE_SIZE:
            with pytest.raises(ValueError, match=f"row {row} needs"):
                self.cache.append(row, *map(torch.from_numpy, self._tokens(n)))
            return
        needed = -(-(len(self.rows[row]) + n) // PAGE_SIZE) - len(self.cache.pages(row))
        k, v = self._tokens(n)
        if needed > self.cache.num_free_pages:
            with pytest.raises(PoolFullError, match=f"row {row} needs {needed} more page"):
                self.cache.append(row, torch.from_numpy(k), torch.from_numpy(v))
            return
        self.cache.append(row, torch.from_numpy(k), torch.from_numpy(v))
        self.rows[row].extend((k[:, t], v[:, t]) for t in range(n))

    @rule(row=st.integers(0, MAX_BATCH - 1), data=st.data())
    def rollback(self, row, data):
        new_length = data.draw(st.integers(0, len(self.rows[row])))
        try:
            self.cache.rollback(row, new_length)
        except PoolFullError as error:  # copy-on-write of a shared page it would write, and no page free
            assert "to copy the shared pages" in str(error)
            return  # the row is unchanged (the invariant checks it)
        del self.rows[row][new_length:]

    @rule(row=st.integers(0, MAX_BATCH - 1))
    def free(self, row):
        self.cache.free(row)
        self.rows[row] = []

    @rule(source=st.integers(0, MAX_BATCH - 1), row=st.integers(0, MAX_BATCH - 1))
    def fork(self, source, row):
        """The n choices of a request: an empty row takes another's tokens, sharing its full pages."""
        if row == source or self.cache.pages(row):
            with pytest.raises(ValueError, match="must be empty"):
                self.cache.fork(source, [row])
            return
        partial = len(self.rows[source]) % PAGE_SIZE != 0
        if partial and self.cache.num_free_pages == 0:
            with pytest.raises(PoolFullError, match="forking row"):
                self.cache.fork(source, [row])
            return
        self.cache.fork(source, [row])
        self.rows[row] = list(self.rows[source])

    @precondition(lambda self: any(len(r) >= 2 for r in self.rows))
    @rule(data=st.data())
    def compact(self, data):
        # Every row at once, like commit_tree: a row keeps a prefix [0, start) then an increasing
        # subset of [start, length) moved to start, start+1, ...
        batch = MAX_BATCH
        srcs, starts, lengths = [], [], []
        for row in range(batch):
            n = len(self.rows[row])
            start = data.draw(st.integers(0, n))
            kept = sorted(data.draw(st.sets(st.integers(start, n - 1), max_size=4))) if start < n else []
            srcs.append(kept)
            starts.append(start)
            lengths.append((row, start + len(kept)))
        width = max(1, max(len(s) for s in srcs))
        src = torch.tensor([s + [-1] * (width - len(s)) for s in srcs], dtype=torch.int64)
        try:
            self.cache.compact(src, torch.tensor(starts, dtype=torch.int64), lengths)
        except PoolFullError as error:  # copy-on-write before the moves, and no page free: nothing moved
            assert "to copy the shared pages" in str(error)
            return
        for row in range(batch):
            kept = [self.rows[row][p] for p in srcs[row]]
            self.rows[row] = self.rows[row][: starts[row]] + kept

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        for row in range(MAX_BATCH):
            assert self.cache.length(row) == len(self.rows[row])
            k, v = self.cache.read(row)
            if self.rows[row]:
                np.testing.assert_array_equal(k.numpy(), np.stack([x[0] for x in self.rows[row]], axis=1))
                np.testing.assert_array_equal(v.numpy(), np.stack([x[1] for x in self.rows[row]], axis=1))
            else:
                assert k.shape[1] == 0


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedKVCache = CacheMachine.TestCase


def test_pool_full_message_names_row_needed_and_free():
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, num_pages=2, page_size=2,
                         max_batch=2, max_pages_per_row=4)
    cache.append(0, torch.zeros(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
    with pytest.raises(PoolFullError, match=r"row 1 needs 2 more page\(s\).*only 0 of 2 pages are free"):
        cache.append(1, torch.zeros(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
    cache.check_invariants()
