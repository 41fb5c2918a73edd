"""What the tests of the lean-forward ops share: the CPU kernels' instruction-set paths this machine
runs, a fixture that forces each in turn (SPECDEC_CPU_ISA), random token trees. (No tests here.)"""
from __future__ import annotations

import os
import platform

import pytest
import torch

from specdec_ext import ops

# each includes the one before it
ALL_ISAS = (["portable", "neon"] if platform.machine() in ("aarch64", "arm64")
            else ["portable", "avx2", "avx512bf16", "amxbf16"])


def supported_isas():
    saved = os.environ.pop("SPECDEC_CPU_ISA", None)
    try:
        best = ops.cpu_isa()
    finally:
        if saved is not None:
            os.environ["SPECDEC_CPU_ISA"] = saved
    return ALL_ISAS[: ALL_ISAS.index(best) + 1]


ISAS = supported_isas()


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ISA", request.param)
    assert ops.cpu_isa() == request.param
    return request.param


def random_trees(rng, B: int, T: int):
    """B random topological trees of T tokens (token 0 the root, each later token a child of an earlier
    one): visible [B, T, T] bool (a token sees itself and its ancestors) and depth [B, T] int64."""
    visible = torch.zeros((B, T, T), dtype=torch.bool)
    depth = torch.zeros((B, T), dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            visible[b, t, t] = True
            if t:
                parent = int(rng.integers(0, t))
                visible[b, t] |= visible[b, parent]
                depth[b, t] = depth[b, parent] + 1
    return visible, depth
