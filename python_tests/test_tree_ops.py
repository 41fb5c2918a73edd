"""Tree ops (csrc/tree.h): build_tree_mask and tree_verify against the float64 NumPy references of
reference_tree.py: exact (given uniforms), chain == tree, invariants, greedy, distribution of the
emitted tokens at depth 1 and of the pair at depths 1-2 for both lossless rules, opcheck, odd sizes,
and every bad-input path."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import reference as ref
import reference_tree as rt
from specdec_ext import ops

DTYPE_CASES = [torch.float32, torch.bfloat16, torch.float16]
FILTER_CASES = {
    "t1": (1.0, 0, 1.0),
    "t07_top_p09": (0.7, 0, 0.9),
    "t13_top_k5": (1.3, 5, 1.0),
    "top_k3_top_p08": (1.0, 3, 0.8),
    "greedy": (0.0, 0, 1.0),
}
MARGIN = 2e-5  # rows whose closest decision is nearer its boundary are not compared exactly


def random_parents(rng, batch, nodes, chain_bias=0.5):
    """Random topologically ordered trees: each node's parent is uniform in [-1, i), or i - 1."""
    parents = np.empty((batch, nodes), dtype=np.int32)
    for i in range(nodes):
        uniform_parent = rng.integers(-1, i, size=batch) if i > 0 else np.full(batch, -1)
        parents[:, i] = np.where(rng.random(batch) < chain_bias, i - 1, uniform_parent)
    return parents


def make_case(rng, batch, nodes, vocab, dtype, with_probs, filters, ragged=True, parents=None, scale=3.0):
    logits_np = rng.standard_normal((batch, nodes + 1, vocab)).astype(np.float32) * scale
    logits = torch.from_numpy(logits_np).to(dtype)
    parents = random_parents(rng, batch, nodes) if parents is None else np.broadcast_to(parents, (batch, nodes))
    parents = np.ascontiguousarray(parents, dtype=np.int32)
    q = None
    ids = np.empty((batch, nodes), dtype=np.int64)
    if with_probs:
        # siblings share the draft distribution of their parent's position and are drawn i.i.d. from it
        per_position = rng.dirichlet(np.full(vocab, 0.5), size=(batch, nodes + 1)).astype(np.float32)
        q_np = np.take_along_axis(per_position, (parents + 1)[:, :, None].astype(np.int64), axis=1)
        for b in range(batch):
            for i in range(nodes):
                w = q_np[b, i].astype(np.float64)
                ids[b, i] = rng.choice(vocab, p=w / w.sum())
        q = torch.from_numpy(np.ascontiguousarray(q_np))
    else:
        # deterministic candidates: often the target's argmax at the parent, so paths get accepted
        argmax = logits.float().argmax(-1).numpy()
        at_parent = np.take_along_axis(argmax, (parents + 1).astype(np.int64), axis=1)
        ids = np.where(rng.random((batch, nodes)) < 0.6, at_parent, rng.integers(0, vocab, (batch, nodes)))
    num_nodes = torch.from_numpy(rng.integers(0, nodes + 1, batch).astype(np.int32)) if ragged else None
    return dict(
        logits=logits, ids=torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
        parents=torch.from_numpy(parents), q=q, num_nodes=num_nodes,
        temperature=torch.full((batch,), filters[0], dtype=torch.float32),
        top_k=torch.full((batch,), filters[1], dtype=torch.int32),
        top_p=torch.full((batch,), filters[2], dtype=torch.float32),
        uniforms=torch.from_numpy(rng.random((batch, nodes + 1)).astype(np.float32)))


