"""NVTX ranges (specdec_ext/profiling.py): free no-ops on a CPU-only torch, never raising; real on a GPU."""
import torch

from specdec_ext import profiling
from specdec_ext.profiling import nvtx_range, profiler_region, set_nvtx_enabled


def test_nvtx_range_is_a_noop_without_cuda():
    if torch.cuda.is_available():
        return  # on a GPU the ranges are real; the no-op path is what CPU-only torch needs
    assert not profiling.nvtx_enabled()
    first, second = nvtx_range("draft"), nvtx_range("verify")
    assert first is second  # one shared null context: no allocation on the hot path
    with nvtx_range("prefill") as value:
        assert value is None
    assert set_nvtx_enabled(True) is False
    assert not profiling.nvtx_enabled()  # cannot be forced on where torch.cuda.nvtx is unusable
    with nvtx_range("rejection_sampling"):
        pass
    with profiler_region():
        pass


def test_nvtx_range_does_not_swallow_exceptions():
    try:
        with nvtx_range("commit"):
            raise KeyError("boom")
    except KeyError:
        pass
    else:
        raise AssertionError("the exception was swallowed")


def test_env_switch_off(monkeypatch):
    monkeypatch.setenv(profiling.ENV_NVTX, "0")
    assert profiling._default_enabled() is False


def test_enabled_path_pushes_and_pops(monkeypatch):
    """The enabled path on a fake nvtx module (a CPU torch raises on the real one)."""
    calls = []

    class FakeNvtx:
        @staticmethod
        def range_push(name):
            calls.append(("push", name))

        @staticmethod
        def range_pop():
            calls.append(("pop",))

    monkeypatch.setattr(torch.cuda, "nvtx", FakeNvtx)
    monkeypatch.setattr(profiling, "_ENABLED", True)
    try:
        with nvtx_range("verify"):
            raise ValueError
    except ValueError:
        pass
    assert calls == [("push", "verify"), ("pop",)]


def test_nvtx_range_on_a_gpu_does_not_raise():
    if not torch.cuda.is_available():
        return
    with nvtx_range("verify"):
        torch.ones(1, device="cuda").add_(1)
    with profiler_region():
        pass
