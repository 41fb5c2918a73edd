"""CUDA kernels of the sampling family against the CPU kernels (which define the semantics).

Runs only where torch sees a CUDA device. Equal means equal: num_accepted (accept/reject decisions
and status codes) and the accepted tokens must match exactly, philox_uniforms bitwise. The one
allowance is the recovered/bonus token: both backends sum fp32 weights, the CPU sequentially and
the GPU as a tree, so when u * mass lies within rounding of a CDF step they may pick neighbouring
tokens. A differing token is accepted only if it lies between the CPU's picks for u - DELTA and
u + DELTA (inverse CDF is monotone in u), checked with explicit uniforms. sample_filtered's probabilities
have the same kind of allowance: a top-p row whose target lies within TOP_P_ROUNDING of a step of the
cumulative mass (reference.top_p_margin) may end its nucleus a level apart.
"""
import pytest
import torch

import reference as ref
from specdec_ext import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCABS = [1, 7, 32001, 128256]
SHAPES = [(1, 1), (5, 4), (64, 4), (5, 8), (64, 8), (64, 1)]  # (B, k)
DELTA = 1e-3
U_MAX = 1.0 - 2.0 ** -24
TOP_P_ROUNDING = 1e-6  # a top-p target this close to a step of the cumulative mass (of M) may cut either side


def make_case(seed, batch, k, vocab, dtype, with_probs, filters="mixed", logit_scale=3.0):
    """Random logits; drafts correlated with the target so that runs get accepted; per-row filters."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * logit_scale
    draft_logits = logits[:, :k] + torch.randn(batch, k, vocab, generator=g)
    if with_probs:
        q = torch.softmax(draft_logits, dim=-1)
        draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    else:
        q = None
        draft = draft_logits.argmax(-1) if vocab > 1 else torch.zeros(batch, k, dtype=torch.int64)
        noise = torch.randint(0, vocab, (batch, k), generator=g)
        draft = torch.where(torch.rand(batch, k, generator=g) < 0.3, noise, draft)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)
    if filters == "mixed":
        choice = torch.randint(0, 5, (batch,), generator=g)
        temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0])[choice]
        top_k = torch.tensor([0, 0, 5, 50, 0], dtype=torch.int32)[choice]
        top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0])[choice]
    else:
        temperature, top_k, top_p = (torch.full((batch,), float(filters[0])),
                                     torch.full((batch,), int(filters[1]), dtype=torch.int32),
                                     torch.full((batch,), float(filters[2])))
    return dict(logits=logits.to(dtype), draft=draft, q=q, num_draft=num_draft,
                temperature=temperature, top_k=top_k, top_p=top_p)


def run(case, device, uniforms=None, seed=None, offset=None):
    def dev(t):
        return None if t is None else t.to(device)

    tokens, num_accepted = ops.chain_verify(
        dev(case["logits"]), dev(case["draft"]), dev(case["q"]), num_draft=dev(case["num_draft"]),
        temperature=dev(case["temperature"]), top_k=dev(case["top_k"]), top_p=dev(case["top_p"]),
        seed=dev(seed), offset=dev(offset), uniforms=dev(uniforms), check_status=False)
    return tokens.cpu(), num_accepted.cpu()


def nudged(uniforms, num_draft, delta):
    """The draws with the recovered/bonus token's (column num_draft[b]; k where None) moved by delta."""
    out = uniforms.clone()
    B, columns = out.shape
    column = torch.full((B,), columns - 1) if num_draft is None else num_draft.long()
    rows = torch.arange(B)
    out[rows, column] = (out[rows, column] + delta).clamp(0.0, U_MAX)
    return out