def run_op(c, **kw):
    kw.setdefault("uniforms", c.get("uniforms"))
    return ops.tree_verify(c["logits"], c["ids"], c["parents"], c["q"], num_nodes=c["num_nodes"],
                           temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"], **kw)


def run_reference(c, **kw):
    return rt.tree_verify(c["logits"].float().numpy(), c["ids"].numpy(), c["parents"].numpy(),
                          None if c["q"] is None else c["q"].numpy(),
                          None if c["num_nodes"] is None else c["num_nodes"].numpy(),
                          c["temperature"].numpy(), c["top_k"].numpy(), c["top_p"].numpy(),
                          c["uniforms"].numpy().astype(np.float64), **kw)


def assert_matches_reference(c, min_compared=0.8):
    path, tokens, num_accepted = run_op(c)
    ref_path, ref_tokens, ref_accepted, margin = run_reference(c, with_margin=True)
    rows = margin > MARGIN
    assert rows.mean() >= min_compared
    np.testing.assert_array_equal(num_accepted.numpy()[rows], ref_accepted[rows])
    np.testing.assert_array_equal(path.numpy()[rows], ref_path[rows])
    np.testing.assert_array_equal(tokens.numpy()[rows], ref_tokens[rows])
    return path, tokens, num_accepted


# ---------------------------------------------------------------------------------------------
# build_tree_mask
def test_build_tree_mask_hand_example():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    #    |
    #    5
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents)
    assert depth.tolist() == [[1, 1, 2, 2, 2, 3]]
    expected = [[1, 0, 0, 0, 0, 0],
                [0, 1, 0, 0, 0, 0],
                [1, 0, 1, 0, 0, 0],
                [1, 0, 0, 1, 0, 0],
                [0, 1, 0, 0, 1, 0],
                [1, 0, 1, 0, 0, 1]]
    assert mask.int().tolist() == [expected]
    # unused slots see only themselves and have depth 0; their parents are never read
    parents = torch.tensor([[-1, 0, 7, -5]], dtype=torch.int32)
    mask, depth = ops.build_tree_mask(parents, 2)
    assert depth.tolist() == [[1, 2, 0, 0]]
    assert mask.int().tolist() == [[[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]]


@pytest.mark.parametrize("nodes", [1, 5, 17, 64, 70])
def test_build_tree_mask_matches_reference(rng, nodes):
    parents = random_parents(rng, 20, nodes)
    num_nodes = rng.integers(0, nodes + 1, 20).astype(np.int32)
    for counts in (None, num_nodes):
        mask, depth = ops.build_tree_mask(torch.from_numpy(parents),
                                          None if counts is None else torch.from_numpy(counts))
        ref_mask, ref_depth = rt.build_tree_mask(parents, counts)
        np.testing.assert_array_equal(mask.numpy(), ref_mask)
        np.testing.assert_array_equal(depth.numpy(), ref_depth)


@st.composite
def trees(draw):
    nodes = draw(st.integers(0, 40))
    parents = [draw(st.integers(-1, i - 1)) for i in range(nodes)]
    return parents, draw(st.integers(0, nodes))


@settings(max_examples=60, deadline=None)
@given(trees())
def test_build_tree_mask_property(tree):
    parents, used = tree
    p = torch.tensor([parents], dtype=torch.int32).reshape(1, len(parents))
    mask, depth = ops.build_tree_mask(p, torch.tensor([used], dtype=torch.int32))
    ref_mask, ref_depth = rt.build_tree_mask(p.numpy(), [used])
    np.testing.assert_array_equal(mask.numpy(), ref_mask)
    np.testing.assert_array_equal(depth.numpy(), ref_depth)
    for i in range(used):  # a node sees itself and everything its parent sees, one level deeper
        assert mask[0, i, i] and int(mask[0, i].sum()) == int(depth[0, i])
        if parents[i] >= 0:
            assert bool((mask[0, i] >= mask[0, parents[i]]).all()) and depth[0, i] == depth[0, parents[i]] + 1


def test_build_tree_mask_empty_and_out_buffers():
    mask, depth = ops.build_tree_mask(torch.empty(3, 0, dtype=torch.int32))
    assert mask.shape == (3, 0, 0) and depth.shape == (3, 0)
    mask, depth = ops.build_tree_mask(torch.empty(0, 4, dtype=torch.int32))
    assert mask.shape == (0, 4, 4)
    with pytest.raises(ValueError, match="num_nodes"):
        ops.build_tree_mask(torch.empty(2, 0, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    out = (torch.ones(1, 3, 3, dtype=torch.bool), torch.full((1, 3), 9, dtype=torch.int32))
    mask, depth = ops.build_tree_mask(torch.tensor([[-1, 0, 0]], dtype=torch.int32), out=out)
    assert mask is out[0] and depth is out[1] and depth.tolist() == [[1, 2, 2]]


@pytest.mark.parametrize("parents, num_nodes, code, name", [
    ([[-1, 1, 0]], None, -9, "parents"),           # parent == own index
    ([[-1, 0, 5]], None, -9, "parents"),           # parent after the node
    ([[1, 0, -1]], None, -9, "parents"),           # a cycle 0 -> 1 -> 0
    ([[-1, -2, 0]], None, -9, "parents"),          # below -1
    ([[-1, 0, 1]], [4], -10, "num_nodes"),
    ([[-1, 0, 1]], [-1], -10, "num_nodes"),
])
def test_build_tree_mask_invalid_rows(parents, num_nodes, code, name):
    good = [-1, 0, 0]
    p = torch.tensor([good] + parents, dtype=torch.int32)
    counts = None if num_nodes is None else torch.tensor([3] + num_nodes, dtype=torch.int32)
    mask, depth = ops.build_tree_mask(p, counts, check_status=False)
    assert depth[1].tolist() == [code] * 3 and not mask[1].any()
    assert depth[0].tolist() == [1, 2, 2]
    with pytest.raises(ValueError, match=f"build_tree_mask: {name}: row 1"):
        ops.build_tree_mask(p, counts)


def test_build_tree_mask_bad_arguments():
    with pytest.raises(RuntimeError, match="parents must have dtype Int"):
        ops.build_tree_mask(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="parents must be a 2-D tensor"):
        ops.build_tree_mask(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="num_nodes dimension 0 must be B"):
        ops.build_tree_mask(torch.zeros(2, 3, dtype=torch.int32) - 1, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="mask dimension 2 must be N"):
        ops.build_tree_mask(torch.zeros(1, 3, dtype=torch.int32) - 1,
                            out=(torch.empty(1, 3, 4, dtype=torch.bool), torch.empty(1, 3, dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="depth must have dtype Int"):
        ops.build_tree_mask(torch.zeros(1, 3, dtype=torch.int32) - 1,
                            out=(torch.empty(1, 3, 3, dtype=torch.bool), torch.empty(1, 3, dtype=torch.int64)))


# ---------------------------------------------------------------------------------------------
# tree_verify: exact, odd sizes, greedy, chains
@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("filter_name", list(FILTER_CASES))
def test_exact_against_reference(rng, dtype, with_probs, filter_name):
    c = make_case(rng, batch=24, nodes=8, vocab=50, dtype=dtype, with_probs=with_probs,
                  filters=FILTER_CASES[filter_name])
    assert_matches_reference(c)


@pytest.mark.parametrize("vocab", [1, 7, 32001])
@pytest.mark.parametrize("with_probs", [True, False])
def test_odd_vocab_sizes(rng, vocab, with_probs):
    c = make_case(rng, batch=5, nodes=6, vocab=vocab, dtype=torch.float32, with_probs=with_probs,
                  filters=(0.9, 0, 0.95))
    path, tokens, num_accepted = assert_matches_reference(c, min_compared=0.6)
    if vocab == 1:  # one token: node 0 (a child of the root) is accepted, then its first child, ...
        for b in range(5):
            n, d = int(c["num_nodes"][b]), int(num_accepted[b])
            walk, node = [], -1
            while True:
                kids = [i for i in range(n) if int(c["parents"][b, i]) == node]
                if not kids:
                    break
                node = kids[0]
                walk.append(node)
            assert path[b, :d].tolist() == walk and tokens[b, d] == 0


def test_single_node_and_zero_nodes(rng):
    # N = 0: only the bonus token from row 0
    logits = torch.tensor([[[0.0, 5.0, 1.0]]])
    path, tokens, n = ops.tree_verify(logits, torch.empty(1, 0, dtype=torch.int64),
                                      torch.empty(1, 0, dtype=torch.int32), temperature=0.0, seed=0)
    assert path.shape == (1, 0) and tokens.tolist() == [[1]] and n.tolist() == [0]
    c = make_case(rng, batch=30, nodes=1, vocab=9, dtype=torch.float32, with_probs=True, filters=(1.0, 0, 1.0))
    assert_matches_reference(c)


def test_mixed_rows_each_with_own_filter(rng):
    batch = 40
    c = make_case(rng, batch=batch, nodes=12, vocab=64, dtype=torch.float32, with_probs=True, filters=(1.0, 0, 1.0))
    c["temperature"] = torch.from_numpy(rng.choice([0.0, 0.5, 1.0, 1.5], batch).astype(np.float32))
    c["top_k"] = torch.from_numpy(rng.choice([0, 1, 4, 63, 64, 100], batch).astype(np.int32))
    c["top_p"] = torch.from_numpy(rng.choice([1.0, 0.9, 0.5, 0.01], batch).astype(np.float32))
    assert_matches_reference(c)


def test_hand_computed_two_children():
    # V = 4, p at the root = [0.1, 0.6, 0.3, 0]: children 0 (token 3, p = 0) and 1 (token 1)
    p_root = np.array([0.1, 0.6, 0.3, 0.0])
    logits = torch.full((1, 3, 4), float("-inf"))
    logits[0, 0, :3] = torch.from_numpy(np.log(p_root[:3])).float()
    logits[0, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0])
    logits[0, 2, 3] = 0.0  # one-hot at token 3
    ids = torch.tensor([[3, 1]])
    parents = torch.tensor([[-1, -1]], dtype=torch.int32)
    # deterministic rule: token 3 rejected (p = 0, p unchanged); token 1 accepted when u1 < 0.6
    path, tokens, n = ops.tree_verify(logits, ids, parents, uniforms=torch.tensor([[0.5, 0.59, 0.0]]))
    assert path.tolist() == [[1, -1]] and n.tolist() == [1]
    assert tokens.tolist() == [[1, 3, -1]]  # the bonus at node 1 is its argmax 3 (u = 0)
    # u1 = 0.61 rejects token 1: p becomes [0.25, 0, 0.75, 0]; u = 0.3 -> cumulative 0.25, 1.0 -> token 2
    path, tokens, n = ops.tree_verify(logits, ids, parents, uniforms=torch.tensor([[0.5, 0.61, 0.3]]))
    assert path.tolist() == [[-1, -1]] and tokens.tolist() == [[2, -1, -1]] and n.tolist() == [0]
    # with q: both children drawn from q = [0.5, 0.5, 0, 0] ... token 3 has q = 0 here, accepted iff p > 0
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]]])
    ids_q = torch.tensor([[2, 1]])
    # node 0 (token 2): p = 0.3 < q = 0.5, accepted iff u < 0.6; u = 0.7 rejects:
    # residual max(0, p - q) = [0.1, 0.1, 0, 0] / 0.2 -> [0.5, 0.5, 0, 0]; node 1 (token 1): p = 0.5 = q, accepted
    path, tokens, n = ops.tree_verify(logits, ids_q, parents, q, uniforms=torch.tensor([[0.7, 0.99, 0.0]]))
    assert path.tolist() == [[1, -1]] and tokens.tolist() == [[1, 3, -1]]
    # u0 = 0.59 accepts node 0, then node 0 is a leaf: bonus from row 1 (uniform over 4), u = 0.6 -> token 2
    path, tokens, n = ops.tree_verify(logits, ids_q, parents, q, uniforms=torch.tensor([[0.59, 0.99, 0.6]]))
    assert path.tolist() == [[0, -1]] and tokens.tolist() == [[2, 2, -1]]


