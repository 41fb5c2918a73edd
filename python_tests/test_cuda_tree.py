"""CUDA kernels of the tree family (csrc/cuda/tree.cu) against the CPU kernels, which define the
semantics (csrc/tree.h, csrc/cpu/tree.cpp).

Runs only where torch sees a CUDA device. build_tree_mask must match bitwise. tree_verify must
match exactly (num_accepted, path, tokens) on every row whose decisions all lie further than MARGIN
from their boundary (the float64 reference of reference_tree.py measures that distance): both
backends sum fp32 weights in different orders, so only a decision within rounding of its boundary
may differ. Greedy rows (one-hot p) and invalid rows (status codes) must match on every row.
"""
import numpy as np
import pytest
import torch
from scipy import stats

import reference as ref
import reference_tree as rt
from specdec_ext import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FILTERS = {
    "t1": (1.0, 0, 1.0),
    "t07_top_p09": (0.7, 0, 0.9),
    "t13_top_k5": (1.3, 5, 1.0),
    "top_k3_top_p08": (1.0, 3, 0.8),
    "greedy": (0.0, 0, 1.0),
}
MARGIN = 2e-5


def random_parents(rng, batch, nodes, chain_bias=0.5):
    """Random topologically ordered trees: each node's parent is uniform in [-1, i), or i - 1."""
    parents = np.empty((batch, nodes), dtype=np.int32)
    for i in range(nodes):
        uniform_parent = rng.integers(-1, i, size=batch) if i > 0 else np.full(batch, -1)
        parents[:, i] = np.where(rng.random(batch) < chain_bias, i - 1, uniform_parent)
    return parents


def make_case(rng, batch, nodes, vocab, dtype, with_probs, filters, ragged=True, parents=None,
              scale=3.0, uniform_low=0.0):
    """Random logits and trees; q rule: siblings drawn i.i.d. from their parent position's q;
    deterministic rule: candidates often the target's argmax at the parent (so paths get accepted)."""
    logits_np = rng.standard_normal((batch, nodes + 1, vocab)).astype(np.float32) * scale
    logits = torch.from_numpy(logits_np).to(dtype)
    if parents is None:
        parents = random_parents(rng, batch, nodes)
    parents = np.array(np.broadcast_to(parents, (batch, nodes)), dtype=np.int32, order="C")  # writable
    ids = np.empty((batch, nodes), dtype=np.int64)
    q = None
    if with_probs:
        per_position = rng.dirichlet(np.full(vocab, 0.5), size=(batch, nodes + 1)).astype(np.float32)
        q_np = np.take_along_axis(per_position, (parents + 1)[:, :, None].astype(np.int64), axis=1)
        for b in range(batch):
            for i in range(nodes):
                w = q_np[b, i].astype(np.float64)
                ids[b, i] = rng.choice(vocab, p=w / w.sum())
        q = torch.from_numpy(np.ascontiguousarray(q_np))
    else:
        argmax = logits.float().argmax(-1).numpy()
        at_parent = np.take_along_axis(argmax, (parents + 1).astype(np.int64), axis=1)
        ids = np.where(rng.random((batch, nodes)) < 0.6, at_parent, rng.integers(0, vocab, (batch, nodes)))
    num_nodes = torch.from_numpy(rng.integers(0, nodes + 1, batch).astype(np.int32)) if ragged else None
    uniforms = rng.random((batch, nodes + 1)).astype(np.float32)
    uniforms[:, :nodes] = uniform_low + (1.0 - uniform_low) * uniforms[:, :nodes]
    uniforms = np.minimum(uniforms, np.float32(1.0 - 2.0 ** -24))
    return dict(
        logits=logits, ids=torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
        parents=torch.from_numpy(parents), q=q, num_nodes=num_nodes,
        temperature=torch.full((batch,), filters[0], dtype=torch.float32),
        top_k=torch.full((batch,), filters[1], dtype=torch.int32),
        top_p=torch.full((batch,), filters[2], dtype=torch.float32),
        uniforms=torch.from_numpy(uniforms))


