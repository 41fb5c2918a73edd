"""CUDA graphs: capture a step of the decode loop once, replay it (the mechanism only).

``StepGraph(fn)`` wraps one step function that reads and writes static tensors only. The loop
(decode.py) wraps its draft, verify and commit steps in StepGraphs when the plan turns graphs on
(plan.py decides that, once: a CUDA device, SPECDEC_CUDA_GRAPHS not 0, a chain of fixed k, the paged
runner in its static-shapes mode, a drafter that works on the device); otherwise the steps run as
plain calls.

What is captured and what is not (on CUDA, per decode call, per batch bucket B and draft length k):

    prefill                              eager (ragged prompt lengths: a new shape every call)
    draft    drafter.propose(meta)       one graph: the draft model's feed + k-1 one-token forwards,
                                         filtering, Philox sampling into the drafter's proposal buffers
    verify   target forward over         one graph: target forward over [B, k+1], chain_verify into
             [pending, drafts], verifier the loop's verdict buffers
    commit   target.commit, token        one graph: lengths += num_kept on the device, the scatter
             buffer scatter, drafter     into token_buffer, the draft cache's rollback (lengths only)
             commit
    host     stop checks, stats, the     eager, between replays: one device->host read per step
             step's Philox offsets       (num_accepted, output tokens); meta.set_step fills the
                                         per-row offset tensors that the graphs read on the device

The randomness is not baked into the graphs: chain_verify and philox_uniforms read the per-row
``meta.seed`` and ``meta.verify_offset`` / ``meta.draft_offset`` device tensors, which the loop
refills before every replay, so each replay draws fresh numbers (and the same ones as eager mode).

A capture that fails (e.g. a model that syncs with the host: ``.item()``, data-dependent shapes) is
logged once on the ``specdec_ext`` logger and the step runs eagerly from then on. Graphs are captured
per decode call (the metadata and the caches are allocated per call).
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Tuple

import torch

log = logging.getLogger("specdec_ext")

ENV_GRAPHS = "SPECDEC_CUDA_GRAPHS"  # "0" turns capture off (eager on CUDA too)
DEFAULT_WARMUP = 1  # eager calls on a side stream before the capture (lazy init, cuBLAS workspaces)

__all__ = ["StepGraph", "graphs_available", "log_fallback", "ENV_GRAPHS"]

_logged: set = set()


def log_fallback(reason: str) -> None:
    """Say once per process (per distinct reason) why a step runs eagerly."""
    if reason not in _logged:
        _logged.add(reason)
        log.info("specdec_ext: CUDA graphs off, running eagerly: %s", reason)


def graphs_available(device: torch.device) -> Tuple[bool, Optional[str]]:
    """(whether capture may be tried on ``device``, the reason when not): the plan's first question."""
    device = torch.device(device)
    if os.environ.get(ENV_GRAPHS, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_GRAPHS}=0"
    if device.type != "cuda":
        return False, f"device is {device.type} (CUDA graphs need a CUDA device)"
    return True, None


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
