"""TPOT of the decode loop: eager vs CUDA graphs, plain vs speculative, and the verify cost of k+1 tokens.

    python benchmarks/bench_tpot.py [--device cuda] [--quick] [--no-1b] [--steps 48] [--nsys]

Two models:
* the bundled pair (specdec_ext.default_pair; target 6 x 512, draft distilled from it), bf16 on CUDA,
  prompts cut from this repository's Python source (the pair's domain);
* a random-weight Llama of about 1B parameters in bf16 (hidden 2048, 16 layers, 32 heads / 8 KV heads,
  intermediate 8192, vocab 32000; CUDA only, or a tiny stand-in with --device cpu).

Modes, all over the decode step functions of specdec_ext/decode.py (prefill, then `--steps` fixed
steps; no EOS):
* eager-host   PagedModelRunner (host bookkeeping per step, attention over the pages in use): what the
               loop runs without graphs;
* eager-static StaticPagedRunner (device-only steps, attention over all pages of a row), no capture;
* graphs       the same steps captured in CUDA graphs (step.DecodeSteps over cuda_graphs.StepGraph) and replayed.
The first WARM steps of each run (warm-up and capture) are not timed. TPOT = timed seconds / tokens
emitted per row over the timed steps (a row's tokens per step: accepted + 1). "same" says whether the
graph run emitted exactly the tokens of the eager-static run (same kernels: must be yes).

Verify cost (1B model): one target forward over k+1 tokens vs one token per row (with chain_verify),
B = 1, 8, 32, context --context tokens, eager-static and graph replay; medians of CUDA-event timings.

--nsys wraps the timed steps in torch.cuda.profiler start/stop and NVTX ranges (docs/profiling.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _timing import machine_description, median_times  # noqa: E402
from specdec_ext import ops  # noqa: E402
from specdec_ext.cuda_graphs import StepGraph, graphs_available  # noqa: E402
from specdec_ext.decode import prefill  # noqa: E402
from specdec_ext.step import DecodeSteps, lossless_verify  # noqa: E402
from specdec_ext.drafters import ModelDrafter  # noqa: E402
from specdec_ext.metadata import SpecDecodeMetadata  # noqa: E402
from specdec_ext.plan import required_cache_len  # noqa: E402
from specdec_ext.profiling import nvtx_range  # noqa: E402
from specdec_ext.runners import make_runner  # noqa: E402
from specdec_ext.sampling import SamplingParams  # noqa: E402

WARM = 2  # untimed steps per run: the graph warm-up and the capture
ROWS: List[List[str]] = []  # the final table


def row(*cells) -> None:
    ROWS.append([str(c) for c in cells])
    print("  " + " | ".join(str(c) for c in cells), flush=True)


@dataclass
class RunResult:
    seconds: float  # timed steps
    tokens_per_row: float  # tokens emitted per row over the timed steps
    tokens: List[List[int]]  # every emitted token per row (all steps)
    captured: dict

    @property
    def tpot_ms(self) -> float:
        return 1e3 * self.seconds / max(self.tokens_per_row, 1e-9)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_decode(target_model, draft_model, prompts, *, k: int, steps: int, mode: str, device, vocab: int,
               sampling: SamplingParams, nsys: bool = False) -> RunResult:
    """prefill + ``steps`` fixed decode steps of the loop (decode.py's step functions)."""
    B = len(prompts)

    def factory(model, **sizes):
        return make_runner("paged", model, static_shapes=mode != "eager-host", **sizes)

    S = required_cache_len(max(len(p) for p in prompts), steps * (k + 1), k)
    target = factory(target_model, max_batch_size=B, max_seq_len=S)
    drafter = None if k == 0 else ModelDrafter(draft_model, lambda **sizes: factory(draft_model, **sizes), k=k,
                                               vocab_size=vocab)
    seeds = torch.arange(1, B + 1, dtype=torch.int64, device=device)
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=k, max_seq_len=S, sampling=sampling, seeds=seeds)
    prefill(target, drafter, prompts, meta)
    use_graphs = mode == "graphs" and device.type == "cuda"
    loop = DecodeSteps(target, drafter, meta, lossless_verify, graphs=use_graphs)
    out = [[t] for t in meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0].tolist()]
    timed, timed_tokens = 0.0, 0
    profile = nsys and device.type == "cuda"
    for step in range(1, steps + 1):
        if profile and step == WARM + 1:
            sync(device)
            torch.cuda.profiler.start()  # nsys --capture-range=cudaProfilerApi records from here
        sync(device)
        begin = time.perf_counter()
        meta.set_step(step)
        with nvtx_range("draft"):
            loop.draft()
        with nvtx_range("verify"):
            loop.verify()
        accepted = loop.verdict.num_accepted.tolist()
        emitted = loop.verdict.tokens.tolist()
        with nvtx_range("commit"):
            loop.commit()
        sync(device)
        if step > WARM:
            timed += time.perf_counter() - begin
            timed_tokens += sum(a + 1 for a in accepted)
        for b in range(B):
            out[b].extend(emitted[b][: accepted[b] + 1])
    if profile:
        sync(device)
        torch.cuda.profiler.stop()
    return RunResult(timed, timed_tokens / B, out, loop.captured)