def to(t, device):
    return None if t is None else t.to(device)


def run(c, device, **kw):
    """tree_verify of case c on `device`, outputs on the CPU; kw overrides (uniforms=None, seed=...)."""
    kw.setdefault("uniforms", c["uniforms"])
    kw = {k: to(v, device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    outs = ops.tree_verify(to(c["logits"], device), to(c["ids"], device), to(c["parents"], device),
                           to(c["q"], device), num_nodes=to(c["num_nodes"], device),
                           temperature=to(c["temperature"], device), top_k=to(c["top_k"], device),
                           top_p=to(c["top_p"], device), check_status=False, **kw)
    return tuple(t.cpu() for t in outs)


def margins(c, uniforms=None):
    uniforms = c["uniforms"] if uniforms is None else uniforms
    *_, margin = rt.tree_verify(c["logits"].float().numpy(), c["ids"].numpy(), c["parents"].numpy(),
                                None if c["q"] is None else c["q"].numpy(),
                                None if c["num_nodes"] is None else c["num_nodes"].numpy(),
                                c["temperature"].numpy(), c["top_k"].numpy(), c["top_p"].numpy(),
                                uniforms.numpy().astype(np.float64), with_margin=True)
    return margin


def assert_rows_equal(cpu, gpu, rows):
    for a, b, name in zip(cpu, gpu, ("path", "tokens", "num_accepted")):
        np.testing.assert_array_equal(b.numpy()[rows], a.numpy()[rows], err_msg=name)


def assert_cuda_matches_cpu(c, min_compared=0.8, **kw):
    """CUDA == CPU on every greedy row and every row away from its decision boundaries."""
    cpu = run(c, "cpu", **kw)
    gpu = run(c, DEVICE, **kw)
    uniforms = kw.get("uniforms", c["uniforms"])
    if uniforms is None:  # seeded: the same draws, made explicit for the reference's margins
        offset = kw.get("offset")
        offset = torch.zeros_like(kw["seed"]) if offset is None else offset
        uniforms = ops.philox_uniforms(kw["seed"], offset, c["logits"].shape[1])
    rows = (margins(c, uniforms) > MARGIN) | (c["temperature"].numpy() < ops.GREEDY_TEMPERATURE)
    assert rows.mean() >= min_compared, rows.mean()
    assert_rows_equal(cpu, gpu, rows)
    # every row: valid on both, and the invariants of the output layout
    path, tokens, n = (t.numpy() for t in gpu)
    assert (n >= 0).all()
    for b in range(len(n)):
        assert (path[b, n[b]:] == -1).all() and (tokens[b, n[b] + 1:] == -1).all()
        assert (path[b, :n[b]] >= 0).all() and 0 <= tokens[b, n[b]] < c["logits"].shape[-1]
    return cpu, gpu


# ---------------------------------------------------------------------------------------------
# build_tree_mask
@pytest.mark.parametrize("nodes", [1, 5, 17, 64, 70, 300])
def test_build_tree_mask_matches_cpu(nodes):
    rng = np.random.default_rng(nodes)
    batch = 24
    parents = random_parents(rng, batch, nodes)
    counts = rng.integers(0, nodes + 1, batch).astype(np.int32)
    # invalid rows: a parent equal to its own index / below -1, num_nodes out of range
    if nodes > 1:
        parents[3, nodes - 1] = nodes - 1
        counts[3] = nodes
        parents[9, nodes - 1] = -2
        counts[9] = nodes
    counts[5] = nodes + 1
    counts[7] = -1
    # unused slots hold garbage that must never be read
    parents[11, :] = 10_000
    counts[11] = 0
    for num_nodes in (None, counts):
        p = torch.from_numpy(np.ascontiguousarray(parents))
        n = None if num_nodes is None else torch.from_numpy(num_nodes)
        cpu_mask, cpu_depth = ops.build_tree_mask(p, n, check_status=False)
        out = (torch.ones(batch, nodes, nodes, dtype=torch.bool, device=DEVICE),
               torch.full((batch, nodes), 77, dtype=torch.int32, device=DEVICE))
        gpu_mask, gpu_depth = ops.build_tree_mask(p.to(DEVICE), to(n, DEVICE), out=out, check_status=False)
        assert gpu_mask is out[0] and gpu_depth is out[1]
        assert torch.equal(gpu_mask.cpu(), cpu_mask) and torch.equal(gpu_depth.cpu(), cpu_depth)
        if num_nodes is None:
            ref_mask, ref_depth = rt.build_tree_mask(parents, None)
            np.testing.assert_array_equal(gpu_mask.cpu().numpy(), ref_mask)
            np.testing.assert_array_equal(gpu_depth.cpu().numpy(), ref_depth)


def test_build_tree_mask_hand_example_and_empty():
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, 0, 7, -5, 0, 0]], dtype=torch.int32, device=DEVICE)
    mask, depth = ops.build_tree_mask(parents, torch.tensor([6, 2], dtype=torch.int32, device=DEVICE))
    assert depth.tolist() == [[1, 1, 2, 2, 2, 3], [1, 2, 0, 0, 0, 0]]
    assert mask[0].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                                      [1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]
    expected = torch.eye(6, dtype=torch.bool)
    expected[1, 0] = True  # node 1 (parent 0); slots 2.. are unused and see only themselves
    assert torch.equal(mask[1].cpu(), expected)
    mask, depth = ops.build_tree_mask(torch.empty(3, 0, dtype=torch.int32, device=DEVICE))
    assert mask.shape == (3, 0, 0) and depth.shape == (3, 0)
    mask, depth = ops.build_tree_mask(torch.empty(0, 4, dtype=torch.int32, device=DEVICE))
    assert mask.shape == (0, 4, 4)
    torch.cuda.synchronize()


