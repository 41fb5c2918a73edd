#!/usr/bin/env python
"""The projections of one pass of the bundled target (6 layers of q/k/v, o, gate/up, down, and the
LM head: 44.6 MB of bf16 weights) at M = 1, 4, 9, 16 rows (``--rows``): torch's routes against our fused_linear
(issue 18). Each route streams its own copy of the weights, routes interleaved, medians; GB/s counts
the weight bytes once per pass. Copy bandwidth measured in the same run. Results: BENCHMARKS.md."""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import copy_bandwidth_gbs, median_times  # noqa: E402

SHAPES = {"qkv": (1536, 512, 6), "o": (512, 512, 6), "gate_up": (2560, 512, 6), "down": (512, 1280, 6),
          "head": (8192, 512, 1)}  # (N, K, count)


def routes(M: int):
    fns = {}
    w32 = {k: [torch.randn(n, kk) * 0.02 for _ in range(c)] for k, (n, kk, c) in SHAPES.items()}
    x32 = {k: torch.randn(M, kk) for k, (n, kk, c) in SHAPES.items()}
    w16 = {k: [w.bfloat16() for w in ws] for k, ws in w32.items()}
    x16 = {k: x.bfloat16() for k, x in x32.items()}
    packed = {k: [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws] for k, ws in w16.items()}
    ours = {k: [w.clone() for w in ws] for k, ws in w16.items()}
    outs = {k: torch.empty(M, n) for k, (n, kk, c) in SHAPES.items()}
    linear = torch.ops.specdec_ext.fused_linear.default
    fns["torch F.linear bf16"] = lambda: [F.linear(x16[k], w) for k in SHAPES for w in w16[k]]
    fns["torch F.linear fp32 (MKL)"] = lambda: [F.linear(x32[k], w) for k in SHAPES for w in w32[k]]
    fns["oneDNN prepacked bf16"] = lambda: [torch.ops.mkldnn._linear_pointwise(x16[k], w, None, "none", [], "")
                                            for k in SHAPES for w in packed[k]]
    fns["ours fused_linear bf16"] = lambda: [linear(x32[k], None, 0.0, [w], [], "store", True, [outs[k]])
                                             for k in SHAPES for w in ours[k]]
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=lambda text: [int(m) for m in text.split(",")], default=[1, 4, 9, 16],
                        help="row counts M (a verification pass of k drafts is M = k + 1 rows)")
    parser.add_argument("--routes", default=None,
                        help="comma-separated route names to time (default: all), e.g. 'ours fused_linear bf16'")
    args = parser.parse_args()
    import specdec_ext  # noqa: F401  (registers the ops)

    bf16_bytes = sum(n * k * c * 2 for n, k, c in SHAPES.values())
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"threads={threads} load average {os.getloadavg()[0]:.2f} copy bandwidth "
              f"{copy_bandwidth_gbs(torch.device('cpu')):.1f} GB/s; weights {bf16_bytes / 1e6:.1f} MB in bf16")
        for M in args.rows:
            chosen = {name: fn for name, fn in routes(M).items()
                      if args.routes is None or name in args.routes.split(",")}
            times = median_times(chosen, torch.device("cpu"), args.repeats, warmup=2)
            for name, s in times.items():
                size = bf16_bytes * (2 if "fp32" in name else 1)
                print(f"  M={M:2d} {name:28s} {s * 1e3:7.3f} ms {size / s / 1e9:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
