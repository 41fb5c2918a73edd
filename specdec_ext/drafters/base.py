"""The drafter interface (the package docstring, specdec_ext/drafters/__init__.py, describes it)."""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import torch

from ..metadata import Proposal, SpecDecodeMetadata, Verdict


STAND_IN_TOKEN = 0  # the one-token prompt of a held row where a drafter holds rows by starting them


class Drafter:
    """Base class of the drafter interface (see the module docstring)."""

    slots: int  # draft slots per step: a chain's k, a tree's N nodes
    is_tree: bool = False  # proposals carry tree parents
    model: Optional[torch.nn.Module] = None  # the draft model, if any (adaptive k keys its costs by it)
    device_steps: bool = False  # reserve_step / sync_host: a step runs on the device (serving under graphs)
    # serving: a row may join held (``hold_rows``: no forward) and be started with its committed tokens when
    # it first drafts (start_rows needs nothing but token ids)
    deferrable_start: bool = False
    # prefill_window: a first look at a prompt may prefill its last tokens only (adaptive k, decode.py)
    windowed_prefill: bool = False
    # look: the greedy agreement of the drafter with committed tokens, without a verification pass
    # (adaptive k while speculation is off over greedy rows, decode.py ``DrafterPrefill.greedy_look``)
    greedy_looks: bool = False

    def prefill(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata) -> None:
        raise NotImplementedError

    def prefill_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens ``prefill`` feeds rows of ``lengths`` committed tokens (adaptive k's cost of a switch on):
        all of them by default; a draft model with a context window, its last part."""
        return sum(lengths)

    def prepare(self, meta: SpecDecodeMetadata) -> None:
        """Build what a prefill over ``meta``'s rows needs before it is timed (nothing by default; a
        draft model's runner), so that adaptive k learns the prefill's cost per token, not the build's."""

    def prefill_window(self, prompts: Sequence[Sequence[int]], meta: SpecDecodeMetadata, window: int) -> None:
        """``prefill`` with each prompt's last ``window`` tokens (``windowed_prefill`` drafters)."""
        raise NotImplementedError(f"{type(self).__name__} has no windowed prefill")

    def look(self, meta: SpecDecodeMetadata, tokens: Sequence[int]) -> List[List[bool]]:
        """Feed every committed token the drafter lacks but the pending one, the last ``tokens[b]`` of row
        b with their logits; returns per row whether the drafter's greedy token after each of those
        equals the committed token that follows it, oldest first (``greedy_looks`` drafters)."""
        raise NotImplementedError(f"{type(self).__name__} has no greedy look")

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

    def hold_rows(self, rows: Sequence[int], meta: SpecDecodeMetadata) -> None:
        """Continuous batching: the drafter spans free ``rows`` without their tokens, as it spans a free row
        inside the batch, until ``free_rows`` (a row whose prompt is still being prefilled, or whose draft
        prefill waits for the first step that drafts; ``meta`` holds each as a frozen row). By default a
        one-token stand-in prompt, for drafters whose ``start_rows`` runs no model."""
        self.start_rows(rows, [[STAND_IN_TOKEN]] * len(rows), meta)

    def free_rows(self, rows: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support continuous batching (free_rows)")

    def checkpoint(self) -> Optional[Callable[[], None]]:
        """An undo for the cost probes' proposals, or None (nothing worth timing)."""
        return None

    def close(self) -> None:
        """Release what the drafter holds on the models (nothing by default)."""

    @contextlib.contextmanager
    def running(self):
        """Around each resumption of generate()'s decode loop, on the thread that resumes it (a stream may be
        consumed on another thread than the one that made it, and streams interleave on one thread): a
        drafter with per-thread state on a shared model binds it to that thread here (nothing by default)."""
        yield

    def reserve_step(self, width: int, drafts: int) -> None:
        """Device steps (``device_steps``): reserve what one step over rows 0..width-1 drafting at most
        ``drafts`` tokens per row writes."""
        raise NotImplementedError(f"{type(self).__name__} proposes on the host (no device steps)")

    def sync_host(self) -> None:
        """Device steps: after the step, hand the lengths back to the host."""
        raise NotImplementedError(f"{type(self).__name__} proposes on the host (no device steps)")