@pytest.mark.parametrize("nodes", [3, 33, 1000])
def test_build_tree_mask_odd_alignments(nodes):
    """Row blocks of N*N bytes start at every alignment; a chain gives the full lower triangle."""
    batch = 5
    parents = torch.arange(-1, nodes - 1, dtype=torch.int32).expand(batch, nodes).contiguous()
    mask, depth = ops.build_tree_mask(parents.to(DEVICE))
    expected = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool)).expand(batch, nodes, nodes)
    assert torch.equal(mask.cpu(), expected)
    assert torch.equal(depth.cpu(), torch.arange(1, nodes + 1, dtype=torch.int32).expand(batch, nodes))


# ---------------------------------------------------------------------------------------------
# tree_verify: exact against the CPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("filter_name", list(FILTERS))
def test_tree_verify_matches_cpu(dtype, with_probs, filter_name):
    rng = np.random.default_rng(7)
    c = make_case(rng, batch=32, nodes=8, vocab=50, dtype=dtype, with_probs=with_probs,
                  filters=FILTERS[filter_name])
    assert_cuda_matches_cpu(c)


@pytest.mark.parametrize("temperature", [float("inf"), 1e30, 1e-39], ids=["inf", "1e30", "1e-39"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_edge_temperatures_match_cpu(temperature, with_probs):
    c = make_case(np.random.default_rng(17), 48, 6, 3000, torch.float32, with_probs, (temperature, 0, 1.0))
    c["logits"][..., ::3] = -float("inf")  # masked tokens: weight 0 even at T = inf
    assert_cuda_matches_cpu(c)


def test_greedy_rows_need_no_draws_on_cuda():
    logits = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 1.0, 7.0]]] * 2, device=DEVICE)
    ids = torch.tensor([[1], [1]], device=DEVICE)
    parents = torch.tensor([[-1], [-1]], dtype=torch.int32, device=DEVICE)
    path, tokens, n = ops.tree_verify(logits, ids, parents, temperature=torch.tensor([0.0, 1e-39], device=DEVICE))
    assert tokens.tolist() == [[1, 2], [1, 2]] and n.tolist() == [1, 1]
    path, tokens = torch.empty(2, 1, dtype=torch.int32, device=DEVICE), torch.empty(2, 2, dtype=torch.int64, device=DEVICE)
    n = torch.empty(2, dtype=torch.int32, device=DEVICE)
    torch.ops.specdec_ext.tree_verify(logits, ids, parents, None, None, torch.tensor([0.0, 0.8], device=DEVICE), None,
                                      None, None, None, None, path, tokens, n)
    assert tokens.tolist() == [[1, 2], [-1, -1]] and n.tolist() == [1, -11]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 32001])
