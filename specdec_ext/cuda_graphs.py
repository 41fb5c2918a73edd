"""CUDA graphs for the decode loop: capture the draft, verify and commit steps once, replay them.

What is captured and what is not (on CUDA, per decode call, per batch bucket B and draft length k):

    prefill                              eager (ragged prompt lengths: a new shape every call)
    draft    drafter.propose(meta)       one graph: the draft model's feed + k-1 one-token forwards,
                                         filtering, Philox sampling into meta.draft_token_ids/probs
    verify   gather pending, target      one graph: target forward over [B, k+1], chain_verify into
             forward, chain_verify       meta.output_tokens / meta.num_accepted
    commit   target.commit, token        one graph: lengths += num_kept on the device, the scatter
             buffer scatter, drafter     into token_buffer, the draft cache's rollback (lengths only)
             accept
    host     stop checks, stats, the     eager, between replays: one device->host read per step
             step's Philox offsets       (num_accepted, output_tokens); meta.set_step fills the
                                         per-row offset tensors that the graphs read on the device

The randomness is not baked into the graphs: chain_verify and philox_uniforms read the per-row
``meta.seed`` and ``meta.verify_offset`` / ``meta.draft_offset`` device tensors, which the loop
refills before every replay, so each replay draws fresh numbers (and the same ones as eager mode).

Why the runner needs a wrapper: PagedModelRunner.forward does host work every step (reads
num_tokens on the host, reserves pages on the host allocator, builds index tensors from Python
lists) and commit/truncate read their argument on the host: none of that can be captured.
``StaticPagedRunner`` splits "host bookkeeping" from "the device computation of the step": at
``start`` (eager, after the prefill) every row takes ownership of all the pages it can ever use
(``max_pages_per_row``; the default pool is sized for exactly that), so the block tables never
change during decoding; the lengths then live only in the device tensor ``kv.lengths``, and
forward / commit / truncate are pure device code over static shapes (attention gathers all pages
of a row, as ``static_kv`` does). ``sync_host()`` brings the host allocator up to date afterwards.

Fallbacks (logged once per reason on the ``specdec_ext`` logger, then the step runs eagerly):
a CPU device, ``SPECDEC_CUDA_GRAPHS=0``, a runner or drafter that works on the host (the plain
PagedModelRunner, NgramDrafter, the recompute oracle), a page pool too small for static ownership,
and any exception during capture (e.g. a model that syncs with the host: ``.item()``, data-dependent
shapes).

Bucketing: ``bucket_size(B)`` rounds a batch up to 1, 2, 4, 8, 16, 32 or 64 and ``pad_batch`` adds
frozen rows (finished before they start, never emitting) so that only those shapes are captured.
Graphs are captured per decode call (the metadata and the caches are allocated per call); reusing
them across calls would need those buffers cached per (bucket, k, S) too: not done here.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Sequence, Tuple

import torch

from .profiling import nvtx_range

log = logging.getLogger("specdec_ext")

ENV_GRAPHS = "SPECDEC_CUDA_GRAPHS"  # "0" turns capture off (eager on CUDA too)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_WARMUP = 1  # eager calls on a side stream before the capture (lazy init, cuBLAS workspaces)

__all__ = ["StepGraph", "StaticPagedRunner", "DecodeSteps", "bucket_size", "pad_batch", "graphs_enabled",
           "static_runner_factory", "maybe_pad", "log_fallback", "BUCKETS", "ENV_GRAPHS"]

_logged: set = set()


def log_fallback(reason: str) -> None:
    """Say once per process (per distinct reason) why a step runs eagerly."""
    if reason not in _logged:
        _logged.add(reason)
        log.info("specdec_ext: CUDA graphs off, running eagerly: %s", reason)


def graphs_enabled(device: torch.device) -> Tuple[bool, Optional[str]]:
    """(whether capture may be tried on ``device``, the reason when not)."""
    device = torch.device(device)
    if os.environ.get(ENV_GRAPHS, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_GRAPHS}=0"
    if device.type != "cuda":
        return False, f"device is {device.type} (CUDA graphs need a CUDA device)"
    return True, None


# ------------------------------------------------------------------------------------ bucketing
def bucket_size(batch: int) -> int:
    """The smallest bucket >= batch; a batch above the largest bucket keeps its own size."""
    if batch < 1:
        raise ValueError(f"bucket_size: batch must be >= 1, got {batch}")
    for bucket in BUCKETS:
        if batch <= bucket:
            return bucket
    return batch


def pad_batch(prompts: Sequence[Sequence[int]], seeds: torch.Tensor, rows: list, *, row_factory: Callable,
              bucket: Optional[int] = None):
    """Pad a batch to its bucket with frozen rows.

    Returns (prompts, seeds, rows) of length ``bucket`` (default ``bucket_size(len(prompts))``): the
    padding prompts are one token (the first prompt's last), their seeds 0, and their rows are
    ``row_factory()`` objects already marked finished (reason "padding"), so the loop freezes them from
    the first step: they commit nothing and emit nothing. The real rows come first, unchanged.
    """
    real = len(prompts)
    bucket = bucket_size(real) if bucket is None else bucket
    if bucket < real:
        raise ValueError(f"pad_batch: bucket {bucket} is smaller than the batch {real}")
    extra = bucket - real
    if extra == 0:
        return list(prompts), seeds, list(rows)
    filler = [int(list(prompts[0])[-1])]
    padded_rows = list(rows)
    for _ in range(extra):
        row = row_factory()
        row.finished, row.finish_reason = True, "padding"
        padded_rows.append(row)
    padded_seeds = torch.cat([seeds, torch.zeros((extra,), dtype=seeds.dtype, device=seeds.device)])
    return list(prompts) + [list(filler) for _ in range(extra)], padded_seeds, padded_rows


def maybe_pad(target, prompts, seeds: torch.Tensor, rows: list, *, row_factory: Callable):
    """``pad_batch`` when the target is a static runner (graphs on), else the batch unchanged."""
    if isinstance(target, StaticPagedRunner):
        return pad_batch(prompts, seeds, rows, row_factory=row_factory)
    return list(prompts), seeds, list(rows)


# ------------------------------------------------------------------------------------ StepGraph
class _CudaBackend:
    """The torch.cuda calls StepGraph makes (tests substitute a fake on the CPU)."""

    def warmup(self, fn: Callable[[], None]) -> None:
        """Run fn eagerly on a side stream (what torch recommends before a capture)."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None]):
        """Capture fn into a new graph (nothing runs); returns the graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        return graph

    def replay(self, graph) -> None:
        graph.replay()


class StepGraph:
    """One step of the loop as a CUDA graph: ``fn`` must read and write static tensors only.

    Call it like ``fn``. The first ``warmup`` calls run ``fn`` eagerly on a side stream (they do the
    step's real work); the next call captures ``fn`` (capturing runs no kernel) and replays the graph,
    and every later call only replays it. Host values ``fn`` reads are frozen at capture time; values
    that change per step must live in tensors that are updated in place before the call.

    With ``enabled=False`` (a CPU device, graphs switched off), or after a capture failed (logged once),
    every call runs ``fn`` eagerly. ``backend`` is for tests (a fake CUDAGraph on the CPU).
    """

    def __init__(self, fn: Callable[[], None], *, name: str, enabled: bool = True, warmup: int = DEFAULT_WARMUP,
                 backend=None):
        self.fn, self.name = fn, name
        self.enabled = bool(enabled)
        self.warmup = int(warmup)
        self.backend = backend if backend is not None else _CudaBackend()
        self.graph = None
        self.calls = 0
        self.replays = 0
        self.fallback_reason: Optional[str] = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def disable(self, reason: str) -> None:
        self.enabled, self.fallback_reason, self.graph = False, reason, None
        log_fallback(f"{self.name}: {reason}")

    def __call__(self) -> None:
        self.calls += 1
        if not self.enabled:
            self.fn()
            return
        if self.graph is None:
            if self.calls <= self.warmup:
                self.backend.warmup(self.fn)
                return
            try:
                self.graph = self.backend.capture(self.fn)
            except Exception as error:  # a host sync, an unsupported op, ...: eager from now on
                self.disable(f"capture failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
                self.fn()  # the capture ran nothing: do this step's work
                return
            log.debug("specdec_ext: captured the %s step in a CUDA graph", self.name)
        self.backend.replay(self.graph)
        self.replays += 1


# ------------------------------------------------------------------------------------ static runner
class StaticPagedRunner:
    """A PagedModelRunner whose decode-time methods are device-only (capturable); see the module doc.

    ``start`` (the prefill) runs the wrapped runner eagerly, then gives every row all its pages.
    ``forward`` (chain only), ``commit``, ``truncate`` and ``lengths`` then touch device tensors only:
    no host read, no allocation from Python lists, shapes fixed by (B, T). The host's copy of the
    lengths is stale until ``sync_host()``. Preconditions that the wrapped runner checks on the host
    (num_kept within the tentative tokens, no row past max_seq_len) are the caller's here; a token that
    would land past a row's capacity is not written (slot -1) rather than raising. If the pool cannot
    give every row all its pages, the wrapper says so once and forwards every call to the wrapped
    runner (host path, not capturable: ``static`` is then False).
    """

    capturable = True

    def __init__(self, runner):
        self.inner = runner
        self.static = False
        self._batch = 0

    @classmethod
    def factory(cls, base_factory=None):
        """A runner factory (``factory(model, max_batch_size=, max_seq_len=)``) of static runners."""
        if base_factory is None:
            from .model_runner import PagedModelRunner as base_factory

        def make(model, **kwargs):
            if "max_batch_size" in kwargs:  # room for the frozen rows that pad a batch to its bucket
                kwargs["max_batch_size"] = bucket_size(int(kwargs["max_batch_size"]))
            return cls(base_factory(model, **kwargs))

        make.__name__ = f"static_{getattr(base_factory, '__name__', 'runner')}"
        return make

    # -- passthroughs
    def __getattr__(self, name):  # model, device, dtype, vocab_size, max_batch_size, max_seq_len, kv, ...
        return getattr(self.__dict__["inner"], name)

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row (device, authoritative while static). Shape: [B]."""
        return self.inner.kv.lengths[: self.inner.batch_size]

    # -- lifecycle
    def start(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        logits = self.inner.start(prompts)  # eager prefill, host bookkeeping as usual
        kv, B = self.inner.kv, self.inner.batch_size
        try:
            kv.reserve([(b, kv.max_len) for b in range(B)])
        except ValueError as error:  # PoolFullError is a ValueError
            self.static = False
            log_fallback(f"StaticPagedRunner: the page pool cannot give each of {B} rows all "
                         f"{kv.max_pages_per_row} pages ({error}); using the host-side runner")
            return logits
        self.static = True
        self._batch = B
        self._full_cache = {}
        return logits

    def sync_host(self) -> None:
        """Copy the device lengths to the host allocator (one device->host read) and free the pages
        past them; the runner is host-side (not static) afterwards, until the next ``start``."""
        if not self.static:
            return
        lengths = self.lengths.tolist()
        self.inner.kv.set_lengths(list(enumerate(int(n) for n in lengths)))
        self.inner._tentative = [0] * self._batch
        self.static = False

    # -- the step (device only)
    def forward(self, input_ids: torch.Tensor, num_tokens: Optional[torch.Tensor] = None,
                tree_parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Chain forward: append T tokens per row tentatively; logits fp32 [B, T, V]. input_ids [B, T]
        int64 and num_tokens [B] (default T) on the model's device."""
        if not self.static or tree_parents is not None:
            if tree_parents is not None:
                self.sync_host()
            return self.inner.forward(input_ids, num_tokens, tree_parents)
        B, T = input_ids.shape
        if B != self._batch:
            raise ValueError(f"forward: input_ids has {B} rows, the runner holds {self._batch}")
        if num_tokens is None:
            num_tokens = self._full(B, T)
        return device_forward(self.inner, input_ids, num_tokens.to(torch.int64))

    def _full(self, B: int, T: int) -> torch.Tensor:
        key = (B, T)
        if key not in self._full_cache:
            self._full_cache[key] = torch.full((B,), T, dtype=torch.int64, device=self.inner.device)
        return self._full_cache[key]

    def commit(self, num_kept: torch.Tensor) -> None:
        """lengths += num_kept, on the device. num_kept [B] int."""
        if not self.static:
            return self.inner.commit(num_kept)
        self.lengths.add_(num_kept.to(torch.int64))

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """lengths = new_lengths, on the device (never grows a row). new_lengths [B] int."""
        if not self.static:
            return self.inner.truncate(new_lengths)
        self.lengths.copy_(torch.minimum(new_lengths.to(torch.int64), self.lengths))

    def commit_tree(self, path, num_accepted):
        self.sync_host()
        return self.inner.commit_tree(path, num_accepted)


def device_forward(runner, input_ids: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """The device part of PagedModelRunner._run for a chain step starting at column 0, over all the
    pages of each row (static shapes). Same mask, slots and positions as the runner's own forward, so
    the same logits. input_ids [B, T] int64, num_tokens [B] int64 -> logits fp32 [B, T, V]."""
    from .hf_paged import PagedStep

    kv = runner.kv
    B, T = input_ids.shape
    PS, P = runner.page_size, kv.max_pages_per_row
    S = P * PS
    L = kv.lengths[:B]                                               # [B] int64
    j = runner._arange[:T].unsqueeze(0).expand(B, T)                 # [B, T] token index
    valid = j < num_tokens.unsqueeze(1)                              # [B, T]
    pos = L.unsqueeze(1) + j                                         # [B, T] storage position
    tables = kv.block_tables[:B]                                     # [B, P] int32
    page = tables.gather(1, (pos // PS).clamp(max=P - 1)).long()
    slot_mapping = torch.where(valid & (pos < S) & (page >= 0), page * PS + pos % PS, -1)  # [B, T]
    gather_pages = tables.clamp(min=0).long()                        # [B, P]
    s = runner._arange[:S].view(1, 1, S)
    rel = s - L.view(B, 1, 1)
    sees_new = (rel >= 0) & (rel < num_tokens.view(B, 1, 1)) & (rel <= j.unsqueeze(2))
    visible = (s < L.view(B, 1, 1)) | sees_new
    visible = torch.where(valid.unsqueeze(2), visible, s == 0)
    mask = torch.zeros((B, 1, T, S), dtype=runner.dtype, device=runner.device)
    mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(runner.dtype).min)
    ids = torch.where(valid, input_ids, 0)
    runner.cache.activate(PagedStep(slot_mapping, gather_pages, mask))
    try:
        with torch.no_grad():
            out = runner.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                               logits_to_keep=0, **{runner._cache_arg: runner.cache})
    finally:
        runner.cache.activate(None)
    return out.logits.float()


def static_runner_factory(factory, device) -> Callable:
    """The runner factory the decode loop should use on ``device``: static runners over the paged runner
    where graphs can be used (CUDA), ``factory`` unchanged elsewhere (the CPU keeps the host-side
    runner, which gathers only the pages in use)."""
    ok, reason = graphs_enabled(device)
    if not ok:
        return factory
    from .model_runner import PagedModelRunner

    if factory is not PagedModelRunner:
        log_fallback(f"runner {getattr(factory, '__name__', factory)!r} is not the paged runner: its steps sync "
                     "with the host")
        return factory
    return StaticPagedRunner.factory(factory)


# ------------------------------------------------------------------------------------ the loop's steps
def _capturable_runner(runner) -> Optional[str]:
    if isinstance(runner, StaticPagedRunner):
        return None if runner.static else "the static runner fell back to host bookkeeping (see above)"
    return f"{type(runner).__name__} does host bookkeeping in forward/commit (use StaticPagedRunner)"


def _capturable_drafter(drafter) -> Optional[str]:
    if drafter is None:
        return None
    runner = getattr(drafter, "runner", None)
    if runner is None or getattr(drafter, "deterministic", False):
        return f"{type(drafter).__name__} proposes on the host"
    return _capturable_runner(runner)


class DecodeSteps:
    """The draft, verify and commit steps of the loop for one decode call: StepGraphs on CUDA.

    ``draft_step(drafter, meta)``, ``verify_step(target, meta, verifier)`` and ``commit_step(target,
    drafter, meta)`` are decode.py's step functions (passed in: this module does not import the loop).
    Call ``.draft()``, ``.verify()``, ``.commit()`` in the loop where it called those; ``.captured`` says
    which steps are graphs. ``backend`` is for tests.
    """

    def __init__(self, target, drafter, meta, verifier, *, draft_step, verify_step, commit_step,
                 enabled: Optional[bool] = None, warmup: int = DEFAULT_WARMUP, backend=None):
        if enabled is None:
            enabled, reason = graphs_enabled(meta.seed.device)
            if not enabled:
                log_fallback(reason)
        target_reason = _capturable_runner(target) if enabled else None
        drafter_reason = _capturable_drafter(drafter) if enabled else None
        for reason in (target_reason, drafter_reason):
            if reason:
                log_fallback(reason)

        def accept_verifier(m, logits):
            with nvtx_range("accept"):
                verifier(m, logits)

        make = lambda fn, name, ok: StepGraph(fn, name=name, enabled=enabled and ok, warmup=warmup, backend=backend)
        self.draft = make(lambda: draft_step(drafter, meta), "draft", drafter_reason is None and drafter is not None)
        self.verify = make(lambda: verify_step(target, meta, accept_verifier), "verify", target_reason is None)
        self.commit = make(lambda: commit_step(target, drafter, meta), "commit",
                           target_reason is None and drafter_reason is None)

    @property
    def captured(self) -> dict:
        return {g.name: g.captured for g in (self.draft, self.verify, self.commit)}

    def finish(self, target, drafter=None) -> None:
        """After the loop: bring the static runners' host state up to date."""
        for runner in (target, getattr(drafter, "runner", None)):
            if isinstance(runner, StaticPagedRunner):
                runner.sync_host()
