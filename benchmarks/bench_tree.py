"""Benchmark of the tree ops: build_tree_mask and tree_verify (both lossless rules).

    python benchmarks/bench_tree.py [--device cpu|cuda] [--nodes 8 32 64] [--batch 1 16]
                                    [--vocab 128256] [--dtype fp32|bf16|fp16] [--repeats 20]

Prints median times over --repeats calls (after warm-up) for N in --nodes and B in --batch. On CUDA
the times come from CUDA events around each call. "GB/s" is effective bandwidth over the bytes a
verifier must read: the target logits rows it loads (one per level walked, N + 1 at most) plus, with
draft_probs, the q row of every child it tries; for build_tree_mask, parents read plus mask and
depth written. Trees are random (seeded) with about half the nodes extending the previous one, and
drafts that are the target's most likely token (p ~ 0.85) 60% of the time, so several levels get accepted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdec_ext import ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def random_parents(rng, batch, nodes):
    parents = np.empty((batch, nodes), dtype=np.int32)
    for i in range(nodes):
        uniform_parent = rng.integers(-1, i, size=batch) if i > 0 else np.full(batch, -1)
        parents[:, i] = np.where(rng.random(batch) < 0.5, i - 1, uniform_parent)
    return parents


def make_inputs(batch, nodes, vocab, dtype, device, with_probs, seed=0):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    parents = torch.from_numpy(random_parents(rng, batch, nodes))
    logits = torch.randn((batch, nodes + 1, vocab), generator=gen)
    preferred = torch.randint(0, vocab, (batch, nodes + 1, 1), generator=gen)
    logits.scatter_add_(2, preferred, torch.full(preferred.shape, 14.0))  # p(preferred) ~ 0.85
    at_parent = torch.gather(preferred[:, :, 0], 1, parents.long() + 1)
    noise = torch.randint(0, vocab, (batch, nodes), generator=gen)
    ids = torch.where(torch.rand((batch, nodes), generator=gen) < 0.6, at_parent, noise)
    q = None
    if with_probs:  # a drafter close to the target: its softmax with noise, same rows as the parents
        q = torch.softmax(logits + torch.randn(logits.shape, generator=gen), dim=-1)
        q = torch.gather(q, 1, (parents.long() + 1)[:, :, None].expand(-1, -1, vocab)).contiguous()
    return dict(logits=logits.to(dtype).to(device), ids=ids.to(device), parents=parents.to(device),
                q=None if q is None else q.to(device), seed=torch.arange(batch, device=device))


def rows_read(parents, path, num_accepted):
    """(logits rows, tried children) a verifier reads, replaying the accepted paths."""
    parents, path, num_accepted = parents.cpu().numpy(), path.cpu().numpy(), num_accepted.cpu().numpy()
    logits_rows = tried = 0
    for b in range(parents.shape[0]):
        node = -1
        for level in range(num_accepted[b] + 1):
            logits_rows += 1
            kids = np.flatnonzero(parents[b] == node)
            if level < num_accepted[b]:
                node = int(path[b, level])
                tried += int(np.searchsorted(kids, node)) + 1
            else:
                tried += len(kids)
    return logits_rows, tried


def time_call(fn, device, repeats, warmup):
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    esize = torch.empty((), dtype=dtype).element_size()

    print(f"device={device} threads={torch.get_num_threads()} dtype={args.dtype} repeats={args.repeats} (median)")
    header = f"{'op':<28} {'N':>4} {'B':>4} {'V':>7} {'time':>10} {'GB/s':>8} {'accepted':>9}"
    print(header)
    print("-" * len(header))
    for nodes in args.nodes:
        for batch in args.batch:
            parents = make_inputs(batch, nodes, 1, torch.float32, device, False)["parents"]
            mask = torch.empty((batch, nodes, nodes), dtype=torch.bool, device=device)
            depth = torch.empty((batch, nodes), dtype=torch.int32, device=device)
            seconds = time_call(lambda: ops.build_tree_mask(parents, out=(mask, depth), check_status=False),
                                device, args.repeats, args.warmup)
            nbytes = parents.numel() * 4 + mask.numel() + depth.numel() * 4
            print(f"{'build_tree_mask':<28} {nodes:>4} {batch:>4} {'-':>7} {seconds * 1e6:>8.1f}us "
                  f"{nbytes / seconds / 1e9:>8.2f} {'':>9}")
            for with_probs in (False, True):
                x = make_inputs(batch, nodes, args.vocab, dtype, device, with_probs)
                out = (torch.empty((batch, nodes), dtype=torch.int32, device=device),
                       torch.empty((batch, nodes + 1), dtype=torch.int64, device=device),
                       torch.empty((batch,), dtype=torch.int32, device=device))

                def call():
                    return ops.tree_verify(x["logits"], x["ids"], x["parents"], x["q"], seed=x["seed"],
                                           out=out, check_status=False)

                seconds = time_call(call, device, args.repeats, args.warmup)
                path, _, num_accepted = call()
                assert int(num_accepted.min()) >= 0
                logits_rows, tried = rows_read(x["parents"], path, num_accepted)
                nbytes = logits_rows * args.vocab * esize + (tried * args.vocab * 4 if with_probs else 0)
                name = "tree_verify (draft_probs)" if with_probs else "tree_verify (deterministic)"
                print(f"{name:<28} {nodes:>4} {batch:>4} {args.vocab:>7} {seconds * 1e3:>8.3f}ms "
                      f"{nbytes / seconds / 1e9:>8.2f} {float(num_accepted.float().mean()):>9.2f}")
                del x


if __name__ == "__main__":
    main()
