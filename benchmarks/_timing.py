"""Timing helpers shared by the benchmark scripts: medians over interleaved repeats, CUDA events
on a GPU, and this machine's copy bandwidth measured in the same run."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call (CUDA events on a GPU, perf_counter on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def median_times(fns: Dict[str, Callable[[], object]], device: torch.device, repeats: int,
                 warmup: int = 1) -> Dict[str, float]:
    """Median seconds per call of each function, the functions interleaved in every repeat so that
    a slow phase of the machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_once(fn, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_bandwidth_gbs(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Effective bandwidth of a large tensor copy: (bytes read + bytes written) / time, in GB/s."""
    src = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_times({"copy": lambda: dst.copy_(src)}, device, repeats)["copy"]
    return 2 * src.numel() * 4 / seconds / 1e9


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    import os
    import platform

    from specdec_ext.ops import cpu_isa

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU path {cpu_isa()}, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