@pytest.mark.parametrize("with_probs", [True, False])
def test_odd_vocab_sizes(dtype, vocab, with_probs):
    rng = np.random.default_rng(vocab)
    c = make_case(rng, batch=6, nodes=6, vocab=vocab, dtype=dtype, with_probs=with_probs,
                  filters=(0.9, 0, 0.95))
    _, (path, tokens, n) = assert_cuda_matches_cpu(c, min_compared=0.5)
    if vocab == 1:
        assert (tokens.gather(1, n.long()[:, None]) == 0).all()


@pytest.mark.parametrize("with_probs", [True, False])
def test_mixed_rows_each_with_own_filter(with_probs):
    rng = np.random.default_rng(3)
    batch = 48
    c = make_case(rng, batch=batch, nodes=12, vocab=64, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0))
    c["temperature"] = torch.from_numpy(rng.choice([0.0, 0.5, 1.0, 1.5], batch).astype(np.float32))
    c["top_k"] = torch.from_numpy(rng.choice([0, 1, 4, 63, 64, 100], batch).astype(np.int32))
    c["top_p"] = torch.from_numpy(rng.choice([1.0, 0.9, 0.5, 0.01], batch).astype(np.float32))
    assert_cuda_matches_cpu(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("filters", [(1.0, 0, 1.0), (0.8, 20, 0.9)], ids=["t1", "filtered"])
def test_many_rejections_at_one_node(dtype, with_probs, filters):
    """Star trees (every node a child of the root) with draws near 1: long runs of rejections at one
    node, each updating the materialised p (the ping-pong buffers of the q rule, in-place removal
    for the deterministic rule)."""
    rng = np.random.default_rng(11)
    batch, nodes, vocab = 16, 40, 300
    c = make_case(rng, batch=batch, nodes=nodes, vocab=vocab, dtype=torch.float32, with_probs=with_probs,
                  filters=filters, parents=np.full(nodes, -1, dtype=np.int32), uniform_low=0.9, scale=1.0)
    logits = c["logits"]
    if with_probs:  # p puts its mass where the (shared) q of the children is small: most drafts rejected
        q_root = c["q"][:, 0]
        high = q_root > q_root.median(dim=1, keepdim=True).values
        logits[:, 0] = torch.where(high, -8.0, 0.0) + 0.5 * logits[:, 0]
    else:  # random candidates against a flat p: nearly every one rejected
        c["ids"] = torch.from_numpy(rng.integers(0, vocab, (batch, nodes)))
    c["logits"] = logits.to(dtype)
    c["num_nodes"][:8] = nodes
    cpu, gpu = assert_cuda_matches_cpu(c, min_compared=0.5)
    # in a star tree the accepted child's index is the number of children rejected before it
    path, n = cpu[0].numpy(), cpu[2].numpy()
    rejected = np.where(n >= 1, path[:, 0], c["num_nodes"].numpy())
    assert rejected.mean() >= 5, rejected


@pytest.mark.parametrize("with_probs", [True, False])
def test_large_trees(with_probs):
    rng = np.random.default_rng(5)
    c = make_case(rng, batch=8, nodes=200, vocab=1000, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0), scale=2.0)
    assert_cuda_matches_cpu(c, min_compared=0.5)


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("vocab", [30, 32001])
def test_greedy_rows_exact(with_probs, vocab):
    rng = np.random.default_rng(2)
    batch = 64
    c = make_case(rng, batch=batch, nodes=10, vocab=vocab, dtype=torch.bfloat16, with_probs=with_probs,
                  filters=(0.0, 0, 1.0))
    seeds = torch.arange(batch, dtype=torch.int64)
    cpu = run(c, "cpu", uniforms=None, seed=seeds)
    gpu = run(c, DEVICE, uniforms=None, seed=seeds)
    assert_rows_equal(cpu, gpu, np.ones(batch, dtype=bool))
    assert (cpu[2] >= 0).all()