@pytest.mark.parametrize("with_probs", [True, False])
def test_greedy_follows_argmax(rng, with_probs):
    c = make_case(rng, batch=60, nodes=10, vocab=30, dtype=torch.float32, with_probs=with_probs,
                  filters=(0.0, 0, 1.0))
    at_parent = torch.gather(c["logits"].argmax(-1), 1, c["parents"].long() + 1)
    c["ids"] = torch.where(torch.rand(60, 10, generator=torch.Generator().manual_seed(0)) < 0.6, at_parent, c["ids"])
    path, tokens, n = run_op(c, uniforms=None, seed=torch.arange(60))
    argmax = c["logits"].argmax(-1)
    for b in range(60):
        nn, node, depth = int(c["num_nodes"][b]), -1, 0
        while True:
            target = int(argmax[b, node + 1])
            kids = [i for i in range(nn) if int(c["parents"][b, i]) == node and int(c["ids"][b, i]) == target]
            if not kids:
                assert tokens[b, depth] == target and n[b] == depth
                break
            assert path[b, depth] == kids[0] and tokens[b, depth] == target
            node, depth = kids[0], depth + 1
    assert (n > 0).sum() > 10


def chain_case(rng, batch, k, vocab, dtype, with_probs, filters):
    c = make_case(rng, batch, k, vocab, dtype, with_probs, filters, parents=np.arange(-1, k - 1, dtype=np.int32))
    return c


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_tree_equals_chain_verify(rng, dtype, with_probs):
    batch, k = 64, 6
    c = chain_case(rng, batch, k, 40, dtype, with_probs, (1.0, 0, 1.0))
    c["temperature"] = torch.from_numpy(rng.choice([0.0, 0.6, 1.0], batch).astype(np.float32))
    c["top_k"] = torch.from_numpy(rng.choice([0, 3, 20], batch).astype(np.int32))
    c["top_p"] = torch.from_numpy(rng.choice([1.0, 0.9, 0.6], batch).astype(np.float32))
    seeds, offsets = torch.arange(batch) * 7 + 1, torch.arange(batch) % 5
    for draws in (dict(uniforms=c["uniforms"]), dict(seed=seeds, offset=offsets)):
        path, tokens, n = run_op(c, **{"uniforms": None, **draws})
        chain_tokens, chain_n = ops.chain_verify(
            c["logits"], c["ids"], c["q"], num_draft=c["num_nodes"], temperature=c["temperature"],
            top_k=c["top_k"], top_p=c["top_p"], **draws)
        assert torch.equal(tokens, chain_tokens) and torch.equal(n, chain_n)
        for b in range(batch):
            assert path[b].tolist() == list(range(n[b])) + [-1] * (k - n[b])
    assert 0 < (n > 0).float().mean() < 1