def assert_same(case, cpu, gpu, uniforms):
    """Exact equality, except a recovered/bonus token within rounding of a CDF step (see top)."""
    (cpu_tokens, cpu_accepted), (gpu_tokens, gpu_accepted) = cpu, gpu
    torch.testing.assert_close(gpu_accepted, cpu_accepted, rtol=0, atol=0)
    differ = (gpu_tokens != cpu_tokens).any(dim=1).nonzero().flatten().tolist()
    if not differ:
        return 0
    lo_tokens, _ = run(case, "cpu", uniforms=nudged(uniforms, case["num_draft"], -DELTA))
    hi_tokens, _ = run(case, "cpu", uniforms=nudged(uniforms, case["num_draft"], DELTA))
    for b in differ:
        slot = int(cpu_accepted[b])
        assert slot >= 0, f"row {b}: tokens differ on a failed row"
        mask = torch.ones_like(cpu_tokens[b], dtype=torch.bool)
        mask[slot] = False
        assert torch.equal(gpu_tokens[b][mask], cpu_tokens[b][mask]), (
            f"row {b}: accepted tokens differ: cuda {gpu_tokens[b].tolist()} cpu {cpu_tokens[b].tolist()}")
        token = int(gpu_tokens[b, slot])
        assert int(lo_tokens[b, slot]) <= token <= int(hi_tokens[b, slot]), (
            f"row {b}: cuda sampled {token}, cpu {int(cpu_tokens[b, slot])} "
            f"(cpu range for u +- {DELTA}: [{int(lo_tokens[b, slot])}, {int(hi_tokens[b, slot])}])")
    return len(differ)


def shape_cases():
    for vocab in VOCABS:
        for batch, k in SHAPES:
            if vocab == 128256 and batch * k > 256:
                continue  # keeps the CPU side of the comparison and the q tensor small
            yield vocab, batch, k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("vocab,batch,k", list(shape_cases()))
