"""The drafter interface (the package docstring, specdec_ext/drafters/__init__.py, describes it)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..metadata import Proposal, SpecDecodeMetadata, Verdict


class Drafter:
    """Base class of the drafter interface (see the module docstring)."""

    slots: int  # draft slots per step: a chain's k, a tree's N nodes
    is_tree: bool = False  # proposals carry tree parents
    model: Optional[torch.nn.Module] = None  # the draft model, if any (adaptive k keys its costs by it)
    device_steps: bool = False  # reserve_step / sync_host: a step runs on the device (serving under graphs)
    # serving: a row may join with a one-token stand-in and be started with its committed tokens when it
    # first drafts (start_rows needs nothing but token ids)
    deferrable_start: bool = False
    # prefill_window: a first look at a prompt may prefill its last tokens only (adaptive k, decode.py)
    windowed_prefill: bool = False

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError

    def prefill_window(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata, window: int) -> None:
        """``prefill`` with each prompt's last ``window`` tokens (``windowed_prefill`` drafters)."""
        raise NotImplementedError(f"{type(self).__name__} has no windowed prefill")

    def propose(self, meta: SpecDecodeMetadata, budget: Optional[Sequence[int]] = None) -> Proposal:
        raise NotImplementedError

    def skip(self, meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support adaptive k (skip)")

    def catch_up(self, meta: SpecDecodeMetadata) -> None:
        """Serving under CUDA graphs, between steps (host mode): after skipped steps, take in what was
        committed meanwhile, so that the next draft pass has the shapes its capture has (nothing to do by
        default: a drafter without device steps is not captured)."""

    def commit(self, meta: SpecDecodeMetadata, verdict: Verdict) -> None:
        raise NotImplementedError

    def start_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support continuous batching (start_rows)")

    def free_rows(self, rows: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support continuous batching (free_rows)")

    def checkpoint(self) -> Optional[Callable[[], None]]:
        """An undo for the cost probes' proposals, or None (nothing worth timing)."""
        return None

    def close(self) -> None:
        """Release what the drafter holds on the models (nothing by default)."""

    def reserve_step(self, width: int) -> None:
        """Device steps (``device_steps``): reserve what one step over rows 0..width-1 writes."""
        raise NotImplementedError(f"{type(self).__name__} proposes on the host (no device steps)")

    def sync_host(self) -> None:
        """Device steps: after the step, hand the lengths back to the host."""
        raise NotImplementedError(f"{type(self).__name__} proposes on the host (no device steps)")