def bench_decode(name, target_model, draft_model, prompts, *, ks, steps, device, vocab, modes, nsys):
    # T = 1 with the same seeds in every mode: tokens comparable across modes (the bundled pair degenerates
    # to one repeated token under greedy decoding from these prompts, which would mean 100% acceptance)
    sampling = SamplingParams(temperature=1.0)
    for k in ks:
        if k and draft_model is None:
            continue
        results = {}
        for mode in modes:
            try:
                results[mode] = run_decode(target_model, draft_model, prompts, k=k, steps=steps, mode=mode,
                                           device=device, vocab=vocab, sampling=sampling, nsys=nsys)
            except Exception as error:  # keep the table going
                print(f"  {name} k={k} {mode}: FAILED {type(error).__name__}: {error}", flush=True)
        base = results.get("eager-host")
        cells = [name, "plain" if k == 0 else f"spec k={k}", len(prompts)]
        for mode in ("eager-host", "eager-static", "graphs"):
            cells.append(f"{results[mode].tpot_ms:.3f}" if mode in results else "-")
        graphs, static = results.get("graphs"), results.get("eager-static")
        cells.append(f"{base.tpot_ms / graphs.tpot_ms:.2f}x" if base and graphs else "-")
        any_run = next(iter(results.values()), None)
        cells.append(f"{any_run.tokens_per_row / max(steps - WARM, 1):.2f}" if any_run else "-")
        same = "-" if not (graphs and static) else ("yes" if graphs.tokens == static.tokens else "NO")
        captured = "" if not graphs else ",".join(s for s, c in graphs.captured.items() if c) or "none"
        cells.append(f"{same} (captured: {captured})" if graphs else same)
        row(*cells)


def bench_verify_cost(name, model, *, batches, k, context, device, vocab, repeats):
    """Target forward over k+1 tokens + chain_verify vs 1 token, per batch size; eager-static and graphs."""
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, vocab, (B, context), generator=g).tolist()
        runner = make_runner("paged", model, max_batch_size=B, max_seq_len=context + 2 * (k + 1) + 16,
                             static_shapes=True)
        runner.start(prompts)
        times = {}
        for T in (1, k + 1):
            ids = torch.randint(0, vocab, (B, T), generator=g).to(device)
            num = torch.full((B,), T, dtype=torch.int64, device=device)
            drafts = ids[:, 1:].contiguous()
            tokens = torch.empty((B, T), dtype=torch.int64, device=device)
            accepted = torch.empty((B,), dtype=torch.int32, device=device)
            seed = torch.ones(B, dtype=torch.int64, device=device)

            def step(ids=ids, num=num, drafts=drafts, tokens=tokens, accepted=accepted):
                logits = runner.forward(ids, num)  # tentative: each call overwrites the same slots
                ops.chain_verify(logits, drafts, None, temperature=0.0, seed=seed, offset=seed,
                                 out=(tokens, accepted), check_status=False)

            graph = StepGraph(step, name=f"verify{T}", enabled=device.type == "cuda")
            for _ in range(WARM):
                graph()
            fns = {f"eager{T}": step}
            if graph.captured:
                fns[f"graph{T}"] = graph
            times.update(median_times(fns, device, repeats))
        for mode in ("eager", "graph"):
            one, many = times.get(f"{mode}1"), times.get(f"{mode}{k + 1}")
            if one is None or many is None:
                continue
            row(name, f"verify {k + 1} vs 1 tok ({mode})", B, f"{one * 1e3:.3f}", f"{many * 1e3:.3f}", "",
                f"{many / one:.2f}x", "")
        runner.sync_host()


