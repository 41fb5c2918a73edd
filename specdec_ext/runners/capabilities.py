"""What a runner can do beyond the ``ModelRunner`` contract, declared so that the plan can see it.

A runner class states its optional methods as one ``RunnerCapabilities`` value; ``capabilities_of`` gives
the value a runner of a given kind will have over a given model before it is built, so ``make_plan``
resolves it into plan fields that ``explain()`` prints. The loop, the drafters and the server branch on
those plan fields, never on ``hasattr``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerCapabilities:
    """Optional runner methods (runners/__init__.py lists which plan field uses each)."""

    greedy_chain: bool = False  # greedy_chain(tokens, steps, ...): n greedy one-token passes in one call
    device_steps: bool = False  # reserve_step(width, tokens) / sync_host(): one step runs on the device
    chunked_prefill: bool = False  # extend_rows(rows, chunks): a prompt prefilled in chunks between steps
    hidden_taps: bool = False  # tapped_states(positions): chosen layers' hidden states per committed token
    #                            (built with hidden_taps=...: EAGLE-3's features, runners/taps.py)

    def describe(self) -> str:
        names = [name for name, on in (("greedy chains", self.greedy_chain), ("device steps", self.device_steps),
                                       ("chunked prefill", self.chunked_prefill),
                                       ("hidden-state taps", self.hidden_taps)) if on]
        return ", ".join(names) if names else "none"