def test_chain_verify_uniforms_match_cpu(dtype, with_probs, vocab, batch, k):
    case = make_case(vocab * 7 + batch * 3 + k, batch, k, vocab, dtype, with_probs)
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(k + vocab))
    cpu = run(case, "cpu", uniforms=uniforms)
    gpu = run(case, "cuda", uniforms=uniforms)
    assert (cpu[1] >= 0).all()
    assert_same(case, cpu, gpu, uniforms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_chain_verify_philox_matches_cpu(dtype, with_probs, vocab):
    batch, k = (64, 4) if vocab < 128256 else (16, 4)
    case = make_case(vocab + 11, batch, k, vocab, dtype, with_probs)
    g = torch.Generator().manual_seed(vocab)
    seed = torch.randint(-2**62, 2**62, (batch,), generator=g)
    offset = torch.randint(0, 2**40, (batch,), generator=g)
    cpu = run(case, "cpu", seed=seed, offset=offset)
    gpu = run(case, "cuda", seed=seed, offset=offset)
    uniforms = ops.philox_uniforms(seed, offset, k + 1)
    assert_same(case, cpu, gpu, uniforms)
    # the same draws given explicitly give the same result
    explicit = run(case, "cuda", uniforms=uniforms)
    assert torch.equal(explicit[0], gpu[0]) and torch.equal(explicit[1], gpu[1])


@pytest.mark.parametrize("filters", [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.6, 20, 1.0), (1.0, 0, 0.5),
                                     (1.5, 100, 0.95), (1.0, 1, 1.0)],
                         ids=["t1", "greedy", "top_k", "top_p", "top_k_top_p", "top_k1"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chain_verify_filters_match_cpu(filters, with_probs, dtype):
    batch, k, vocab = 32, 4, 4099
    case = make_case(17, batch, k, vocab, dtype, with_probs, filters=filters, logit_scale=4.0)
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(5))
    cpu = run(case, "cpu", uniforms=uniforms)
    gpu = run(case, "cuda", uniforms=uniforms)
    assert_same(case, cpu, gpu, uniforms)


def test_chain_verify_greedy_ties_and_degenerate_rows():
    """Greedy takes the lowest index among tied maxima; a one-hot target accepts its token."""
    batch, k, vocab = 4, 3, 1000
    logits = torch.zeros(batch, k + 1, vocab)
    logits[:, :, 10] = 5.0
    logits[:, :, 900] = 5.0  # tie with 10: greedy picks 10
    logits[3] = -float("inf")
    logits[3, :, 123] = 0.0  # one finite logit: p one-hot at 123
    draft = torch.tensor([[10, 10, 900], [900, 10, 10], [10, 10, 10], [123, 123, 123]])
    case = dict(logits=logits, draft=draft, q=None, num_draft=None,
                temperature=torch.tensor([0.0, 0.0, 0.0, 1.0]), top_k=None, top_p=None)
    uniforms = torch.full((batch, k + 1), 0.5)
    cpu = run(case, "cpu", uniforms=uniforms)
    gpu = run(case, "cuda", uniforms=uniforms)
    assert_same(case, cpu, gpu, uniforms)
    assert gpu[1].tolist() == [2, 0, 3, 3]
    assert gpu[0][0].tolist() == [10, 10, 10, -1]
    assert gpu[0][3].tolist() == [123, 123, 123, 123]


def test_chain_verify_status_codes_match_cpu():
    batch, k, vocab = 16, 4, 300
    case = make_case(3, batch, k, vocab, torch.float32, True, filters=(1.0, 0, 1.0))
    case["num_draft"] = torch.full((batch,), k, dtype=torch.int32)
    logits, q, draft = case["logits"], case["q"], case["draft"]
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(9))
    draft[:, 0] = logits[:, 0].argmax(-1)
    logits[0, 0, 7] = float("nan")                  # -1 at position 0
    logits[1, 0, 3] = float("inf")                  # -1
    logits[2, 0] = -float("inf")                    # -1: every logit -inf
    q[3, 0, draft[3, 0]] = 1.5                      # -2: q[x] > 1
    uniforms[4, 0] = 0.999999                       # reject at position 0 ...
    q[4, 0, draft[4, 0]] = 1.0
    logits[4, 0, draft[4, 0]] = -30.0               # ... (p(x) ~ 0)
    q[4, 0, (int(draft[4, 0]) + 1) % vocab] = float("nan")  # -2 in the residual pass
    draft[5, 2] = vocab                             # -3
    case["num_draft"][6] = k + 1                    # -4
    case["temperature"][7] = -1.0                   # -5
    case["top_k"][8] = -2                           # -6
    case["top_p"][9] = 0.0                          # -7
    uniforms[10, 3] = 1.0                           # -8
    uniforms[11, 0] = 0.999999                      # NaN after the first rejection: never read
    q[11, 0, draft[11, 0]] = 1.0
    logits[11, 0, draft[11, 0]] = -30.0
    logits[11, 2, 5] = float("nan")
    cpu = run(case, "cpu", uniforms=uniforms)
    gpu = run(case, "cuda", uniforms=uniforms)
    expected = {0: -1, 1: -1, 2: -1, 3: -2, 4: -2, 5: -3, 6: -4, 7: -5, 8: -6, 9: -7, 10: -8}
    for row, code in expected.items():
        assert int(cpu[1][row]) == code, (row, int(cpu[1][row]))
    assert int(cpu[1][11]) == 0
    assert_same(case, cpu, gpu, uniforms)
    for row in expected:
        assert (gpu[0][row] == -1).all()


@pytest.mark.parametrize("temperature", [float("inf"), 1e30, 1e-39, 0.0], ids=["inf", "1e30", "1e-39", "zero"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
def test_chain_verify_edge_temperatures_match_cpu(temperature, with_probs):
    batch, k = 64, 4
    case = make_case(21, batch, k, 5000, torch.float32, with_probs, filters=(temperature, 0, 1.0))
    case["logits"][..., ::3] = -float("inf")  # masked tokens: weight 0 even at T = inf
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(4))
    assert_same(case, run(case, "cpu", uniforms=uniforms), run(case, "cuda", uniforms=uniforms), uniforms)


def test_chain_verify_draws_are_optional_for_greedy_rows_on_cuda():
    logits = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 1.0, 7.0]]] * 2, device="cuda")
    ids = torch.tensor([[1], [1]], device="cuda")
    tokens, n = ops.chain_verify(logits, ids, temperature=torch.tensor([0.0, 1e-39], device="cuda"))
    assert tokens.tolist() == [[1, 2], [1, 2]] and n.tolist() == [1, 1]
    tokens, n = torch.empty(2, 2, dtype=torch.int64, device="cuda"), torch.empty(2, dtype=torch.int32, device="cuda")
    torch.ops.specdec_ext.chain_verify(logits, ids, None, None, torch.tensor([0.0, 0.8], device="cuda"), None, None,
                                       None, None, None, tokens, n)
    assert tokens.tolist() == [[1, 2], [-1, -1]] and n.tolist() == [1, -11]