@pytest.mark.parametrize("with_probs", [True, False])
def test_seeded_draws(with_probs):
    rng = np.random.default_rng(9)
    batch = 32
    c = make_case(rng, batch=batch, nodes=7, vocab=40, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0))
    seeds = torch.arange(100, 100 + batch, dtype=torch.int64)
    offsets = torch.arange(batch, dtype=torch.int64) * 3
    assert_cuda_matches_cpu(c, uniforms=None, seed=seeds, offset=offsets)
    # on the GPU, seeded == explicit Philox uniforms, and a row's result does not depend on the batch
    seeded = run(c, DEVICE, uniforms=None, seed=seeds, offset=offsets)
    explicit = run(c, DEVICE, uniforms=ops.philox_uniforms(seeds.to(DEVICE), offsets.to(DEVICE), 8))
    assert all(torch.equal(a, b) for a, b in zip(seeded, explicit))
    for b in (0, 13):
        one = {k: (v[b:b + 1] if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        single = run(one, DEVICE, uniforms=None, seed=seeds[b:b + 1], offset=offsets[b:b + 1])
        assert all(torch.equal(s[0], full[b]) for s, full in zip(single, seeded))


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_tree_matches_chain_verify_on_cuda(with_probs):
    rng = np.random.default_rng(4)
    batch, k = 48, 6
    c = make_case(rng, batch=batch, nodes=k, vocab=40, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0), parents=np.arange(-1, k - 1, dtype=np.int32))
    path, tokens, n = run(c, DEVICE)
    chain_tokens, chain_n = ops.chain_verify(
        to(c["logits"], DEVICE), to(c["ids"], DEVICE), to(c["q"], DEVICE), num_draft=to(c["num_nodes"], DEVICE),
        temperature=to(c["temperature"], DEVICE), top_k=to(c["top_k"], DEVICE), top_p=to(c["top_p"], DEVICE),
        uniforms=to(c["uniforms"], DEVICE))
    rows = margins(c) > MARGIN
    assert rows.mean() > 0.8
    np.testing.assert_array_equal(tokens.numpy()[rows], chain_tokens.cpu().numpy()[rows])
    np.testing.assert_array_equal(n.numpy()[rows], chain_n.cpu().numpy()[rows])
    for b in np.nonzero(rows)[0]:
        assert path[b].tolist() == list(range(n[b])) + [-1] * (k - n[b])


# ---------------------------------------------------------------------------------------------
# invalid rows: the same status codes, in the same order of checks, with -1 everywhere
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_invalid_rows_give_the_cpu_status(with_probs, dtype):
    rng = np.random.default_rng(21)
    batch, nodes, vocab = 20, 5, 16
    c = make_case(rng, batch=batch, nodes=nodes, vocab=vocab, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0), ragged=False)
    c["num_nodes"] = torch.full((batch,), nodes, dtype=torch.int32)
    logits, ids, parents, u = c["logits"], c["ids"], c["parents"], c["uniforms"]
    expected = {}
    c["temperature"][1] = -1.0; expected[1] = -5
    c["top_k"][2] = -3; expected[2] = -6
    c["top_p"][3] = 0.0; expected[3] = -7
    c["num_nodes"][4] = nodes + 1; expected[4] = -10
    parents[5, 3] = 3; expected[5] = -9
    c["num_nodes"][6] = 2; u[6, nodes - 1] = 1.5; expected[6] = -8  # every column is checked
    ids[7, 2] = vocab; expected[7] = -3
    logits[8, 0, 3] = float("nan"); expected[8] = -1
    c["temperature"][9] = float("nan"); parents[9, 1] = 4; expected[9] = -5  # first check wins
    parents[10, 2] = -7; u[10, 0] = -0.5; expected[10] = -9
    c["num_nodes"][11] = -1; parents[11, 1] = 1; expected[11] = -10
    ids[12, 1] = -1; u[12, nodes] = float("nan"); expected[12] = -8
    logits[13, 0, 2] = float("inf"); expected[13] = -1
    logits[14, 0] = float("-inf"); expected[14] = -1  # every logit -inf
    # unused slots hold garbage that is never read: a valid row
    c["num_nodes"][15] = 1; parents[15, 1:] = 99; ids[15, 1:] = -5
    c["temperature"][16] = 0.0  # greedy with a NaN logit: -1 as well
    logits[16, 0, 5] = float("nan"); expected[16] = -1
    if with_probs:
        q = c["q"]
        # q[x] of the first child outside [0, 1]
        q[17, 0, ids[17, 0]] = 1.5; expected[17] = -2
        # q[x] valid, another entry negative: -2 once node 0 is rejected (p(x) ~ 0, u near 1)
        x = int(ids[18, 0])
        q[18, 0] = -0.25; q[18, 0, x] = 0.5; logits[18, 0, x] = -60.0; u[18, 0] = 0.9; expected[18] = -2
        # the same on a greedy row (p one-hot elsewhere: node 0 rejected, the q row still checked)
        x = int(ids[19, 0])
        q[19, 0] = 2.0; q[19, 0, x] = 0.5; logits[19, 0, x] = -60.0; c["temperature"][19] = 0.0
        expected[19] = -2
    c["logits"] = logits.to(dtype)
    cpu = run(c, "cpu")
    gpu = run(c, DEVICE)
    invalid = cpu[2].numpy() < 0
    assert_rows_equal(cpu, gpu, invalid)  # the same status, path and tokens all -1 on both
    assert (gpu[2].numpy()[~invalid] >= 0).all()  # valid rows (decisions may sit near a boundary)
    for row, code in expected.items():
        assert int(gpu[2][row]) == code, (row, int(gpu[2][row]), code)
        assert (gpu[0][row] == -1).all() and (gpu[1][row] == -1).all()
    assert int(gpu[2][15]) >= 0 and int(gpu[2][0]) >= 0


