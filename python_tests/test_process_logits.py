"""process_logits (issue 28) against the float64 NumPy reference (reference_processing.py): every
processor alone and all together at every draft position, chains and random trees with ragged
num_draft (stale columns untouched), fp32/bf16/fp16, a grammar bitmask (V not a multiple of 32),
min_p at several temperatures and its greedy / infinite ones, the edge cases (all masked, NaN kept,
n = 0, the no-op fast path), every bad input, opcheck, a wrong reference the tests must reject, and
on a GPU the CUDA kernel against the CPU op (plain and inside a CUDA graph)."""
import zlib

import numpy as np
import pytest
import torch

import reference_processing as ref
from specdec_ext import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |kernel - reference| allowed per dtype: fp32 maths (a few roundings), then the dtype's rounding
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
PROCESSORS = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty", "allowed", "min_p")
NAN = float("nan")
INF = float("inf")


def pack_bits(bits: np.ndarray) -> torch.Tensor:
    """bool [..., W * 32] -> int32 words [..., W] (bit t % 32 of word t // 32)."""
    shaped = bits.reshape(bits.shape[:-1] + (-1, 32)).astype(np.uint64)
    words = (shaped << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return torch.from_numpy(words.view(np.int32))


def random_parents(rng, batch, n):
    return torch.from_numpy(np.array([[rng.integers(-1, i) for i in range(n)] for _ in range(batch)],
                                     dtype=np.int32).reshape(batch, n))


def make_case(rng, batch=4, n=5, vocab=77, dtype=torch.float32, tree=False, processors=PROCESSORS, ragged=True):
    """Random inputs; draft tokens from a few ids (prefixes repeat tokens, and hit counted ones)."""
    positions, words = n + 1, (vocab + 31) // 32
    logits = rng.standard_normal((batch, positions, vocab)).astype(np.float32) * 3
    logits[rng.random(logits.shape) < 0.02] = -np.inf
    c = dict(logits=torch.from_numpy(logits).to(dtype),
             draft_tokens=torch.from_numpy(rng.integers(0, min(vocab, 6), (batch, n))),
             num_draft=torch.from_numpy((rng.integers(0, n + 1, batch) if ragged else np.full(batch, n))
                                        .astype(np.int32)),
             parents=random_parents(rng, batch, n) if tree else None,
             output_counts=torch.from_numpy((rng.integers(0, 3, (batch, vocab)) *
                                             (rng.random((batch, vocab)) < 0.2)).astype(np.int32)),
             prompt_mask=torch.from_numpy(rng.random((batch, vocab)) < 0.15))
    c["num_draft"][0] = n
    optional = dict(
        logit_bias=torch.from_numpy((rng.standard_normal((batch, vocab)) * (rng.random((batch, vocab)) < 0.2))
                                    .astype(np.float32)),
        repetition_penalty=torch.from_numpy(rng.uniform(0.4, 2.0, batch).astype(np.float32)),
        presence_penalty=torch.from_numpy(rng.uniform(-0.5, 1.5, batch).astype(np.float32)),
        frequency_penalty=torch.from_numpy(rng.uniform(-0.2, 0.8, batch).astype(np.float32)),
        allowed=pack_bits(rng.random((batch, positions, words * 32)) < 0.75),
        min_p=torch.from_numpy(rng.uniform(0.01, 0.5, batch).astype(np.float32)))
    for name in processors:
        c[name] = optional[name]
    c["temperature"] = torch.from_numpy(rng.choice([0.3, 0.7, 1.0, 2.5], batch).astype(np.float32))
    return c


OP_KEYS = ("parents", "output_counts", "prompt_mask", "logit_bias", "allowed", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_p", "temperature")


def run_op(c, device="cpu"):
    """The op on a copy of the case's logits (on ``device``), returned on the CPU."""
    moved = {k: (c[k].to(device) if isinstance(c.get(k), torch.Tensor) else c.get(k)) for k in OP_KEYS}
    logits = c["logits"].clone().to(device)
    out = ops.process_logits(logits, c["draft_tokens"].to(device), num_draft=c["num_draft"].to(device), **moved)
    assert out is logits
    return logits.cpu()


def run_reference(c, **kw):
    args = {k: ref.optional_numpy(c.get(k)) for k in OP_KEYS}
    return ref.process_logits_reference(c["logits"].double().numpy(), c["draft_tokens"].numpy(),
                                        c["num_draft"].numpy(), **args, **kw)


def assert_matches(out: torch.Tensor, expected: np.ndarray, near: np.ndarray, dtype):
    """Kernel output against the float64 reference: same NaN and infinity pattern, values within the
    dtype's tolerance; entries near a min_p threshold may go either way."""
    got = out.double().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    decided = ~near & ~np.isnan(expected)
    assert np.array_equal(got[decided] == -np.inf, expected[decided] == -np.inf)
    assert np.array_equal(got[decided] == np.inf, expected[decided] == np.inf)
    finite = decided & np.isfinite(expected)
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(got[finite], expected[finite], rtol=rtol, atol=atol)
    assert near.mean() < 0.01


def check_case(c, dtype):
    out = run_op(c)
    expected, near = run_reference(c)
    assert_matches(out, expected, near, dtype)
    for b in range(out.shape[0]):  # stale columns: the very bytes given
        stale = slice(int(c["num_draft"][b]) + 1, None)
        assert torch.equal(out[b, stale].view(torch.uint8), c["logits"][b, stale].view(torch.uint8))
    return out, expected


# ------------------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("processor", PROCESSORS + ("all",))
def test_each_processor_alone_and_all_together(processor, tree, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{processor} {tree} {dtype}".encode()))
    c = make_case(rng, dtype=dtype, tree=tree, processors=PROCESSORS if processor == "all" else (processor,))
    out, expected = check_case(c, dtype)
    assert not torch.equal(out, c["logits"]), "the processor changed nothing"


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_trees_ragged_and_larger(dtype):
    rng = np.random.default_rng(7)
    for _ in range(3):
        c = make_case(rng, batch=6, n=int(rng.integers(0, 12)), vocab=int(rng.choice([1, 31, 32, 33, 500])),
                      dtype=dtype, tree=True)
        check_case(c, dtype)


def test_every_draft_position_counts_its_own_prefix():
    """A chain of one token repeated: at column c it has occurred c times (plus its committed count)."""
    vocab, n = 10, 4
    logits = torch.zeros(1, n + 1, vocab)
    c = dict(logits=logits, draft_tokens=torch.full((1, n), 3), num_draft=torch.tensor([n], dtype=torch.int32),
             output_counts=torch.zeros(1, vocab, dtype=torch.int32), frequency_penalty=torch.tensor([1.0]),
             presence_penalty=torch.tensor([0.5]))
    c["output_counts"][0, 3] = 2
    out = run_op(c)
    assert out[0, :, 3].tolist() == [-(2 + 0.5), -(3 + 0.5), -(4 + 0.5), -(5 + 0.5), -(6 + 0.5)]
    assert out[0, :, [0, 1, 2, 4]].abs().sum() == 0


def test_a_tree_column_counts_its_ancestors_only():
    # nodes: 0 (token 1), 1 (token 2, child of 0), 2 (token 2, child of the root), 3 (token 1, child of 1)
    c = dict(logits=torch.zeros(1, 5, 4), draft_tokens=torch.tensor([[1, 2, 2, 1]]),
             parents=torch.tensor([[-1, 0, -1, 1]], dtype=torch.int32), num_draft=torch.tensor([4], dtype=torch.int32),
             frequency_penalty=torch.tensor([1.0]))
    out = run_op(c)
    assert out[0, :, 1].tolist() == [0, -1, -1, 0, -2]  # columns after the root, node 0, 1, 2, 3
    assert out[0, :, 2].tolist() == [0, 0, -1, -1, -1]


def test_repetition_penalty_follows_hf():
    logits = torch.tensor([[[2.0, -2.0, 2.0, -2.0, 0.0]]])
    c = dict(logits=logits, draft_tokens=torch.zeros(1, 0, dtype=torch.int64),
             num_draft=torch.zeros(1, dtype=torch.int32), prompt_mask=torch.tensor([[True, True, False, False, True]]),
             repetition_penalty=torch.tensor([2.0]))
    assert run_op(c)[0, 0].tolist() == [1.0, -4.0, 2.0, -2.0, 0.0]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 77, 100])
def test_grammar_bitmask_layout(vocab):
    """Bit t % 32 of word t // 32; the bits past V are ignored (set at random here)."""
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bits = rng.random((2, 3, words * 32)) < 0.5
    c = dict(logits=torch.from_numpy(rng.standard_normal((2, 3, vocab)).astype(np.float32)),
             draft_tokens=torch.zeros(2, 2, dtype=torch.int64), num_draft=torch.tensor([2, 2], dtype=torch.int32),
             allowed=pack_bits(bits))
    out = run_op(c)
    assert torch.equal(torch.isneginf(out), torch.from_numpy(~bits[..., :vocab]))
    assert torch.equal(out[torch.from_numpy(bits[..., :vocab])], c["logits"][torch.from_numpy(bits[..., :vocab])])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5, 1e30, float(np.float32(1e-5))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_min_p_at_several_temperatures(temperature, dtype):
    rng = np.random.default_rng(11)
    c = make_case(rng, batch=5, n=3, vocab=200, dtype=dtype, processors=("min_p",))
    c["temperature"] = torch.full((5,), temperature)
    c["min_p"] = torch.tensor([0.0, 0.05, 0.2, 0.9, 1.0])
    out, expected = check_case(c, dtype)
    # The cut is "p < min_p * max p" under softmax(l / T), checked on the reference itself.
    column = c["logits"][2, 0].double().numpy()
    keep = ref.softmax_min_p_keeps(column, 0.2, temperature)
    assert np.array_equal(np.isfinite(expected[2, 0]), keep)
    assert torch.equal(out[0], c["logits"][0])  # min_p = 0: off
    if temperature < 1e29:  # min_p = 1 keeps the maxima only
        assert torch.equal(torch.isfinite(out[4, 0]), c["logits"][4, 0] == c["logits"][4, 0].max())


@pytest.mark.parametrize("temperature", [0.0, 1e-6, INF, NAN, -1.0], ids=["0", "1e-6", "inf", "nan", "negative"])
def test_min_p_does_nothing_for_greedy_and_infinite_temperatures(temperature):
    rng = np.random.default_rng(12)
    c = make_case(rng, batch=3, n=2, vocab=50, processors=("min_p",))
    c["min_p"] = torch.full((3,), 0.5)
    c["temperature"] = torch.full((3,), temperature)
    assert torch.equal(run_op(c), c["logits"])


# ------------------------------------------------------------------------------------------ edge cases
def test_all_masked_column_stays_all_minus_inf_and_nan_stays_nan():
    logits = torch.randn(2, 2, 40)
    logits[0, 1, 7] = NAN
    allowed = torch.zeros(2, 2, 2, dtype=torch.int32)
    allowed[1] = -1  # every bit
    c = dict(logits=logits, draft_tokens=torch.tensor([[3], [4]]), num_draft=torch.tensor([1, 1], dtype=torch.int32),
             allowed=allowed, min_p=torch.tensor([0.5, 0.5]), presence_penalty=torch.tensor([1.0, 1.0]))
    out = run_op(c)
    assert torch.isneginf(out[0, 0]).all()
    assert out[0, 1, 7].isnan() and torch.isneginf(out[0, 1, :7]).all() and torch.isneginf(out[0, 1, 8:]).all()
    assert torch.isfinite(out[1]).sum() > 0
    check_case(c, torch.float32)


def test_no_drafts():
    rng = np.random.default_rng(13)
    for dtype in DTYPES:
        c = make_case(rng, batch=3, n=0, vocab=64, dtype=dtype)
        check_case(c, dtype)


def test_nothing_to_do_is_a_no_op():
    """No processor given: nothing is read (not even invalid values) and nothing is written."""
    logits = torch.randn(2, 3, 9)
    before = logits.clone()
    ops.process_logits(logits, torch.full((2, 2), 99), num_draft=torch.tensor([7, -1], dtype=torch.int32),
                       output_counts=torch.ones(2, 9, dtype=torch.int32), temperature=0.5)
    assert torch.equal(logits, before)
    ops.process_logits(torch.empty(0, 3, 9), torch.empty(0, 2, dtype=torch.int64),
                       num_draft=torch.empty(0, dtype=torch.int32), min_p=torch.empty(0))


def test_scalars_are_broadcast():
    rng = np.random.default_rng(14)
    c = make_case(rng, batch=3, n=2, vocab=20, processors=())
    out = run_op(dict(c, presence_penalty=torch.full((3,), 0.5), min_p=torch.full((3,), 0.1)))
    logits = c["logits"].clone()
    ops.process_logits(logits, c["draft_tokens"], num_draft=c["num_draft"], output_counts=c["output_counts"],
                       prompt_mask=c["prompt_mask"], presence_penalty=0.5, min_p=0.1, temperature=c["temperature"])
    assert torch.equal(logits, out)


# ------------------------------------------------------- a wrong reference the tests must tell apart
def test_a_reference_without_the_draft_prefix_disagrees():
    """The mutation that matters: counting only the committed tokens (not each column's draft prefix)
    must fail these tests. On a constructed chain the kernel matches the right reference and not the
    wrong one."""
    c = dict(logits=torch.zeros(1, 3, 8), draft_tokens=torch.tensor([[5, 2]]),
             num_draft=torch.tensor([2], dtype=torch.int32), presence_penalty=torch.tensor([1.0]),
             repetition_penalty=torch.tensor([1.5]), output_counts=torch.zeros(1, 8, dtype=torch.int32))
    c["logits"][0, :, 5] = 2.0
    out = run_op(c).double().numpy()
    right, _ = run_reference(c)
    wrong, _ = run_reference(c, count_prefix=False)
    np.testing.assert_allclose(out, right, rtol=1e-6)
    assert not np.allclose(out, wrong)
    assert out[0, 1, 5] == pytest.approx(2.0 / 1.5 - 1.0) and wrong[0, 1, 5] == 2.0
    # and the random cases above catch it too
    rng = np.random.default_rng(15)
    c = make_case(rng, batch=4, n=5, vocab=30, processors=("presence_penalty", "frequency_penalty"))
    out = run_op(c).double().numpy()
    wrong, near = run_reference(c, count_prefix=False)
    with pytest.raises(AssertionError):
        assert_matches(torch.from_numpy(out), wrong, near, torch.float32)


# ------------------------------------------------------------------------------------------ bad inputs
def good_args():
    return dict(logits=torch.randn(2, 3, 40), draft_tokens=torch.zeros(2, 2, dtype=torch.int64),
                parents=torch.tensor([[-1, 0], [-1, -1]], dtype=torch.int32),
                num_draft=torch.tensor([2, 1], dtype=torch.int32), output_counts=torch.zeros(2, 40, dtype=torch.int32),
                prompt_mask=torch.zeros(2, 40, dtype=torch.bool), logit_bias=torch.zeros(2, 40),
                allowed=torch.full((2, 3, 2), -1, dtype=torch.int32), presence_penalty=torch.zeros(2),
                frequency_penalty=torch.zeros(2), repetition_penalty=torch.ones(2), min_p=torch.zeros(2),
                temperature=torch.ones(2))


BAD_INPUTS = [
    (dict(logits=torch.randn(2, 40)), "logits must be a 3-D tensor"),
    (dict(logits=torch.randn(2, 3, 40, dtype=torch.float64)), "logits must have dtype"),
    (dict(logits=torch.randn(2, 40, 3).transpose(1, 2)), "logits must be contiguous"),
    (dict(draft_tokens=torch.zeros(2, 3, dtype=torch.int64)), r"draft_tokens dimension 1 must be n = P - 1"),
    (dict(draft_tokens=torch.zeros(2, 2, dtype=torch.int32)), "draft_tokens must have dtype Long"),
    (dict(parents=torch.zeros(2, 2, dtype=torch.int64)), "parents must have dtype Int"),
    (dict(num_draft=torch.tensor([2, 1, 0], dtype=torch.int32)), "num_draft dimension 0 must be B"),
    (dict(output_counts=torch.zeros(2, 41, dtype=torch.int32)), "output_counts dimension 1 must be V"),
    (dict(prompt_mask=torch.zeros(2, 40, dtype=torch.int32)), "prompt_mask must have dtype Bool"),
    (dict(logit_bias=torch.zeros(3, 40)), "logit_bias dimension 0 must be B"),
    (dict(allowed=torch.zeros(2, 3, 1, dtype=torch.int32)), r"allowed dimension 2 must be W = ceil\(V / 32\)"),
    (dict(allowed=torch.zeros(2, 2, 2, dtype=torch.int32)), "allowed dimension 1 must be P"),
    (dict(min_p=torch.zeros(2, dtype=torch.float64)), "min_p must have dtype Float"),
    (dict(temperature=torch.zeros(3)), "temperature dimension 0 must be B"),
    (dict(num_draft=torch.tensor([3, 1], dtype=torch.int32)), r"num_draft must hold values in \[0, n\] = \[0, 2\]"),
    (dict(num_draft=torch.tensor([2, -1], dtype=torch.int32)), r"num_draft must hold values in \[0, n\]"),
    (dict(draft_tokens=torch.tensor([[0, 40], [0, 0]])), r"draft_tokens must hold token ids in \[0, V\) = \[0, 40\)"),
    (dict(draft_tokens=torch.tensor([[0, 0], [-1, 0]])), r"draft_tokens must hold token ids"),
    (dict(parents=torch.tensor([[-1, 1], [-1, -1]], dtype=torch.int32)), "parents must describe a tree"),
    (dict(parents=torch.tensor([[-1, 0], [-2, 5]], dtype=torch.int32)), "parents must describe a tree"),
    (dict(repetition_penalty=torch.tensor([1.0, 0.0])), "repetition_penalty must be finite and > 0"),
    (dict(repetition_penalty=torch.tensor([NAN, 1.0])), "repetition_penalty must be finite and > 0"),
    (dict(repetition_penalty=torch.tensor([INF, 1.0])), "repetition_penalty must be finite and > 0"),
    (dict(min_p=torch.tensor([0.5, 1.5])), r"min_p must lie in \[0, 1\]"),
    (dict(min_p=torch.tensor([-0.1, 0.0])), r"min_p must lie in \[0, 1\]"),
    (dict(min_p=torch.tensor([NAN, 0.0])), r"min_p must lie in \[0, 1\]"),
    (dict(presence_penalty=torch.tensor([INF, 0.0])), "presence_penalty must be finite"),
    (dict(frequency_penalty=torch.tensor([0.0, NAN])), "frequency_penalty must be finite"),
]


@pytest.mark.parametrize("overrides, pattern", BAD_INPUTS, ids=[p.split(" ")[0] + str(i) for i, (_, p)
                                                                  in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_naming_the_argument(overrides, pattern):
    args = dict(good_args(), **overrides)
    logits, draft_tokens = args.pop("logits"), args.pop("draft_tokens")
    with pytest.raises(RuntimeError, match="process_logits: " + pattern):
        ops.process_logits(logits, draft_tokens, **args)


def test_unused_slots_are_not_checked():
    args = good_args()
    args["num_draft"] = torch.tensor([1, 0], dtype=torch.int32)
    args["draft_tokens"] = torch.tensor([[3, 99], [-1, -1]])
    args["parents"] = torch.tensor([[-1, 7], [4, 4]], dtype=torch.int32)
    ops.process_logits(args.pop("logits"), args.pop("draft_tokens"), **args)


def test_unknown_keyword():
    with pytest.raises(TypeError, match="top_k"):
        ops.process_logits(torch.randn(1, 1, 4), torch.empty(1, 0, dtype=torch.int64), num_draft=0, top_k=3)


def test_opcheck():
    args = good_args()
    schema_order = [args[k] for k in ("logits", "draft_tokens", "parents", "num_draft", "output_counts",
                                      "prompt_mask", "logit_bias", "allowed", "presence_penalty",
                                      "frequency_penalty", "repetition_penalty", "min_p", "temperature")]
    torch.library.opcheck(torch.ops.specdec_ext.process_logits.default, tuple(schema_order))
    chain = [a if i != 2 else None for i, a in enumerate(schema_order)]
    chain[0] = chain[0].bfloat16()
    torch.library.opcheck(torch.ops.specdec_ext.process_logits.default, tuple(chain))


def test_meta_tensors_and_mixed_devices():
    args = good_args()
    meta = {k: v.to("meta") for k, v in args.items()}
    logits, draft_tokens = meta.pop("logits"), meta.pop("draft_tokens")
    ops.process_logits(logits, draft_tokens, **meta)
    args["min_p"] = args["min_p"].to("meta")
    with pytest.raises(RuntimeError, match="min_p must be on the same device as logits"):
        ops.process_logits(args.pop("logits"), args.pop("draft_tokens"), **args)


# ------------------------------------------------------------------------------------------ CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_cuda_matches_cpu(c):
    """Bitwise (NaNs aside), except logits near a min_p threshold (CUDA's logf may differ from the
    CPU's in the last bit)."""
    cpu, on_cuda = run_op(c), run_op(c, device="cuda")
    _, near = run_reference(c)
    assert torch.equal(cpu.isnan(), on_cuda.isnan())
    same = ~torch.from_numpy(near) & ~cpu.isnan()
    assert torch.equal(cpu[same], on_cuda[same])


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("vocab", [1, 33, 32000, 151936])
def test_cuda_matches_cpu(vocab, tree, dtype):
    rng = np.random.default_rng(vocab)
    assert_cuda_matches_cpu(make_case(rng, batch=5, n=7, vocab=vocab, dtype=dtype, tree=tree))
    assert_cuda_matches_cpu(make_case(rng, batch=2, n=0, vocab=vocab, dtype=dtype, tree=tree))


@cuda
def test_cuda_long_prefixes_and_bad_values():
    rng = np.random.default_rng(21)
    c = make_case(rng, batch=2, n=512, vocab=3000, tree=True, ragged=False)
    c["draft_tokens"] = torch.from_numpy(rng.integers(0, 3000, (2, 512)))
    assert_cuda_matches_cpu(c)
    with pytest.raises(RuntimeError, match="too large for the CUDA kernel"):
        run_op(make_case(rng, batch=1, n=513, vocab=10), device="cuda")
    for overrides, pattern in BAD_INPUTS[-14:]:
        args = {k: v.cuda() for k, v in dict(good_args(), **overrides).items()}
        with pytest.raises(RuntimeError, match="process_logits: " + pattern):
            ops.process_logits(args.pop("logits"), args.pop("draft_tokens"), **args)


@cuda
def test_cuda_graph_capture():
    """Inside a capture the values are not read back (no synchronisation): the op is captured and
    its replay equals the CPU op."""
    rng = np.random.default_rng(22)
    c = make_case(rng, batch=4, n=4, vocab=1000, tree=True)
    moved = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    logits = moved["logits"].clone()
    args = {k: moved.get(k) for k in OP_KEYS}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.process_logits(logits, moved["draft_tokens"], num_draft=moved["num_draft"], **args)
    logits.copy_(moved["logits"])
    graph.replay()
    torch.cuda.synchronize()
    cpu = run_op(c)
    _, near = run_reference(c)
    same = ~torch.from_numpy(near) & ~cpu.isnan()
    assert torch.equal(cpu[same], logits.cpu()[same])