@pytest.mark.parametrize("k", [0, 70], ids=["bonus_only", "k70"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
def test_chain_verify_long_and_empty_chains(k, with_probs):
    """k = 0 (only the bonus position) and k + 1 > 64 (the decision kernel's general path)."""
    batch, vocab = 6, 97
    case = make_case(k + 1, batch, k, vocab, torch.float32, with_probs, logit_scale=6.0)
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(2)) * 0.3
    cpu = run(case, "cpu", uniforms=uniforms)
    gpu = run(case, "cuda", uniforms=uniforms)
    assert_same(case, cpu, gpu, uniforms)


def test_chain_verify_cuda_graph_replay_matches_eager():
    batch, k, vocab = 8, 4, 32000
    case = make_case(21, batch, k, vocab, torch.bfloat16, True)
    d = {name: (v.cuda() if torch.is_tensor(v) else v) for name, v in case.items()}
    seed = torch.arange(batch, dtype=torch.int64, device="cuda") * 1000 + 7
    offset = torch.zeros(batch, dtype=torch.int64, device="cuda")
    tokens = torch.empty(batch, k + 1, dtype=torch.int64, device="cuda")
    num_accepted = torch.empty(batch, dtype=torch.int32, device="cuda")

    def step():
        torch.ops.specdec_ext.chain_verify(d["logits"], d["draft"], d["q"], d["num_draft"],
                                           d["temperature"], d["top_k"], d["top_p"], seed, offset,
                                           None, tokens, num_accepted)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_offset in (0, 5, 1 << 33):
        offset.fill_(new_offset)
        tokens.fill_(-7)
        graph.replay()
        replayed = (tokens.clone(), num_accepted.clone())
        eager = ops.chain_verify(d["logits"], d["draft"], d["q"], num_draft=d["num_draft"],
                                 temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                 seed=seed, offset=offset, check_status=False)
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1])