def test_zero_nodes_and_single_position():
    logits = torch.tensor([[[0.0, 5.0, 1.0]], [[2.0, 0.0, 1.0]]], device=DEVICE)
    empty_ids = torch.empty(2, 0, dtype=torch.int64, device=DEVICE)
    empty_parents = torch.empty(2, 0, dtype=torch.int32, device=DEVICE)
    path, tokens, n = ops.tree_verify(logits, empty_ids, empty_parents, temperature=0.0, seed=0)
    assert path.shape == (2, 0) and tokens.tolist() == [[1], [0]] and n.tolist() == [0, 0]
    # num_nodes = 1 with N = 0 is out of range
    path, tokens, n = ops.tree_verify(logits, empty_ids, empty_parents, num_nodes=1, seed=0, check_status=False)
    assert n.tolist() == [-10, -10] and tokens.tolist() == [[-1], [-1]]
    # B = 0: nothing to do
    ops.tree_verify(torch.empty(0, 3, 4, device=DEVICE), torch.empty(0, 2, dtype=torch.int64, device=DEVICE),
                    torch.empty(0, 2, dtype=torch.int32, device=DEVICE), seed=torch.empty(0, dtype=torch.int64,
                                                                                       device=DEVICE))
    torch.cuda.synchronize()


def test_hand_computed_two_children():
    p_root = np.array([0.1, 0.6, 0.3, 0.0])
    logits = torch.full((1, 3, 4), float("-inf"))
    logits[0, 0, :3] = torch.from_numpy(np.log(p_root[:3])).float()
    logits[0, 1] = 0.0
    logits[0, 2, 3] = 0.0
    logits = logits.to(DEVICE)
    ids = torch.tensor([[3, 1]], device=DEVICE)
    parents = torch.tensor([[-1, -1]], dtype=torch.int32, device=DEVICE)
    u = lambda *v: torch.tensor([v], device=DEVICE)  # noqa: E731
    path, tokens, n = ops.tree_verify(logits, ids, parents, uniforms=u(0.5, 0.59, 0.0))
    assert path.tolist() == [[1, -1]] and tokens.tolist() == [[1, 3, -1]] and n.tolist() == [1]
    path, tokens, n = ops.tree_verify(logits, ids, parents, uniforms=u(0.5, 0.61, 0.3))
    assert path.tolist() == [[-1, -1]] and tokens.tolist() == [[2, -1, -1]] and n.tolist() == [0]
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]]], device=DEVICE)
    ids_q = torch.tensor([[2, 1]], device=DEVICE)
    path, tokens, n = ops.tree_verify(logits, ids_q, parents, q, uniforms=u(0.7, 0.99, 0.0))
    assert path.tolist() == [[1, -1]] and tokens.tolist() == [[1, 3, -1]]
    path, tokens, n = ops.tree_verify(logits, ids_q, parents, q, uniforms=u(0.59, 0.99, 0.6))
    assert path.tolist() == [[0, -1]] and tokens.tolist() == [[2, 2, -1]]
    # q rule, exact in fp32: p uniform over 4 tokens; node 0 (q = onehot(0)) rejected: p = [0, 1, 1, 1] / 3
    # (materialised); node 1 (q = [0, 1, 1, 1], entries valid) rejected: the residual mass is 0, so p is
    # kept; u = 0.5 then draws token 2 (a kernel sampling the all-zero residual would give token 0)
    flat = torch.zeros(1, 3, 4, device=DEVICE)
    q_keep = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]], device=DEVICE)
    ids_keep = torch.tensor([[0, 1]], device=DEVICE)
    for device in ("cpu", DEVICE):
        path, tokens, n = ops.tree_verify(flat.to(device), ids_keep.to(device), parents.to(device),
                                          q_keep.to(device), uniforms=u(0.5, 0.5, 0.5).to(device))
        assert path.tolist() == [[-1, -1]] and tokens.tolist() == [[2, -1, -1]] and n.tolist() == [0]