def llama_1b(device, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
    else:
        config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    return model, config.vocab_size, params


def source_prompts(tokenizer, batch: int, length: int) -> List[List[int]]:
    """``batch`` prompts of ``length`` tokens, each the start of a function of this repository's source."""
    root = os.path.join(os.path.dirname(__file__), "..", "specdec_ext")
    starts = []
    for name in ("decode.py", "runners/paged.py", "runners/kv_cache.py", "runners/hf_paged.py", "metadata.py"):
        with open(os.path.join(root, name)) as f:
            text = f.read()
        starts += [text[i + 1:] for i in range(len(text)) if text.startswith("\n    def ", i) or text.startswith("\ndef ", i)]
    prompts = []
    for b in range(batch):
        ids = tokenizer(starts[(7 * b) % len(starts)][: 8 * length])["input_ids"]
        prompts.append(ids[:length])
    return prompts


def main(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer steps and configurations (CPU smoke test)")
    parser.add_argument("--no-1b", action="store_true", help="skip the 1B random-weight Llama")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per run (first %d untimed)" % WARM)
    parser.add_argument("--k", type=int, default=4, help="draft length of the speculative runs and the verify cost")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per row for the 1B verify cost")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats of the verify-cost steps")
    parser.add_argument("--nsys", action="store_true", help="cudaProfilerApi range + NVTX around timed steps")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    steps = 8 if args.quick else args.steps
    print(f"machine: {machine_description(device)}; graphs: {graphs_available(device)}", flush=True)
    header = ["model", "what", "B", "eager-host ms/tok (verify: 1 tok ms)", "eager-static ms/tok (verify: k+1 tok ms)",
              "graphs ms/tok", "eager-host / graphs (verify: k+1 / 1)", "tokens/step", "graphs tokens == eager-static"]
    modes = ["eager-host", "eager-static"] + (["graphs"] if device.type == "cuda" else [])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    try:
        from specdec_ext.default_pair import load_default_pair

        target, drafter_model, tokenizer = load_default_pair(dtype=dtype, device=device)
        vocab = target.get_output_embeddings().weight.shape[0]
        for B in ((1,) if args.quick else (1, 8)):
            prompts = source_prompts(tokenizer, B, 64)
            bench_decode("default pair", target, drafter_model, prompts, ks=(0, args.k), steps=steps, device=device,
                         vocab=vocab, modes=modes, nsys=args.nsys)
        del target, drafter_model
    except Exception as error:
        print(f"default pair: FAILED {type(error).__name__}: {error}", flush=True)

    if not args.no_1b:
        try:
            tiny = device.type != "cuda"
            model, vocab, params = llama_1b(device, tiny)
            name = f"llama {params / 1e9:.2f}B rand" if not tiny else f"llama tiny ({params / 1e6:.2f}M) rand"
            g = torch.Generator().manual_seed(0)
            for B in ((1,) if args.quick else (1, 8, 32)):
                prompts = torch.randint(0, vocab, (B, 64), generator=g).tolist()
                bench_decode(name, model, None, prompts, ks=(0,), steps=min(steps, 24), device=device, vocab=vocab,
                             modes=modes, nsys=False)
            bench_verify_cost(name, model, batches=(1,) if args.quick else (1, 8, 32), k=args.k,
                              context=32 if args.quick else args.context, device=device, vocab=vocab,
                              repeats=3 if args.quick else args.repeats)
        except Exception as error:
            print(f"1B llama: FAILED {type(error).__name__}: {error}", flush=True)

    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in ROWS:
        cells = cells + [""] * (len(header) - len(cells))
        print("| " + " | ".join(cells) + " |")
    print("\nms/tok = TPOT per row (timed step time / tokens emitted per row); verify rows: median ms of one "
          "forward + chain_verify over 1 and k+1 tokens per row, and their ratio.")


if __name__ == "__main__":
    main()