# ---------------------------------------------------------------------------------------------
# invariants and Philox draws
@pytest.mark.parametrize("with_probs", [True, False])
def test_invariants_on_many_rows(rng, with_probs):
    batch, nodes, vocab = 400, 12, 20
    c = make_case(rng, batch=batch, nodes=nodes, vocab=vocab, dtype=torch.float32, with_probs=with_probs,
                  filters=(1.0, 0, 1.0))
    path, tokens, n = (t.numpy() for t in run_op(c, uniforms=None, seed=torch.arange(batch), offset=11))
    parents, ids, counts = c["parents"].numpy(), c["ids"].numpy(), c["num_nodes"].numpy()
    assert (n >= 0).all()
    for b in range(batch):
        d = n[b]
        node = -1
        for level in range(d):  # a root-to-node path through used nodes, tokens are the nodes' tokens
            assert 0 <= path[b, level] < counts[b] and parents[b, path[b, level]] == node
            node = path[b, level]
            assert tokens[b, level] == ids[b, node]
        assert (path[b, d:] == -1).all() and (tokens[b, d + 1:] == -1).all()
        assert 0 <= tokens[b, d] < vocab
        if not with_probs:  # a rejected candidate is removed from p: never the recovered token
            rejected = [ids[b, i] for i in range(counts[b]) if parents[b, i] == node]
            assert tokens[b, d] not in rejected
    assert (n >= 2).sum() > 20


