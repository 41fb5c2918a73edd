"""CacheBudget: admission control over the target's KV cache.

A running row holds, from its admission to its end, what its worst case needs: its prompt,
max_new_tokens and two steps of drafts (``plan.required_cache_len``). Admission never hands out more
than the cache has, so a running row never finds it full: nothing is preempted, no row can corrupt
another, and a request that does not fit now waits in the queue until rows end.

Units: pages of the paged runner's pool (less one step of tentative tokens per slot: a free slot inside
the batch width still forwards ``slots + 1`` tokens each step and holds their pages until the commit),
or whole rows for the lean and recompute runners (each slot owns ``max_seq_len`` positions, so the slots
are the only limit there).
"""
from __future__ import annotations

from ..plan import required_cache_len
from ..runners import PagedModelRunner
from .request import RequestTooLargeError


class CacheBudget:
    """What each request needs of the cache, and how much of it the running rows hold."""

    def __init__(self, target, *, max_rows: int, slots: int, max_seq_len: int):
        self.slots, self.max_seq_len = int(slots), int(max_seq_len)
        self.kv = target.kv if isinstance(target, PagedModelRunner) else None
        if self.kv is not None:
            self.unit, self.page_size = "pages", self.kv.page_size
            headroom = max_rows * -(-(self.slots + 1) // self.page_size)
            self.capacity = self.kv.num_pages - headroom
            if self.capacity < 1:
                raise ValueError(f"the cache has {self.kv.num_pages} pages of {self.page_size} positions, and "
                                 f"{headroom} of them are kept for one step of drafts per slot ({max_rows} slots): "
                                 f"give it more (cache tokens) or fewer slots")
        else:
            self.unit, self.page_size, self.capacity = "rows", None, int(max_rows)
        self.used = 0

    @property
    def context_len(self) -> int:
        """The most prompt + max_tokens a request may ask (/v1/models' max_model_len): a row's positions less
        the two steps of drafts it may write past them."""
        return self.max_seq_len - required_cache_len(0, 0, self.slots)

    def positions(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a row needs at most."""
        return required_cache_len(prompt_len, max_new_tokens, self.slots)

    def units(self, prompt_len: int, max_new_tokens: int) -> int:
        """What a row holds of the budget while it runs."""
        if self.page_size is None:
            return 1
        return -(-self.positions(prompt_len, max_new_tokens) // self.page_size)

    def shared_units(self, prompt_len: int) -> int:
        """What the n choices of one request hold once between them: the prompt's full pages, which forked
        rows share (runners/kv_cache.py fork); 0 in rows, where each slot owns its positions."""
        return 0 if self.page_size is None else prompt_len // self.page_size

    def group_units(self, prompt_len: int, max_new_tokens: int, choices: int) -> int:
        """What ``choices`` rows of one prompt hold together: each its own pages, the shared ones once."""
        return choices * self.units(prompt_len, max_new_tokens) - (choices - 1) * self.shared_units(prompt_len)

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """RequestTooLargeError, with the numbers, for a request that could never run."""
        need = self.positions(prompt_len, max_new_tokens)
        shape = (f"the prompt has {prompt_len} tokens; with max_tokens={max_new_tokens} and {self.slots} draft "
                 f"slots a row needs {need} cache positions")
        if need > self.max_seq_len:
            raise RequestTooLargeError(f"the prompt has {prompt_len} tokens and max_tokens={max_new_tokens}: "
                                       f"{prompt_len + max_new_tokens} tokens, past this server's context of "
                                       f"{self.context_len} (max_model_len: rows of {self.max_seq_len} positions, "
                                       f"{self.max_seq_len - self.context_len} of them kept for two steps of "
                                       f"{self.slots} drafts): shorten the prompt or lower max_tokens",
                                       param="max_tokens")
        units = self.units(prompt_len, max_new_tokens)
        if units > self.capacity:
            raise RequestTooLargeError(f"{shape} ({units} pages of {self.page_size}) but the cache holds "
                                       f"{self.capacity} pages for rows: shorten the prompt or lower max_tokens",
                                       param="max_tokens")

    def fits(self, units: int) -> bool:
        return self.used + units <= self.capacity

    def take(self, units: int) -> None:
        if not self.fits(units):
            raise RuntimeError(f"CacheBudget: {units} {self.unit} asked with {self.used} of {self.capacity} held")
        self.used += units

    def release(self, units: int) -> None:
        self.used -= units

    @property
    def pages_in_use(self) -> int:
        """Pages the target's rows own now (the pool's truth, not the budget); 0 without a pool."""
        return 0 if self.kv is None else self.kv.num_pages - self.kv.num_free_pages

    @property
    def pages_total(self) -> int:
        return 0 if self.kv is None else self.kv.num_pages
