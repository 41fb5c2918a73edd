"""Benchmarks of the paged KV cache (prints tables; no assertions).

1. kv_write vs an index_copy_-based PyTorch scatter, and kv_compact vs an index_select +
   index_copy_ PyTorch version: median time and effective GB/s (bytes read + written).
2. One decode step (1 new token per row) of a small Llama through PagedModelRunner (paged
   attention: kv_write + batched page gather + SDPA with a float mask) against HF's own
   DynamicCache forward, for B in {1, 8}.

Usage: python benchmarks/bench_kv.py [--quick] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec_ext import ops


def timeit(fn, *, warmup=3, repeat=20, device="cpu"):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_ops(device, quick):
    print("\n## kv_write / kv_compact vs PyTorch index_copy_ (median; GB/s = bytes read+written / time)")
    print(f"{'op':<11}{'dtype':<10}{'tokens':>7}{'H x D':>9}{'ours us':>10}{'torch us':>10}{'ours GB/s':>11}{'torch GB/s':>11}")
    heads, head_dim, page_size, num_pages = 8, 128, 16, 512
    repeat = 10 if quick else 30
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.tensor([], dtype=dtype).element_size()
        pool = torch.zeros(2, num_pages, page_size, heads, head_dim, dtype=dtype, device=device)
        for batch, tokens in ((8, 6), (4, 256)):
            key = torch.randn(batch, heads, tokens, head_dim, device=device).to(dtype).transpose(1, 2)
            value = torch.randn(batch, heads, tokens, head_dim, device=device).to(dtype).transpose(1, 2)
            slots = torch.randperm(num_pages * page_size, device=device)[: batch * tokens].view(batch, tokens)
            flat_slots = slots.reshape(-1)
            flat_pool = pool.view(2, num_pages * page_size, heads, head_dim)

            def ours():
                ops.kv_write(key, value, slots, pool)

            def torch_version():
                flat_pool[0].index_copy_(0, flat_slots, key.reshape(-1, heads, head_dim))
                flat_pool[1].index_copy_(0, flat_slots, value.reshape(-1, heads, head_dim))

            t_ours = timeit(ours, repeat=repeat, device=device)
            t_torch = timeit(torch_version, repeat=repeat, device=device)
            nbytes = 2 * 2 * batch * tokens * heads * head_dim * es
            print(f"{'kv_write':<11}{str(dtype)[6:]:<10}{batch * tokens:>7}{f'{heads}x{head_dim}':>9}"
                  f"{t_ours * 1e6:>10.1f}{t_torch * 1e6:>10.1f}{nbytes / t_ours / 1e9:>11.2f}{nbytes / t_torch / 1e9:>11.2f}")
        # kv_compact: 8 rows, 5 accepted nodes each, all layers of a 4-layer pool at once.
        layers, batch, accepted = 4, 8, 5
        big = torch.zeros(2 * layers, num_pages, page_size, heads, head_dim, dtype=dtype, device=device)
        pages_per_row = 8
        tables = torch.randperm(num_pages, device=device)[: batch * pages_per_row].view(batch, pages_per_row).int()
        base = torch.randint(10, 100, (batch,), device=device)
        offsets = torch.stack([torch.sort(torch.randperm(12, device=device)[:accepted]).values for _ in range(batch)])
        src = base.unsqueeze(1) + 1 + offsets                       # [B, N] increasing storage positions
        dst = base + 1
        dst_pos = dst.unsqueeze(1) + torch.arange(accepted, device=device)

        def slots_of(pos):
            return (tables.long().gather(1, pos // page_size) * page_size + pos % page_size).reshape(-1)

        src_slots, dst_slots = slots_of(src), slots_of(dst_pos)
        flat_big = big.view(2 * layers, num_pages * page_size, heads * head_dim)

        def ours_compact():
            ops.kv_compact(big, tables, src, dst)

        def torch_compact():
            flat_big.index_copy_(1, dst_slots, flat_big.index_select(1, src_slots))

        t_ours = timeit(ours_compact, repeat=repeat, device=device)
        t_torch = timeit(torch_compact, repeat=repeat, device=device)
        nbytes = 2 * 2 * layers * batch * accepted * heads * head_dim * es
        print(f"{'kv_compact':<11}{str(dtype)[6:]:<10}{batch * accepted:>7}{f'{heads}x{head_dim}':>9}"
              f"{t_ours * 1e6:>10.1f}{t_torch * 1e6:>10.1f}{nbytes / t_ours / 1e9:>11.2f}{nbytes / t_torch / 1e9:>11.2f}"
              f"   ({layers} layers x K,V in one call)")


def bench_decode(device, quick):
    import transformers
    from transformers import DynamicCache

    from specdec_ext.runners import PagedModelRunner
    from specdec_ext.runners.hf_paged import cache_argument_name

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    context, steps = 128, (8 if quick else 24)
    print(f"\n## decode step, small Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 1000), "
          f"context {context}, fp32, median over {steps} steps")
    print(f"{'B':>3}{'paged ms/step':>15}{'HF DynamicCache ms/step':>25}{'ratio':>8}")
    for batch in (1, 8):
        model_hf = transformers.LlamaForCausalLM(cfg).eval().to(device)
        model_hf.set_attn_implementation("sdpa")
        arg = cache_argument_name(model_hf)
        model_paged = transformers.LlamaForCausalLM(cfg).eval().to(device)
        model_paged.load_state_dict(model_hf.state_dict())
        runner = PagedModelRunner(model_paged, max_batch_size=batch, max_seq_len=context + steps + 8, page_size=16)
        prompts = torch.randint(0, 1000, (batch, context), device=device)
        ones = torch.ones(batch, dtype=torch.int64)

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        # Steps of the two interleave, so that a loaded machine slows both alike.
        with torch.no_grad():
            cache = DynamicCache(config=cfg)
            out = model_hf(prompts, use_cache=True, **{arg: cache})
            nxt_hf = out.logits[:, -1:].argmax(-1)
            nxt = runner.start(prompts.tolist()).argmax(-1, keepdim=True)
            t_hf, t_paged = [], []
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                out = model_hf(nxt_hf, use_cache=True, **{arg: cache})
                nxt_hf = out.logits[:, -1:].argmax(-1)
                sync()
                t1 = time.perf_counter()
                logits = runner.forward(nxt)
                runner.commit(ones)
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                sync()
                t2 = time.perf_counter()
                t_hf.append(t1 - t0)
                t_paged.append(t2 - t1)
        hf, paged = statistics.median(t_hf[2:]), statistics.median(t_paged[2:])
        print(f"{batch:>3}{paged * 1e3:>15.2f}{hf * 1e3:>25.2f}{paged / hf:>8.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    bench_ops(args.device, args.quick)
    bench_decode(args.device, args.quick)


if __name__ == "__main__":
    main()
