"""A fake CUDA-graph backend for the CPU (cuda_graphs.StepGraph's ``backend``): what the graph tests of
the decode loop and of the serving batcher use to run captured steps without a GPU."""
from __future__ import annotations

from torch.overrides import TorchFunctionMode


class NoHostSync(TorchFunctionMode):
    """Raises on the tensor calls that would read device values on the host (a sync, which a CUDA
    graph capture refuses): what a captured step must never do."""

    BANNED = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
              "tensor", "as_tensor", "from_numpy"}  # the last three: host data copied in (baked in a graph)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.BANNED:
            raise RuntimeError(f"host sync or host data inside a captured step: {name}")
        return func(*args, **(kwargs or {}))


class FakeBackend:
    """Stands in for torch.cuda on the CPU: warm-up runs fn, capture records it WITHOUT running it (as
    a real capture runs no kernel), replay runs the recorded fn under NoHostSync."""

    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.events = []

    def warmup(self, fn):
        self.events.append("warmup")
        fn()

    def capture(self, fn):
        self.events.append("capture")
        if self.fail_capture:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return fn

    def replay(self, graph):
        self.events.append("replay")
        with NoHostSync():
            graph()
