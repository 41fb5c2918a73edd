"""NVTX ranges for the decode loop, free when nobody is looking.

    with nvtx_range("verify"):
        ...

The decode loop marks these ranges per request batch: ``prefill`` (once, and a deferred draft prefill),
then per step ``draft``, ``verify`` (target forward + verifier), ``rejection_sampling`` (the verifier kernel,
inside ``verify`` when the step runs eagerly) and ``commit`` (the target keeps the accepted tokens, the
drafter rolls back what was rejected); ``look`` marks adaptive k's greedy looks. docs/profiling.md says how to read them with Nsight Systems.

Policy (decided once, at import):

* CPU-only torch, or no CUDA device: ``nvtx_range`` returns one shared no-op context manager (no
  torch.cuda.nvtx call at all: a CPU torch raises on it). Cost: a global read and a return.
* CUDA available: ranges are ON by default. A push/pop pair costs about a microsecond on the host,
  against decode steps of hundreds of microseconds or more, and nothing on the device. Set
  ``SPECDEC_NVTX=0`` to switch them off (e.g. for the last microsecond in a latency benchmark).
* ``SPECDEC_NVTX=1`` forces them on wherever torch.cuda.nvtx works (it is still a no-op on a CPU torch).

Inside a CUDA-graph capture the push/pop run once, on the host, at capture time; a replay is one
graph launch, so with graphs on only the loop-level ranges (``draft``, ``verify``, ``commit``)
appear per step; ``rejection_sampling`` appears per step only in eager mode (``SPECDEC_CUDA_GRAPHS=0``).
"""
from __future__ import annotations

import contextlib
import os

import torch

ENV_NVTX = "SPECDEC_NVTX"

__all__ = ["nvtx_range", "nvtx_enabled", "set_nvtx_enabled", "profiler_region", "ENV_NVTX"]


def _nvtx_usable() -> bool:
    """Whether torch.cuda.nvtx can be called without raising (a CUDA build of torch with a device)."""
    try:
        if not torch.cuda.is_available():
            return False
        nvtx = torch.cuda.nvtx
        return hasattr(nvtx, "range_push") and hasattr(nvtx, "range_pop")
    except Exception:  # pragma: no cover - broken CUDA setups
        return False


def _default_enabled() -> bool:
    setting = os.environ.get(ENV_NVTX, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    return _nvtx_usable()


_ENABLED = _default_enabled()
_NULL = contextlib.nullcontext()


class _Range:
    """push on enter, pop on exit (also when the body raises)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        torch.cuda.nvtx.range_pop()
        return False


def nvtx_range(name: str):
    """A context manager marking ``name`` on the NVTX timeline, or a shared no-op (see the module doc)."""
    if not _ENABLED:
        return _NULL
    return _Range(name)


def nvtx_enabled() -> bool:
    return _ENABLED


def set_nvtx_enabled(enabled: bool) -> bool:
    """Switch the ranges on or off at run time; returns the previous setting. Turning them on has no
    effect where torch.cuda.nvtx is unusable (CPU torch, no device)."""
    global _ENABLED
    previous = _ENABLED
    _ENABLED = bool(enabled) and _nvtx_usable()
    return previous


@contextlib.contextmanager
def profiler_region(enabled: bool = True):
    """``torch.cuda.profiler.start()`` / ``stop()`` around a block: with
    ``nsys profile --capture-range=cudaProfilerApi`` only this block is recorded. A no-op on the CPU."""
    active = enabled and _nvtx_usable()
    if active:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if active:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
