"""The small CUDA cases benchmarks/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck,
synccheck): every kernel of csrc/cuda through the branches that matter (greedy, sampling, T = inf,
top-k / top-p, draft probabilities or none, two statistics chunks, every status code, trees, masks,
the KV copies, the drafter's sampled step, logits processing and its too-large error), at sizes the
tools get through in seconds, each still checked against the CPU op by the helpers of the full CUDA
tests. Inputs are made on the CPU and copied, so nearly every kernel
launched is one of ours. Runs only where torch sees a CUDA device.
"""
import numpy as np
import pytest
import torch

import test_cuda_ops as chain_cases
import test_cuda_tree as tree_cases
import test_kv_ops as kv_cases
import test_process_logits as logits_cases
from specdec_ext import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("vocab", [7, 8200], ids=["V7", "V8200"])  # 8200: two statistics chunks
def test_chain_verify(dtype, with_probs, vocab):
    batch, k = 8, 3
    case = chain_cases.make_case(vocab + k, batch, k, vocab, dtype, with_probs)  # mixed filters, greedy rows
    case["temperature"][0] = float("inf")
    case["temperature"][1] = 1e-39
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(vocab))
    cpu = chain_cases.run(case, "cpu", uniforms=uniforms)
    gpu = chain_cases.run(case, "cuda", uniforms=uniforms)
    chain_cases.assert_same(case, cpu, gpu, uniforms)
    seed, offset = torch.arange(batch) * 7919, torch.arange(batch)
    cpu = chain_cases.run(case, "cpu", seed=seed, offset=offset)
    gpu = chain_cases.run(case, "cuda", seed=seed, offset=offset)
    chain_cases.assert_same(case, cpu, gpu, ops.philox_uniforms(seed, offset, k + 1))


def test_chain_verify_status_codes():
    chain_cases.test_chain_verify_status_codes_match_cpu()
    chain_cases.test_chain_verify_draws_are_optional_for_greedy_rows_on_cuda()


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("filters", [(1.0, 0, 1.0), (1.0, 3, 0.8), (0.0, 0, 1.0), (float("inf"), 0, 0.9)],
                         ids=["t1", "top_k_top_p", "greedy", "t_inf_top_p"])
def test_tree_verify(with_probs, filters):
    c = tree_cases.make_case(np.random.default_rng(3), batch=12, nodes=6, vocab=300, dtype=torch.float32,
                             with_probs=with_probs, filters=filters)
    tree_cases.assert_cuda_matches_cpu(c, min_compared=0.5)


def test_tree_verify_status_codes():
    tree_cases.test_invalid_rows_give_the_cpu_status(True, torch.bfloat16)
    tree_cases.test_greedy_rows_need_no_draws_on_cuda()


def test_build_tree_mask():
    tree_cases.test_build_tree_mask_matches_cpu(17)
    tree_cases.test_build_tree_mask_odd_alignments(33)


def test_residual_probs_and_philox_uniforms():
    for vocab in (7, 1001):
        g = torch.Generator().manual_seed(vocab)
        p = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
        q = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
        q[1] = p[1]
        cpu = ops.residual_probs(p, q, check_values=False)
        gpu = ops.residual_probs(p.cuda(), q.cuda(), check_values=False).cpu()
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-9)
    seed, offset = torch.tensor([1, -5, 2**40]), torch.tensor([0, 7, 3])
    assert torch.equal(ops.philox_uniforms(seed.cuda(), offset.cuda(), 9).cpu(), ops.philox_uniforms(seed, offset, 9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [7, 8200], ids=["V7", "V8200"])
def test_sample_filtered(dtype, vocab):
    chain_cases.test_sample_filtered_matches_cpu(dtype, vocab)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_process_logits(tree):
    rng = np.random.default_rng(5)
    logits_cases.assert_cuda_matches_cpu(logits_cases.make_case(rng, batch=3, n=6, vocab=77, tree=tree))
    with pytest.raises(RuntimeError, match="too large for the CUDA kernel"):
        logits_cases.run_op(logits_cases.make_case(rng, batch=1, n=513, vocab=10), device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_write_and_compact(dtype):
    kv_cases.test_cuda_matches_cpu(dtype)