# ---------------------------------------------------------------------------------------------
# distribution (the GPU's own draws): the token emitted at depth 1 follows the filtered target
@pytest.mark.parametrize("with_probs", [True, False], ids=["q_rule", "deterministic_rule"])
@pytest.mark.parametrize("filters", [(1.0, 0, 1.0), (0.7, 0, 0.9)], ids=["t1", "t07_top_p09"])
def test_depth1_token_follows_filtered_target(with_probs, filters):
    draws, vocab, children = 200_000, 6, 3
    rng = np.random.default_rng(17)
    l0 = rng.standard_normal(vocab) * 1.2
    q0 = rng.dirichlet(np.full(vocab, 0.6))
    p0 = ref.filtered_probs(l0, *filters)
    logits = torch.from_numpy(rng.standard_normal((draws, children + 1, vocab)).astype(np.float32))
    logits[:, 0] = torch.from_numpy(l0.astype(np.float32))
    if with_probs:
        ids = torch.from_numpy(rng.choice(vocab, size=(draws, children), p=q0))
        q = torch.from_numpy(np.broadcast_to(q0.astype(np.float32), (draws, children, vocab)).copy())
    else:
        ids = torch.from_numpy(np.argsort(-q0, kind="stable")[:children].copy()).expand(draws, children).contiguous()
        q = None
    parents = torch.full((children,), -1, dtype=torch.int32)
    path, tokens, n = ops.tree_verify(logits.to(DEVICE), ids.to(DEVICE), parents.to(DEVICE), to(q, DEVICE),
                                      temperature=filters[0], top_k=filters[1], top_p=filters[2],
                                      seed=torch.arange(draws, device=DEVICE), offset=3)
    x = tokens[:, 0].cpu().numpy()
    counts = np.bincount(x, minlength=vocab).astype(np.float64)
    support = p0 > 0
    assert counts[~support].sum() == 0
    assert 0 < (n.cpu() == 0).float().mean() < 1
    pvalue = stats.chisquare(counts[support], p0[support] * draws).pvalue
    assert pvalue > 1e-4, pvalue