def test_seeded_draws_are_philox_and_independent_of_batch_position(rng):
    c = make_case(rng, batch=12, nodes=7, vocab=30, dtype=torch.float32, with_probs=True, filters=(1.0, 0, 1.0))
    seeds = torch.arange(100, 112, dtype=torch.int64)
    offsets = torch.arange(12, dtype=torch.int64) * 5
    seeded = run_op(c, uniforms=None, seed=seeds, offset=offsets)
    explicit = run_op(c, uniforms=ops.philox_uniforms(seeds, offsets, 8))
    for a, b in zip(seeded, explicit):
        assert torch.equal(a, b)
    for b in (0, 7):
        one = {key: (v[b:b + 1] if isinstance(v, torch.Tensor) else v) for key, v in c.items()}
        single = run_op(one, uniforms=None, seed=seeds[b:b + 1], offset=offsets[b:b + 1])
        for a, full in zip(single, seeded):
            assert torch.equal(a[0], full[b])



@pytest.mark.parametrize("with_probs", [True, False])
def test_a_rows_draws_do_not_depend_on_the_buffer_width(rng, with_probs):
    """Rows using 4 nodes of N = 8 buffers emit exactly what the same 4-node trees give in N = 4 buffers,
    seeded: column num_nodes (not N) draws the recovered or bonus token."""
    c = make_case(rng, batch=16, nodes=8, vocab=30, dtype=torch.float32, with_probs=with_probs, filters=(1.0, 0, 1.0))
    c["num_nodes"] = torch.full((16,), 4, dtype=torch.int32)
    seeds, offsets = torch.arange(16, dtype=torch.int64) + 40, torch.full((16,), 6, dtype=torch.int64)
    wide = run_op(c, uniforms=None, seed=seeds, offset=offsets)
    narrow_case = dict(c, logits=c["logits"][:, :5].contiguous(), ids=c["ids"][:, :4].contiguous(),
                       parents=c["parents"][:, :4].contiguous(), q=None if c["q"] is None else c["q"][:, :4].contiguous())
    path, tokens, accepted = run_op(narrow_case, uniforms=None, seed=seeds, offset=offsets)
    assert torch.equal(wide[2], accepted) and torch.equal(wide[0][:, :4], path) and torch.equal(wide[1][:, :5], tokens)
    assert bool((wide[1][:, 5:] == -1).all())

def test_out_buffers_are_written_in_place(rng):
    c = make_case(rng, batch=4, nodes=5, vocab=10, dtype=torch.float32, with_probs=False, filters=(1.0, 0, 1.0))
    out = (torch.full((4, 5), 77, dtype=torch.int32), torch.full((4, 6), 77), torch.full((4,), 77, dtype=torch.int32))
    result = run_op(c, out=out)
    assert all(r is o for r, o in zip(result, out))
    expected = run_op(c)
    assert all(torch.equal(r, e) for r, e in zip(result, expected))