def test_chain_verify_rejects_mixed_devices():
    case = make_case(1, 2, 2, 16, torch.float32, False)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.specdec_ext.chain_verify(
            case["logits"].cuda(), case["draft"], None, None, None, None, None,
            torch.zeros(2, dtype=torch.int64, device="cuda"), None, None,
            torch.empty(2, 3, dtype=torch.int64, device="cuda"),
            torch.empty(2, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
def test_residual_probs_matches_cpu(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    p = torch.softmax(torch.randn(3, 5, vocab, generator=g) * 2, dim=-1)
    q = torch.softmax(torch.randn(3, 5, vocab, generator=g) * 2, dim=-1)
    q[1, 2] = p[1, 2]  # zero residual mass: the result is p
    p, q = p.to(dtype), q.to(dtype)
    cpu = ops.residual_probs(p, q, check_values=False)
    gpu = ops.residual_probs(p.cuda(), q.cuda(), check_values=False).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=2e-5, atol=1e-9)
    torch.testing.assert_close(gpu[1, 2], p[1, 2].float(), rtol=0, atol=0)


@pytest.mark.parametrize("columns", [1, 5, 9, 33])
def test_philox_uniforms_bitwise(columns):
    g = torch.Generator().manual_seed(columns)
    seed = torch.cat([torch.randint(-2**62, 2**62, (61,), generator=g),
                      torch.tensor([0, -1, 2**63 - 1, -2**63])])
    offset = torch.cat([torch.randint(0, 2**62, (61,), generator=g), torch.tensor([0, 1, -1, 2**40])])
    cpu = ops.philox_uniforms(seed, offset, columns)
    gpu = ops.philox_uniforms(seed.cuda(), offset.cuda(), columns).cpu()
    assert torch.equal(cpu.view(torch.int32), gpu.view(torch.int32))
    assert (gpu >= 0).all() and (gpu < 1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_filtered_matches_cpu(dtype, vocab):
    """A drafter's sampled step: q within fp32 rounding, the token equal (or between the CPU's picks for
    u -/+ DELTA), per-row filters and status codes equal; run again inside a CUDA graph."""
    g = torch.Generator().manual_seed(vocab)
    batch = 64
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
    choice = torch.randint(0, 5, (batch,), generator=g)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0])[choice]
    top_k = torch.tensor([0, 0, 5, 3, 0], dtype=torch.int32)[choice]
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0])[choice]
    temperature[3] = -1.0  # an invalid row
    uniforms = torch.rand(batch, 1, generator=g) * U_MAX
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    cpu_probs, cpu_tokens = ops.sample_filtered(logits, uniforms=uniforms, check_status=False, **kw)
    on_gpu = {name: value.cuda() for name, value in kw.items()}
    gpu_probs, gpu_tokens = ops.sample_filtered(logits.cuda(), uniforms=uniforms.cuda(), check_status=False, **on_gpu)
    # A top-p row whose target lies within rounding of a step of the cumulative mass may end its
    # nucleus a level apart on the two backends (their sums differ in order); every other row, and
    # the invalid row's NaNs, must agree.
    near_step = [b for b in range(batch)
                 if ref.top_p_margin(logits[b].float().numpy(), float(temperature[b]), int(top_k[b]),
                                     float(top_p[b])) < TOP_P_ROUNDING]
    rows = [b for b in range(batch) if b not in near_step]
    torch.testing.assert_close(gpu_probs.cpu()[rows], cpu_probs[rows], rtol=1e-5, atol=1e-7, equal_nan=True)
    low = ops.sample_filtered(logits, uniforms=(uniforms - DELTA).clamp(min=0), check_status=False, **kw)[1]
    high = ops.sample_filtered(logits, uniforms=(uniforms + DELTA).clamp(max=U_MAX), check_status=False, **kw)[1]
    gpu_tokens = gpu_tokens.cpu()
    same = gpu_tokens == cpu_tokens
    between = (gpu_tokens >= low) & (gpu_tokens <= high)
    assert bool((same | between).all()), f"cuda {gpu_tokens[~same].tolist()} cpu {cpu_tokens[~same].tolist()}"
    assert int(gpu_tokens[3]) == -5

    probs = torch.empty(batch, vocab, device="cuda")
    tokens = torch.empty(batch, dtype=torch.int64, device="cuda")
    args = (logits.cuda(), on_gpu["temperature"], on_gpu["top_k"], on_gpu["top_p"], None, None, uniforms.cuda(),
            probs, tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.specdec_ext.sample_filtered(*args)
    graph.replay()
    assert torch.equal(tokens, gpu_tokens.cuda())
    torch.testing.assert_close(probs, gpu_probs, rtol=0, atol=0, equal_nan=True)


def test_bad_shapes_on_cuda_name_their_sizes():
    """The argument checks of CUDA calls raise with the sizes in the message (assembled without an
    iostream, csrc/message.h: on the H200 build an integer streamed into a TORCH_CHECK message crashed
    the process)."""
    logits = torch.zeros(2, 5, device="cuda")
    tokens = torch.empty(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"sample_filtered: probs dimension 1 must be .* = 5, got shape \[2, 4\]"):
        torch.ops.specdec_ext.sample_filtered(logits, None, None, None, None, None, None,
                                              torch.empty(2, 4, device="cuda"), tokens)
    with pytest.raises(RuntimeError, match=r"residual_probs: draft_probs must have the shape of target_probs \[2, 5\]"):
        ops.residual_probs(logits, torch.zeros(2, 4, device="cuda"))
    with pytest.raises(RuntimeError, match=r"process_logits: .*draft_tokens.*\[2, 3\]"):
        ops.process_logits(torch.zeros(2, 3, 5, device="cuda"), torch.zeros(2, 3, dtype=torch.int64, device="cuda"),
                           num_draft=torch.zeros(2, dtype=torch.int32, device="cuda"),
                           min_p=torch.full((2,), 0.1, device="cuda"))