# ---------------------------------------------------------------------------------------------
# CUDA graphs
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("draws", ["uniforms", "seed"])
def test_cuda_graph_capture_and_replay(with_probs, draws):
    rng = np.random.default_rng(31)
    batch, nodes, vocab = 16, 9, 1000
    cases = [make_case(rng, batch=batch, nodes=nodes, vocab=vocab, dtype=torch.bfloat16, with_probs=with_probs,
                       filters=(0.8, 0, 0.95)) for _ in range(2)]
    for c in cases:
        c["temperature"][:4] = 0.0
        c["seed"] = torch.from_numpy(rng.integers(0, 2 ** 40, batch))
        c["offset"] = torch.from_numpy(rng.integers(0, 100, batch))
    keys = ["logits", "ids", "parents", "q", "num_nodes", "temperature", "top_k", "top_p", "seed", "offset",
            "uniforms"]
    static = {k: to(cases[0][k], DEVICE) for k in keys}
    if draws == "uniforms":
        static["seed"] = static["offset"] = None
    else:
        static["uniforms"] = None
    path = torch.empty(batch, nodes, dtype=torch.int32, device=DEVICE)
    tokens = torch.empty(batch, nodes + 1, dtype=torch.int64, device=DEVICE)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=DEVICE)
    mask = torch.empty(batch, nodes, nodes, dtype=torch.bool, device=DEVICE)
    depth = torch.empty(batch, nodes, dtype=torch.int32, device=DEVICE)

    def step():
        torch.ops.specdec_ext.tree_verify(*(static[k] for k in keys), path, tokens, num_accepted)
        torch.ops.specdec_ext.build_tree_mask(static["parents"], static["num_nodes"], mask, depth)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for c in cases:
        for k in keys:
            if static[k] is not None:
                static[k].copy_(c[k])
        path.fill_(123)
        tokens.fill_(123)
        num_accepted.fill_(123)
        mask.fill_(True)
        depth.fill_(123)
        graph.replay()
        torch.cuda.synchronize()
        eager_kw = dict(uniforms=static["uniforms"], seed=static["seed"], offset=static["offset"])
        eager = run({k: static[k] for k in keys}, DEVICE, **eager_kw)
        assert torch.equal(path.cpu(), eager[0]) and torch.equal(tokens.cpu(), eager[1])
        assert torch.equal(num_accepted.cpu(), eager[2])
        eager_mask, eager_depth = ops.build_tree_mask(static["parents"], static["num_nodes"], check_status=False)
        assert torch.equal(mask, eager_mask) and torch.equal(depth, eager_depth)
        assert (num_accepted >= 0).all()


def test_opcheck_cuda():
    rng = np.random.default_rng(0)
    c = make_case(rng, batch=3, nodes=4, vocab=11, dtype=torch.float32, with_probs=True, filters=(0.8, 3, 0.9))
    d = {k: to(v, DEVICE) for k, v in c.items()}
    path = torch.empty(3, 4, dtype=torch.int32, device=DEVICE)
    tokens = torch.empty(3, 5, dtype=torch.int64, device=DEVICE)
    num_accepted = torch.empty(3, dtype=torch.int32, device=DEVICE)
    args = (d["logits"], d["ids"], d["parents"], d["q"], d["num_nodes"], d["temperature"], d["top_k"],
            d["top_p"], torch.arange(3, dtype=torch.int64, device=DEVICE), None, None, path, tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.tree_verify.default, args)
    args = (d["logits"].half(), d["ids"], d["parents"], None, None, None, None, None, None, None, d["uniforms"],
            path, tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.tree_verify.default, args)
    torch.library.opcheck(torch.ops.specdec_ext.build_tree_mask.default,
                          (d["parents"], d["num_nodes"], torch.empty(3, 4, 4, dtype=torch.bool, device=DEVICE),
                           torch.empty(3, 4, dtype=torch.int32, device=DEVICE)))
