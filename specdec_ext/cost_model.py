"""The cost model of speculative decoding (mission note, DESIGN.md): with per-token acceptance a and k
drafted tokens per step,

    E[tokens per target pass] = (1 - a^(k+1)) / (1 - a)          (= k + 1 when a = 1)
    speedup over plain decoding = E / (v + k c)

where c is the cost of one draft forward and v the cost of one verify step (target forward over k+1
tokens plus the verifier and bookkeeping), both relative to one plain decode step of the target.

Plain arithmetic, imported by the stats (stats.py), the figures (plots.py), the audit and the benchmark.
"""
from __future__ import annotations


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens emitted per target pass (accepted + the recovered/bonus)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def predicted_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """speedup = E / (v + k c), costs relative to one plain target decode step."""
    return expected_tokens_per_pass(acceptance, k) / (verify_cost + k * draft_cost)