# ---------------------------------------------------------------------------------------------
# Distribution: two-level trees, both rules. The target is a fixed two-step model: p0 at the root,
# p1[x] after token x (the logits of a depth-1 node with token x are L1[x]); the drafter is q0, q1[x].
DRAWS = 20_000
VOCAB_SMALL = 6
TWO_LEVEL = [-1, -1, 0, 0, 1, 1]  # full_tree_parents([2, 2])


def two_level_model(filters, seed=5):
    rng = np.random.default_rng(seed)
    model = dict(L0=rng.standard_normal(VOCAB_SMALL) * 1.2,
                 L1=rng.standard_normal((VOCAB_SMALL, VOCAB_SMALL)) * 1.2,
                 L2=rng.standard_normal(VOCAB_SMALL),
                 q0=rng.dirichlet(np.full(VOCAB_SMALL, 0.6)),
                 q1=rng.dirichlet(np.full(VOCAB_SMALL, 0.6), size=VOCAB_SMALL))
    model["p0"] = ref.filtered_probs(model["L0"], *filters)
    model["p1"] = np.stack([ref.filtered_probs(model["L1"][x], *filters) for x in range(VOCAB_SMALL)])
    return model, rng


def two_level_case(model, rng, with_probs):
    """Per row: depth-1 tokens t0, t1 and depth-2 tokens (t2, t3 under t0; t4, t5 under t1), drawn
    i.i.d. from the drafter (with_probs) or its top-2 (deterministic candidates)."""
    vocab = VOCAB_SMALL
    if with_probs:
        t01 = rng.choice(vocab, size=(DRAWS, 2), p=model["q0"])
        cdf = np.cumsum(model["q1"], axis=1)[t01]                       # [DRAWS, 2, V]
        below = (rng.random((DRAWS, 2, 2, 1)) * cdf[:, :, None, -1:] >= cdf[:, :, None, :]).sum(-1)
        t2345 = np.minimum(below, vocab - 1).reshape(DRAWS, 4)          # two i.i.d. children per node
        q = np.concatenate([np.broadcast_to(model["q0"], (DRAWS, 2, vocab)),
                            np.repeat(model["q1"][t01], 2, axis=1)], axis=1)
    else:
        top2 = lambda w: np.argsort(-w, kind="stable")[:2]  # noqa: E731
        t01 = np.broadcast_to(top2(model["q0"]), (DRAWS, 2))
        t2345 = np.broadcast_to(np.concatenate([top2(model["q1"][t]) for t in t01[0]]), (DRAWS, 4))
        q = None
    ids = np.ascontiguousarray(np.concatenate([t01, t2345], axis=1), dtype=np.int64)
    logits = np.empty((DRAWS, 7, vocab), dtype=np.float32)
    logits[:, 0] = model["L0"]
    logits[:, 1:3] = model["L1"][t01]
    logits[:, 3:] = model["L2"]
    return logits, ids, q


def emitted_pairs(tokens, n, model, rng):
    """(x, y): the token at depth 1 and the one at depth 2; where only x was emitted (rejected at the
    root) y is drawn from the exact next-step target p1[x], as the next decode step would."""
    x = tokens[:, 0]
    y_next_step = (rng.random(len(x))[:, None] >= np.cumsum(model["p1"][x], axis=1)).sum(1)
    y = np.where(n >= 1, tokens[:, 1], np.minimum(y_next_step, VOCAB_SMALL - 1))
    return x, y


def chi_square_pvalue(samples, probs, min_expected=5.0):
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the filtered support was emitted"
    counts, expected = counts[support], probs[support] * len(samples)
    small = expected < min_expected  # pool rare cells into one
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(counts, expected).pvalue


def distribution_pvalues(tokens, n, model, rng):
    x, y = emitted_pairs(tokens, n, model, rng)
    joint = (model["p0"][:, None] * model["p1"]).ravel()
    return chi_square_pvalue(x, model["p0"]), chi_square_pvalue(x * VOCAB_SMALL + y, joint)


FILTERS_DIST = [(1.0, 0, 1.0), (0.7, 0, 0.9)]


