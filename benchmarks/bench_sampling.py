"""Fused chain verification against a vectorised PyTorch implementation of the same algorithm and
the float64 NumPy reference, with effective bandwidth next to this machine's copy bandwidth; then a
drafter's sampled step, ops.sample_filtered (q written into a column of the [B, k, V] draft buffer and a
token drawn from it) against the torch ops it replaced (sampling.filtered_probs, sample_inverse_cdf, a copy).

    python benchmarks/bench_sampling.py [--device cuda] [--repeats 7] [--quick]

Bytes counted: target logits [B, k+1, V] and draft probs [B, k, V] read once. The fused op reads
only the positions up to the first rejection (plus one draft-prob row there), so its effective
bandwidth can exceed what it actually moved; the mean accepted length is printed beside it.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python_tests"))
sys.path.insert(0, os.path.dirname(__file__))

import reference  # noqa: E402
from _timing import copy_bandwidth_gbs, machine_description, median_times  # noqa: E402
from specdec_ext import ops  # noqa: E402
from specdec_ext.sampling import SamplingParams, filtered_probs, sample_inverse_cdf  # noqa: E402

NOISE_BETWEEN_DRAFT_AND_TARGET = 0.5  # logit noise: sets the acceptance rate near 0.8
NUMPY_MAX_ROWS = 8  # the float64 reference loops in Python: only the small configurations


def torch_chain_verify(logits, draft, q, uniforms):
    """The same algorithm with vectorised PyTorch ops (full softmax, gathers, cumprod)."""
    batch, positions, vocab = logits.shape
    k = positions - 1
    p = torch.softmax(logits.float(), dim=-1)  # [B, k+1, V]
    p_draft = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, k]
    accepted = uniforms[:, :k] * q_draft < p_draft  # [B, k]
    num_accepted = accepted.int().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(batch, device=logits.device)
    at = num_accepted.clamp(max=k)
    p_final = p[rows, at]  # [B, V]
    q_final = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, at]  # zero at the bonus position
    residual = (p_final - q_final).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    weights = torch.where(mass > 0, residual, p_final)
    cumulative = weights.cumsum(-1)
    final = (cumulative <= uniforms[:, k:] * cumulative[:, -1:]).sum(-1).clamp(max=vocab - 1)
    tokens = torch.where(torch.arange(positions, device=logits.device) < num_accepted.unsqueeze(-1),
                         torch.cat([draft, draft[:, :1]], 1), torch.full_like(draft[:, :1], -1))
    tokens[rows, num_accepted] = final
    return tokens, num_accepted


def make_inputs(batch, k, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2.0
    q = torch.softmax(logits[:, :k] + NOISE_BETWEEN_DRAFT_AND_TARGET * torch.randn(batch, k, vocab, generator=g), -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(batch, k)
    uniforms = torch.rand(batch, k + 1, generator=g)
    return [t.to(device) for t in (logits, draft, q, uniforms)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per implementation (median)")
    parser.add_argument("--quick", action="store_true", help="only B = 64, k = 4, V = 128256")
    args = parser.parse_args()
    device = torch.device(args.device)

    copy_gbs = copy_bandwidth_gbs(device)
    print(f"machine: {machine_description(device)}")
    print(f"copy bandwidth (read + write): {copy_gbs:.1f} GB/s\n")
    print("| B | k | V | mean accepted | fused ms | fused GB/s | % of copy | torch ms | fused speedup vs torch "
          "| floor ms | fused / floor | numpy ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [(64, 4, 128256)] if args.quick else [
        (b, k, v) for v in (32000, 128256) for k in (4, 8) for b in (1, 8, 64)]
    for batch, k, vocab in configs:
        logits, draft, q, uniforms = make_inputs(batch, k, vocab, device)
        fused_out = ops.chain_verify(logits, draft, q, uniforms=uniforms)
        torch_out = torch_chain_verify(logits, draft, q, uniforms)
        agree = bool(torch.equal(fused_out[1].int(), torch_out[1].int()))
        fns = {"fused": lambda: ops.chain_verify(logits, draft, q, uniforms=uniforms, check_status=False),
               "torch": lambda: torch_chain_verify(logits, draft, q, uniforms)}
        times = median_times(fns, device, args.repeats)
        numpy_ms = "-"
        if batch <= NUMPY_MAX_ROWS and device.type == "cpu":
            arrays = [t.cpu().numpy() for t in (logits, draft, q, uniforms)]
            ones = np.ones(batch)
            numpy_s = median_times({"numpy": lambda: reference.chain_verify(
                arrays[0], arrays[1], arrays[2], None, ones, 0 * ones, ones, arrays[3])}, device, 1, warmup=0)
            numpy_ms = f"{numpy_s['numpy'] * 1e3:.0f}"
        bytes_read = (logits.numel() + q.numel()) * 4
        fused_gbs = bytes_read / times["fused"] / 1e9
        floor_s = bytes_read / (copy_gbs / 2 * 1e9)  # reading alone at half the read+write copy rate
        print(f"| {batch} | {k} | {vocab} | {fused_out[1].float().mean():.2f} | {times['fused'] * 1e3:.2f} | "
              f"{fused_gbs:.1f} | {100 * fused_gbs / copy_gbs:.0f}% | {times['torch'] * 1e3:.2f} | "
              f"{times['torch'] / times['fused']:.1f}x | {floor_s * 1e3:.2f} | {times['fused'] / floor_s:.2f} | "
              f"{numpy_ms} |" + ("" if agree else " (torch version disagreed on num_accepted)"))

    draft_steps(device, args)


def draft_steps(device: torch.device, args) -> None:
    """One sampled draft step at T = 0.8 (no top-k / top-p), B rows of V, per implementation."""
    print("\ndraft step at T = 0.8 (q into column 1 of a [B, 4, V] buffer, one token per row):\n")
    print("| B | V | sample_filtered us | torch ops us | speedup | GB/s (logits read + q written) | same tokens |")
    print("|---|---|---|---|---|---|---|")
    configs = [(1, 32000)] if args.quick else [(b, v) for v in (8192, 32000, 128256) for b in (1, 16)]
    for batch, vocab in configs:
        g = torch.Generator().manual_seed(batch + vocab)
        logits = (torch.randn(batch, vocab, generator=g) * 3).to(device)
        uniforms = torch.rand(batch, 1, generator=g).to(device)
        buffer = torch.empty(batch, 4, vocab, device=device)
        tokens = torch.empty(batch, dtype=torch.int64, device=device)
        temperature = torch.full((batch,), 0.8, device=device)
        sampling = SamplingParams(temperature=0.8)

        def fused():
            return ops.sample_filtered(logits, temperature=temperature, uniforms=uniforms, out=(buffer[:, 1], tokens),
                                       check_status=False)[1]

        def torch_ops():
            q = filtered_probs(logits, sampling)
            token = sample_inverse_cdf(q, uniforms[:, 0])
            buffer[:, 1].copy_(q)
            return token

        same = bool(torch.equal(fused().clone(), torch_ops()))
        times = median_times({"fused": fused, "torch": torch_ops}, device, max(args.repeats, 50))
        gbs = batch * vocab * 8 / times["fused"] / 1e9
        print(f"| {batch} | {vocab} | {times['fused'] * 1e6:.1f} | {times['torch'] * 1e6:.1f} | "
              f"{times['torch'] / times['fused']:.1f}x | {gbs:.1f} | {same} |")


if __name__ == "__main__":
    main()
