"""A fake CUDA-graph backend for the CPU (cuda_graphs.StepGraph's ``backend``): what the graph tests of
the decode loop and of the serving batcher use to run captured steps without a GPU.

A real replay runs the kernels the capture recorded, whatever the Python around them would do now; the
fake one re-runs the step's Python. So each replay here is traced (every torch call: its name, its
tensors' shapes and dtypes, its host values) and must trace what the graph's first replay traced: a
step whose Python would take another path, another shape or another host value at a later replay (state
read from the host, a draft feed as wide as the steps skipped) is a step a real graph would run wrongly."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class NoHostSync(TorchFunctionMode):
    """Raises on the tensor calls that would read device values on the host (a sync, which a CUDA
    graph capture refuses): what a captured step must never do. ``trace`` (a list) gets each call's
    signature (``signature``)."""

    BANNED = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
              "tensor", "as_tensor", "from_numpy"}  # the last three: host data copied in (baked in a graph)

    def __init__(self, trace=None):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.BANNED:
            raise RuntimeError(f"host sync or host data inside a captured step: {name}")
        if self.trace is not None:
            self.trace.append((getattr(func, "__qualname__", name), signature(args), signature(kwargs or {})))
        return func(*args, **(kwargs or {}))


def signature(value):
    """What a captured kernel call bakes in: tensors by shape and dtype (their values are read at replay),
    host values (ints, floats, flags, strings) as they are."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, signature(v)) for k, v in value.items())
    if isinstance(value, float) and value != value:
        return "nan"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return type(value).__name__


class FakeBackend:
    """Stands in for torch.cuda on the CPU: warm-up runs fn, capture records it WITHOUT running it (as
    a real capture runs no kernel), replay runs the recorded fn under NoHostSync and checks that it
    traced what the graph's first replay traced (the module docstring)."""

    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.events = []
        # id(graph) -> (graph, the trace of its first replay); the graph is held so that its id is never
        # reused by a later graph (a freed k = 3 step's id given to a k = 4 one failed a test at random)
        self.traces = {}

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
        trace = []
        with NoHostSync(trace):
            graph()
        first = self.traces.setdefault(id(graph), (graph, trace))[1]
        if trace != first:
            at = next((i for i, (a, b) in enumerate(zip(first, trace)) if a != b), min(len(first), len(trace)))
            raise AssertionError(f"a replay of {getattr(graph, '__qualname__', graph)} ran other calls than its "
                                 f"first replay (what a real graph would run) from call {at}: "
                                 f"{first[at: at + 1]} then, now {trace[at: at + 1]}")