@pytest.mark.parametrize("filters", FILTERS_DIST, ids=["t1", "t07_top_p09"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["q_rule", "deterministic_rule"])
def test_emitted_tokens_follow_filtered_target(filters, with_probs):
    model, rng = two_level_model(filters)
    logits, ids, q = two_level_case(model, rng, with_probs)
    parents = torch.tensor(TWO_LEVEL, dtype=torch.int32)  # one tree shared by every row
    path, tokens, n = ops.tree_verify(
        torch.from_numpy(logits), torch.from_numpy(ids), parents,
        None if q is None else torch.from_numpy(q.astype(np.float32)),
        temperature=filters[0], top_k=filters[1], top_p=filters[2], seed=torch.arange(DRAWS), offset=9)
    tokens, n = tokens.numpy(), n.numpy()
    assert (n == 0).mean() > 0.02 and (n == 1).mean() > 0.02 and (n == 2).mean() > 0.02
    p_depth1, p_pair = distribution_pvalues(tokens, n, model, rng)
    assert p_depth1 > 1e-4, f"depth-1 token: chi-square p = {p_depth1:.2e}"
    assert p_pair > 1e-4, f"depth 1-2 pair: chi-square p = {p_pair:.2e}"


@pytest.mark.parametrize("filters", FILTERS_DIST, ids=["t1", "t07_top_p09"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["q_rule", "deterministic_rule"])
def test_distribution_test_detects_a_verifier_that_skips_the_residual(filters, with_probs):
    """The same statistics reject the reference run with the residual update skipped."""
    model, rng = two_level_model(filters)
    logits, ids, q = two_level_case(model, rng, with_probs)
    rows = DRAWS // 2  # a pure-Python verifier: half the rows already reject decisively
    ones = np.ones(rows)
    _, tokens, n = rt.tree_verify(logits[:rows], ids[:rows], np.broadcast_to(TWO_LEVEL, (rows, 6)),
                                  None if q is None else q[:rows], None, ones * filters[0],
                                  ones * filters[1], ones * filters[2], rng.random((rows, 7)),
                                  skip_residual=True)
    p_depth1, p_pair = distribution_pvalues(tokens, n, model, rng)
    assert p_depth1 < 1e-6 and p_pair < 1e-6, (p_depth1, p_pair)


# ---------------------------------------------------------------------------------------------
def test_opcheck(rng):
    c = make_case(rng, batch=3, nodes=4, vocab=11, dtype=torch.float32, with_probs=True, filters=(0.8, 3, 0.9))
    path = torch.empty(3, 4, dtype=torch.int32)
    tokens = torch.empty(3, 5, dtype=torch.int64)
    num_accepted = torch.empty(3, dtype=torch.int32)
    args = (c["logits"], c["ids"], c["parents"], c["q"], c["num_nodes"], c["temperature"], c["top_k"],
            c["top_p"], torch.arange(3, dtype=torch.int64), None, None, path, tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.tree_verify.default, args)
    args = (c["logits"].half(), c["ids"], c["parents"], None, None, None, None, None, None, None, c["uniforms"],
            path, tokens, num_accepted)
    torch.library.opcheck(torch.ops.specdec_ext.tree_verify.default, args)
    torch.library.opcheck(torch.ops.specdec_ext.build_tree_mask.default,
                          (c["parents"], c["num_nodes"], torch.empty(3, 4, 4, dtype=torch.bool),
                           torch.empty(3, 4, dtype=torch.int32)))
    torch.library.opcheck(torch.ops.specdec_ext.build_tree_mask.default,
                          (c["parents"], None, torch.empty(3, 4, 4, dtype=torch.bool),
                           torch.empty(3, 4, dtype=torch.int32)))


# ---------------------------------------------------------------------------------------------
# bad inputs: argument errors raise RuntimeError from the shared checks, row errors ValueError
def good_args():
    return dict(target_logits=torch.randn(2, 4, 5), tree_token_ids=torch.zeros(2, 3, dtype=torch.int64),
                parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]], dtype=torch.int32),
                draft_probs=torch.full((2, 3, 5), 0.2), seed=torch.arange(2, dtype=torch.int64))


def call(**overrides):
    a = {**good_args(), **overrides}
    return ops.tree_verify(a.pop("target_logits"), a.pop("tree_token_ids"), a.pop("parents"),
                           a.pop("draft_probs"), **a)


