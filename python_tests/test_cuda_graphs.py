"""CUDA-graph code path of the decode loop (cuda_graphs.StepGraph, the plan's choice, the paged
runner's static-shapes mode).

On the CPU: bucketing and padding, StepGraph's control flow (eager when disabled; warm-up, one
capture, replays, and the logged fallback when a capture fails) with a fake CUDAGraph backend, when
the plan turns graphs on (and why not), and the static-shapes runner (device-only forward / commit /
truncate) giving the same tokens as the host-mode runner, through generate() and through a loop of the
decode step functions whose steps are "replayed" by the fake backend under a guard that refuses host
syncs. On CUDA (skipped elsewhere): real graph replay gives the same tokens as eager mode.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from specdec_ext import cuda_graphs, generate, plan as plan_module
from specdec_ext.cuda_graphs import StepGraph
from specdec_ext.decode import pad_batch, prefill
from specdec_ext.step import DecodeSteps, lossless_verify
from specdec_ext.drafters import ModelDrafter
from specdec_ext.metadata import SpecDecodeMetadata
from specdec_ext.plan import bucket_size, make_plan, required_cache_len
from specdec_ext.runners import PagedModelRunner, make_runner
from specdec_ext.sampling import SamplingParams
from specdec_ext.stops import RowState
from fake_graphs import FakeBackend, NoHostSync
from test_generate_utils import noisy_copy, tiny_model

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20]]
NEW = 12


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3)


# ------------------------------------------------------------------------------ bucketing
def test_bucket_size():
    assert [bucket_size(b) for b in (1, 2, 3, 4, 5, 8, 9, 31, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 64]
    assert bucket_size(65) == 65  # past the largest bucket: its own size
    with pytest.raises(ValueError):
        bucket_size(0)


def test_pad_batch_adds_frozen_rows():
    seeds = torch.tensor([3, 4, 5])
    rows = [RowState() for _ in range(3)]
    prompts, padded_seeds, padded_rows = pad_batch(PROMPTS, seeds, rows, 4)
    assert len(prompts) == len(padded_rows) == padded_seeds.numel() == 4
    assert prompts[:3] == PROMPTS and prompts[3] == [PROMPTS[0][-1]]
    assert padded_seeds.tolist() == [3, 4, 5, 0]
    assert padded_rows[:3] == rows and not any(r.finished for r in rows)
    assert padded_rows[3].finished and padded_rows[3].finish_reason == "padding"
    same = pad_batch(PROMPTS[:2], seeds[:2], rows[:2], 2)
    assert len(same[0]) == 2  # already a bucket
    with pytest.raises(ValueError):
        pad_batch(PROMPTS, seeds, rows, 2)


# ------------------------------------------------------------------------------ StepGraph control flow
def test_step_graph_disabled_runs_eagerly():
    calls = []
    graph = StepGraph(lambda: calls.append(1), name="t", enabled=False, backend=FakeBackend())
    for _ in range(4):
        graph()
    assert len(calls) == 4 and not graph.captured and graph.backend.events == []


def test_step_graph_warmup_capture_replay():
    calls = []
    backend = FakeBackend()
    graph = StepGraph(lambda: calls.append(1), name="t", warmup=2, backend=backend)
    for _ in range(5):
        graph()
    # every call did the step's work exactly once; the capture itself ran nothing
    assert len(calls) == 5
    assert backend.events == ["warmup", "warmup", "capture", "replay", "replay", "replay"]
    assert graph.captured and graph.replays == 3


def test_step_graph_capture_failure_falls_back_and_logs_once(caplog):
    calls = []
    cuda_graphs._logged.clear()
    with caplog.at_level(logging.INFO, logger="specdec_ext"):
        graphs = [StepGraph(lambda: calls.append(1), name="verify", backend=FakeBackend(fail_capture=True))
                  for _ in range(2)]
        for graph in graphs:
            for _ in range(3):
                graph()
    assert len(calls) == 6  # warm-up, the failed capture's step (run eagerly), then eager
    assert all(not g.captured and not g.enabled for g in graphs)
    assert "operation not permitted" in graphs[0].fallback_reason
    messages = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(messages) == 1 and "verify: capture failed" in messages[0]


def test_graphs_env_switch(monkeypatch):
    monkeypatch.setenv(cuda_graphs.ENV_GRAPHS, "0")
    assert cuda_graphs.graphs_available("cuda") == (False, "SPECDEC_CUDA_GRAPHS=0")
    monkeypatch.delenv(cuda_graphs.ENV_GRAPHS)
    assert cuda_graphs.graphs_available("cpu")[0] is False


# ------------------------------------------------------------------------------ the plan decides, once
def test_the_plan_turns_graphs_on_only_for_a_fixed_chain_on_the_paged_runners(pair, monkeypatch):
    target, draft_model = pair
    kw = dict(prompt_lengths=[3, 9, 1], max_new_tokens=NEW)
    on_cpu = make_plan(target, draft_model, drafter="model", k=3, **kw)
    assert not on_cpu.cuda_graphs and on_cpu.padded_batch_size == 3
    assert "device is cpu" in on_cpu.explain() and on_cpu.target_runner == "lean"
    monkeypatch.setattr(plan_module, "graphs_available", lambda device: (True, None))
    chain = make_plan(target, draft_model, drafter="model", k=3, **kw)
    assert chain.cuda_graphs and chain.target_runner == chain.draft_runner == "paged"
    assert chain.padded_batch_size == 4 and "padded to the graph bucket 4" in chain.explain()
    default = make_plan(target, draft_model, drafter="model", **kw)  # k=None keeps the graphs: a fixed k
    assert default.cuda_graphs and default.slots == plan_module.FIXED_K and not default.adaptive
    why_off = {
        "tree": make_plan(target, draft_model, drafter="model", draft_tree=(2, 2, 4), **kw),
        "adaptive": make_plan(target, draft_model, drafter="model", k="auto", **kw),
        "host": make_plan(target, None, drafter="ngram", k=3, **kw),
        "recompute": make_plan(target, draft_model, drafter="model", k=3, runner="recompute", **kw),
    }
    assert not any(p.cuda_graphs for p in why_off.values())
    assert "tree" in dict(why_off["tree"].reasons)["cuda graphs"]
    assert "adaptive" in dict(why_off["adaptive"].reasons)["cuda graphs"]
    assert "on the host" in dict(why_off["host"].reasons)["cuda graphs"]
    assert "syncs with the host" in dict(why_off["recompute"].reasons)["cuda graphs"]
    assert make_plan(target, None, drafter="none", **kw).cuda_graphs  # plain decoding is captured too


# ------------------------------------------------------------------------------ static shapes == host mode
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_with_graphs_forced_on_a_fake_backend(pair, monkeypatch, temperature):
    """generate() with graphs forced on (fake backend): the plan pads the batch, the paged runners run in
    static-shapes mode, the steps are captured and replayed under the no-host-sync guard: the same tokens
    and stats as the host-mode paged runner without graphs."""
    target, draft_model = pair
    kwargs = dict(max_new_tokens=NEW, k=3, temperature=temperature, seed=[1, 2, 3], eos_token_id=False,
                  runner="paged")
    reference = generate(PROMPTS, target, draft_model, **kwargs)
    assert not reference.plan.cuda_graphs
    backend = FakeBackend()
    monkeypatch.setattr(plan_module, "graphs_available", lambda device: (True, None))
    monkeypatch.setattr(cuda_graphs, "_CudaBackend", lambda: backend)
    result = generate(PROMPTS, target, draft_model, **kwargs)
    assert result.plan.cuda_graphs and result.plan.padded_batch_size == 4
    assert backend.events.count("capture") == 3 and "replay" in backend.events
    assert result.token_ids == reference.token_ids
    assert result.finish_reasons == reference.finish_reasons
    assert result.stats.new_tokens == reference.stats.new_tokens
    assert result.stats.batch_size == 3 and result.stats.steps == reference.stats.steps


def run_loop(target_model, draft_model, prompts, *, k, sampling, seeds, device, static, graphs, backend=None,
             pad=True):
    """The decode step functions with DecodeSteps, fixed NEW tokens (no EOS), padded to a bucket.
    Returns (tokens per real row, steps)."""
    real = len(prompts)
    rows = [RowState() for _ in range(real)]
    S = required_cache_len(max(len(p) for p in prompts), NEW, k)
    B = bucket_size(real) if pad else real

    def runner(model, **sizes):
        return make_runner("paged", model, static_shapes=static, **sizes)

    target = runner(target_model, max_batch_size=B, max_seq_len=S)
    drafter = None if draft_model is None else ModelDrafter(draft_model, lambda **kw: runner(draft_model, **kw),
                                                            k=k, vocab_size=96)
    prompts, seeds, rows = pad_batch(prompts, seeds.to(device), rows, B)
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=k, max_seq_len=S, sampling=sampling, seeds=seeds)
    prefill(target, drafter, prompts, meta)
    first = meta.token_buffer.gather(1, meta.prompt_lens[:, None])[:, 0].tolist()
    out = [[first[b]] for b in range(real)]
    steps = DecodeSteps(target, drafter, meta, lossless_verify, graphs=graphs, backend=backend)
    step = 1
    while min(len(t) for t in out) < NEW:
        meta.active.copy_(torch.tensor([b < real and len(out[b]) < NEW for b in range(B)]))
        meta.set_step(step)
        steps.draft()
        steps.verify()
        accepted = steps.verdict.num_accepted.tolist()
        emitted = steps.verdict.tokens.tolist()
        steps.commit()
        for b in range(real):
            if len(out[b]) < NEW:
                out[b].extend(emitted[b][: accepted[b] + 1][: NEW - len(out[b])])
        step += 1
    return out, steps


@pytest.mark.parametrize("k, temperature", [(3, 0.0), (2, 1.0), (0, 1.0)])
def test_fake_graph_replay_of_static_steps_matches_generate(pair, k, temperature):
    """Static-shapes runners + padded batch + steps 'replayed' by the fake backend == generate() on the
    host-mode runner (k = 0: plain decoding)."""
    target, draft_model = pair
    draft_model = draft_model if k else None
    seeds = torch.tensor([1, 2, 3])
    sampling = SamplingParams(temperature=temperature)
    backend = FakeBackend()
    out, steps = run_loop(target, draft_model, PROMPTS, k=k, sampling=sampling, seeds=seeds,
                          device=torch.device("cpu"), static=True, graphs=True, backend=backend)
    expected_captured = {"draft": k > 0, "verify": True, "commit": True}
    assert steps.captured == expected_captured
    assert backend.events.count("capture") == sum(expected_captured.values())
    if k:
        reference = generate(PROMPTS, target, draft_model, max_new_tokens=NEW, k=k, temperature=temperature,
                             seed=seeds.tolist(), eos_token_id=False, runner="paged").token_ids
    else:
        from specdec_ext.generate import plain_generate
        reference = plain_generate(PROMPTS, target, max_new_tokens=NEW, temperature=temperature,
                                   seed=seeds.tolist(), eos_token_id=False, runner="paged").token_ids
    assert out == reference


def test_no_host_sync_guard_catches_the_host_mode_runner(pair):
    """The guard of the fake replay does catch a step that reads the host (the host-mode paged runner)."""
    target, _ = pair
    runner = PagedModelRunner(target, max_batch_size=1, max_seq_len=16)
    runner.start([[1, 2]])
    with pytest.raises(RuntimeError, match="host sync or host data"), NoHostSync():
        runner.forward(torch.tensor([[3]]), torch.tensor([1]))


def test_static_shapes_runner_sync_host_restores_host_bookkeeping(pair):
    target, _ = pair
    runner = PagedModelRunner(target, max_batch_size=2, max_seq_len=40, static_shapes=True)
    runner.start([[1, 2, 3], [4]])
    assert runner.kv.num_free_pages == 0  # every row owns all its pages
    ids, counts = torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 1])
    with NoHostSync():  # the chain step is device work only
        runner.forward(ids, counts)
        runner.commit(counts)
    assert runner.lengths.tolist() == [5, 2]
    runner.truncate(torch.tensor([4, 9]))  # never grows a row
    assert runner.lengths.tolist() == [4, 2]
    runner.sync_host()
    assert runner.kv.host_lengths()[:2] == [4, 2]
    runner.kv.check_invariants()
    with pytest.raises(ValueError, match="static_shapes needs every row to own all its pages"):
        PagedModelRunner(target, max_batch_size=2, max_seq_len=40, num_pages=3, static_shapes=True)


def test_static_shapes_logits_match_the_host_mode(pair):
    target, _ = pair
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    ids, counts = torch.tensor([[9, 10, 11], [12, 13, 14]]), torch.tensor([3, 2])
    host = PagedModelRunner(target, max_batch_size=2, max_seq_len=40)
    static = PagedModelRunner(target, max_batch_size=2, max_seq_len=40, static_shapes=True)
    for runner in (host, static):
        runner.start(prompts)
    a, b = host.forward(ids, counts), static.forward(ids, counts)
    torch.testing.assert_close(b[0], a[0])
    torch.testing.assert_close(b[1, :2], a[1, :2])  # row 1's third column is padding


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k, temperature", [(3, 0.0), (3, 1.0), (0, 1.0)])
def test_cuda_graph_replay_equals_eager(pair, k, temperature):
    target, draft_model = (copy.deepcopy(m).to("cuda") for m in pair)  # the fixture stays on the CPU
    draft_model = draft_model if k else None
    seeds = torch.tensor([1, 2, 3])
    sampling = SamplingParams(temperature=temperature)
    kwargs = dict(k=k, sampling=sampling, seeds=seeds, device=torch.device("cuda"))
    graphed, steps = run_loop(target, draft_model, PROMPTS, static=True, graphs=True, **kwargs)
    assert steps.captured == {"draft": k > 0, "verify": True, "commit": True}, [
        g.fallback_reason for g in (steps.draft, steps.verify, steps.commit)]
    eager, _ = run_loop(target, draft_model, PROMPTS, static=True, graphs=False, **kwargs)
    assert graphed == eager
    host, _ = run_loop(target, draft_model, PROMPTS, static=False, graphs=False, pad=False, **kwargs)
    assert graphed == host