def test_good_args_work():
    call()


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 1]], dtype=torch.int32)), RuntimeError,
     r"parents dimension 1 must be N \(target_logits has N\+1 positions\) = 3"),
    (dict(tree_token_ids=torch.zeros(2, 4, dtype=torch.int64)), RuntimeError, "tree_token_ids dimension 1 must be N"),
    (dict(parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]], dtype=torch.int64)), RuntimeError,
     "parents must have dtype Int"),
    (dict(tree_token_ids=torch.zeros(2, 3, dtype=torch.int32)), RuntimeError, "tree_token_ids must have dtype Long"),
    (dict(parents=torch.tensor([[[-1, 0, 0]]] * 2, dtype=torch.int32)), RuntimeError,
     r"parents must be a 2-D tensor \[B, N\]"),
    (dict(draft_probs=torch.full((2, 3, 6), 0.2)), RuntimeError, "draft_probs dimension 2 must be V"),
    (dict(draft_probs=torch.full((2, 2, 5), 0.2)), RuntimeError, "draft_probs dimension 1 must be N"),
    (dict(draft_probs=torch.full((2, 3, 5), 0.2, dtype=torch.float64)), RuntimeError, "draft_probs must have dtype Float"),
    (dict(target_logits=torch.randn(2, 4, 5, dtype=torch.float64)), RuntimeError, "target_logits must have dtype"),
    (dict(target_logits=torch.randn(4, 2, 5).transpose(0, 1)), RuntimeError, "target_logits must be contiguous"),
    (dict(num_nodes=torch.tensor([3, 3, 3], dtype=torch.int32)), RuntimeError, "num_nodes dimension 0 must be B"),
    (dict(uniforms=torch.rand(2, 3)), RuntimeError, "uniforms dimension 1 must be the number of draws per row = 4"),
    (dict(temperature=torch.ones(2, dtype=torch.float64)), RuntimeError, "temperature must have dtype Float"),
    # row errors, reported per row and raised by the wrapper naming the argument
    (dict(parents=torch.tensor([[-1, 0, 0], [-1, 2, 1]], dtype=torch.int32)), ValueError,
     "tree_verify: parents: row 1 is not a valid tree"),
    (dict(parents=torch.tensor([[-1, 0, 0], [1, 0, 1]], dtype=torch.int32)), ValueError,  # a cycle 0 <-> 1
     "tree_verify: parents: row 1 is not a valid tree"),
    (dict(parents=torch.tensor([[-1, 0, -3], [-1, -1, 1]], dtype=torch.int32)), ValueError,
     "tree_verify: parents: row 0 is not a valid tree"),
    (dict(tree_token_ids=torch.tensor([[0, 0, 0], [0, 5, 0]])), ValueError,
     r"tree_verify: tree_token_ids: row 1 has a token id outside \[0, V\)"),
    (dict(tree_token_ids=torch.tensor([[0, 0, -1], [0, 0, 0]])), ValueError, "tree_token_ids: row 0"),
    (dict(num_nodes=4), ValueError, r"tree_verify: num_nodes: row 0 is outside \[0, N\]"),
    (dict(num_nodes=-1), ValueError, "tree_verify: num_nodes: row 0"),
    (dict(temperature=-1.0), ValueError, "temperature: row 0"),
    (dict(top_k=-2), ValueError, "top_k: row 0"),
    (dict(top_p=0.0), ValueError, "top_p: row 0"),
    (dict(seed=None, uniforms=torch.full((2, 4), 1.0)), ValueError, "uniforms: row 0"),
    (dict(draft_probs=torch.full((2, 3, 5), -0.2)), ValueError, "draft_probs: row 0"),
    (dict(draft_probs=torch.tensor([0.0, 0.25, 0.25, 0.25, 0.25]).expand(2, 3, 5).contiguous()), ValueError,
     r"draft_probs: row 0 .* > 1 or 0 \(x cannot have been drawn from it\)"),  # node 0's token 0 cannot have been drawn from its q
    (dict(target_logits=torch.full((2, 4, 5), float("nan"))), ValueError, "target_logits: row 0"),
])
def test_bad_inputs_raise_naming_the_problem(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**overrides)


def test_invalid_row_leaves_other_rows_and_fills_empty():
    a = good_args()
    parents = torch.tensor([[-1, 0, 0], [0, 0, 0]], dtype=torch.int32)
    path, tokens, n = ops.tree_verify(a["target_logits"], a["tree_token_ids"], parents, a["draft_probs"],
                                      seed=a["seed"], check_status=False)
    assert n[1] == -9 and (path[1] == -1).all() and (tokens[1] == -1).all()
    assert n[0] >= 0 and tokens[0, n[0]] >= 0
    # unused slots are never read: an invalid parent and token id past num_nodes are fine
    ids = torch.tensor([[0, 0, 99], [0, 0, 0]])
    parents = torch.tensor([[-1, 0, 7], [-1, 0, 0]], dtype=torch.int32)
    ops.tree_verify(a["target_logits"], ids, parents, a["draft_probs"], num_nodes=torch.tensor([2, 3], dtype=torch.int32),
                    seed=a["seed"])
