"""kv_write / kv_compact: exact agreement with the NumPy references (reference_kv.py), every dtype,
strided inputs, padding and out-of-range skips, opcheck, and every bad-input path."""
import numpy as np
import pytest
import torch

import reference_kv as ref
from specdec_ext import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _as_np(t):
    return t.float().numpy() if t.dtype != torch.float32 else t.numpy()


def _pool(rng, planes, num_pages, page_size, heads, head_dim, dtype):
    return torch.from_numpy(rng.standard_normal((planes, num_pages, page_size, heads, head_dim))).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_kv_write_matches_reference(dtype, transposed):
    rng = np.random.default_rng(0)
    B, T, H, D, NP, PS = 3, 5, 2, 8, 7, 4
    pool = _pool(rng, 2, NP, PS, H, D, dtype)
    if transposed:  # HF layout [B, H, T, D] viewed as [B, T, H, D]
        key = torch.from_numpy(rng.standard_normal((B, H, T, D))).to(dtype).transpose(1, 2)
        value = torch.from_numpy(rng.standard_normal((B, H, T, D))).to(dtype).transpose(1, 2)
    else:
        key = torch.from_numpy(rng.standard_normal((B, T, H, D))).to(dtype)
        value = torch.from_numpy(rng.standard_normal((B, T, H, D))).to(dtype)
    slots = torch.from_numpy(rng.permutation(NP * PS)[: B * T].reshape(B, T)).long()
    slots[0, 3:] = -1          # padding
    slots[2, 1] = NP * PS + 3  # out of range: skipped
    expected = ref.kv_write(_as_np(key), _as_np(value), slots.numpy(), _as_np(pool))
    ops.kv_write(key, value, slots, pool)
    np.testing.assert_array_equal(_as_np(pool), expected)


@pytest.mark.parametrize("B, T, H, D, NP, PS", [(1, 1, 1, 1, 1, 1), (2, 7, 3, 5, 5, 3), (4, 3, 1, 64, 13, 1)])
def test_kv_write_odd_sizes(B, T, H, D, NP, PS):
    rng = np.random.default_rng(B * 100 + T)
    pool = _pool(rng, 2, NP, PS, H, D, torch.float32)
    key = torch.from_numpy(rng.standard_normal((B, T, H, D))).float()
    value = torch.from_numpy(rng.standard_normal((B, T, H, D))).float()
    slots = torch.full((B, T), -1, dtype=torch.int64).view(-1)
    count = min(B * T, NP * PS)
    slots[:count] = torch.from_numpy(rng.permutation(NP * PS)[:count])
    slots = slots.view(B, T)
    expected = ref.kv_write(key.numpy(), value.numpy(), slots.numpy(), pool.numpy())
    ops.kv_write(key, value, slots, pool)
    np.testing.assert_array_equal(pool.numpy(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_compact_matches_reference(dtype):
    rng = np.random.default_rng(1)
    B, NP, PS, H, D, planes = 4, 12, 4, 2, 3, 6  # 3 layers x (K, V)
    pool = _pool(rng, planes, NP, PS, H, D, dtype)
    tables = torch.from_numpy(rng.permutation(NP)[: B * 3].reshape(B, 3).astype(np.int32))
    tables[3, 2] = -1  # an unassigned page: copies touching it are skipped
    src = torch.tensor([[5, 7, 8, -1], [2, 3, -1, 9], [4, 6, 9, 11], [6, 9, 10, -1]], dtype=torch.int64)
    dst = torch.tensor([3, 2, 1, 5], dtype=torch.int64)
    expected = ref.kv_compact(_as_np(pool), tables.numpy(), src.numpy(), dst.numpy())
    ops.kv_compact(pool, tables, src, dst)
    np.testing.assert_array_equal(_as_np(pool), expected)


def test_kv_compact_tree_path_semantics():
    # A path of accepted nodes (strictly increasing storage positions) lands right after token 0.
    NP, PS = 4, 4
    pool = torch.arange(2 * NP * PS, dtype=torch.float32).reshape(2, NP, PS, 1, 1)
    tables = torch.tensor([[2, 0, 3, -1]], dtype=torch.int32)
    before = pool.clone()
    # committed length 3, token 0 at position 3, nodes at positions 4.., accepted nodes 1, 2, 5
    src = torch.tensor([[3 + 1 + 1, 3 + 1 + 2, 3 + 1 + 5]], dtype=torch.int64)
    ops.kv_compact(pool, tables, src, torch.tensor([4]))

    def at(t, p):
        return t[:, tables[0, p // PS], p % PS].flatten()

    for j, p in enumerate(src[0].tolist()):
        torch.testing.assert_close(at(pool, 4 + j), at(before, p))
    for p in range(4):  # the prefix and token 0 are untouched
        torch.testing.assert_close(at(pool, p), at(before, p))


def test_empty_inputs_are_noops():
    pool = torch.zeros(2, 2, 2, 1, 4)
    ops.kv_write(torch.zeros(0, 3, 1, 4), torch.zeros(0, 3, 1, 4), torch.zeros(0, 3, dtype=torch.long), pool)
    ops.kv_compact(pool, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.long),
                   torch.zeros(0, dtype=torch.long))
    ops.kv_compact(pool, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.long),
                   torch.zeros(2, dtype=torch.long))
    assert not pool.any()


def test_opcheck():
    rng = np.random.default_rng(2)
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(rng, 2, 5, 4, 2, 8, dtype)
        key = torch.randn(2, 3, 2, 8).to(dtype)
        value = torch.randn(2, 3, 2, 8).to(dtype)
        slots = torch.tensor([[0, 5, -1], [7, 19, 2]], dtype=torch.int64)
        torch.library.opcheck(torch.ops.specdec_ext.kv_write.default, (key, value, slots, pool))
        tables = torch.tensor([[1, 3], [0, 4]], dtype=torch.int32)
        src = torch.tensor([[3, 5], [6, -1]], dtype=torch.int64)
        torch.library.opcheck(torch.ops.specdec_ext.kv_compact.default,
                              (pool, tables, src, torch.tensor([1, 2], dtype=torch.int64)))


def _write_args():
    return dict(key=torch.zeros(2, 3, 2, 4), value=torch.zeros(2, 3, 2, 4),
                slot_mapping=torch.zeros(2, 3, dtype=torch.int64), kv_cache=torch.zeros(2, 5, 4, 2, 4))


@pytest.mark.parametrize("name, bad, message", [
    ("kv_cache", torch.zeros(5, 4, 2, 4), r"kv_cache must be a 5-D tensor \[2, num_pages, page_size, H, D\], got shape \[5, 4, 2, 4\]"),
    ("kv_cache", torch.zeros(3, 5, 4, 2, 4), r"kv_cache dimension 0 must be 2 \(K and V\) = 2, got shape \[3, 5, 4, 2, 4\]"),
    ("kv_cache", torch.zeros(2, 5, 4, 2, 4, dtype=torch.float64), "kv_cache must have dtype Float or BFloat16 or Half, got Double"),
    ("kv_cache", torch.zeros(2, 5, 4, 4, 2).transpose(3, 4), "kv_cache must be contiguous"),
    ("key", torch.zeros(2, 3, 2), r"key must be a 4-D tensor \[B, T, H, D\], got shape \[2, 3, 2\]"),
    ("key", torch.zeros(2, 3, 3, 4), r"key dimension 2 must be H \(kv_cache dimension 3\) = 2, got shape \[2, 3, 3, 4\]"),
    ("key", torch.zeros(2, 3, 2, 5), r"key dimension 3 must be D \(kv_cache dimension 4\) = 4, got shape \[2, 3, 2, 5\]"),
    ("key", torch.zeros(2, 3, 2, 4, dtype=torch.bfloat16), r"key must have the dtype of kv_cache \(Float\), got BFloat16"),
    ("value", torch.zeros(2, 2, 2, 4), r"value must have the shape of key \[2, 3, 2, 4\], got \[2, 2, 2, 4\]"),
    ("value", torch.zeros(2, 3, 2, 4, dtype=torch.half), r"value must have the dtype of kv_cache \(Float\), got Half"),
    ("slot_mapping", torch.zeros(2, 3, dtype=torch.int32), "slot_mapping must have dtype Long, got Int"),
    ("slot_mapping", torch.zeros(3, 3, dtype=torch.int64), r"slot_mapping dimension 0 must be B \(key dimension 0\) = 2, got shape \[3, 3\]"),
    ("slot_mapping", torch.zeros(2, 4, dtype=torch.int64), r"slot_mapping dimension 1 must be T \(key dimension 1\) = 3, got shape \[2, 4\]"),
    ("slot_mapping", torch.zeros(3, 2, dtype=torch.int64).t(), "slot_mapping must be contiguous"),
])
def test_kv_write_bad_inputs(name, bad, message):
    args = _write_args()
    args[name] = bad
    with pytest.raises(RuntimeError, match="kv_write: " + message):
        torch.ops.specdec_ext.kv_write(args["key"], args["value"], args["slot_mapping"], args["kv_cache"])


def test_kv_write_check_slots():
    args = _write_args()
    args["slot_mapping"][1, 2] = 20
    with pytest.raises(ValueError, match="slot 20 but the pool has 20 slots"):
        ops.kv_write(*args.values(), check_slots=True)


def _compact_args():
    return dict(kv_cache=torch.zeros(4, 5, 4, 2, 4), block_tables=torch.zeros(2, 3, dtype=torch.int32),
                src_positions=torch.zeros(2, 4, dtype=torch.int64), dst_start=torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("name, bad, message", [
    ("kv_cache", torch.zeros(4, 5, 4, 2), r"kv_cache must be a 5-D tensor \[X, num_pages, page_size, H, D\]"),
    ("kv_cache", torch.zeros(4, 5, 4, 2, 4, dtype=torch.int32), "kv_cache must have dtype Float or BFloat16 or Half, got Int"),
    ("block_tables", torch.zeros(2, 3, dtype=torch.int64), "block_tables must have dtype Int, got Long"),
    ("block_tables", torch.zeros(2, dtype=torch.int32), r"block_tables must be a 2-D tensor \[B, P\], got shape \[2\]"),
    ("src_positions", torch.zeros(3, 4, dtype=torch.int64), r"src_positions dimension 0 must be B \(block_tables dimension 0\) = 2, got shape \[3, 4\]"),
    ("src_positions", torch.zeros(2, 4, dtype=torch.int32), "src_positions must have dtype Long, got Int"),
    ("dst_start", torch.zeros(3, dtype=torch.int64), r"dst_start dimension 0 must be B \(block_tables dimension 0\) = 2, got shape \[3\]"),
    ("dst_start", torch.zeros(2, dtype=torch.float32), "dst_start must have dtype Long, got Float"),
])
def test_kv_compact_bad_inputs(name, bad, message):
    args = _compact_args()
    args[name] = bad
    with pytest.raises(RuntimeError, match="kv_compact: " + message):
        torch.ops.specdec_ext.kv_compact(*args.values())


@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch.ops.specdec_ext.kv_write, "default"),
                    reason="needs a GPU and the CUDA extension")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    rng = np.random.default_rng(5)
    B, T, H, D, NP, PS = 3, 6, 4, 16, 10, 4
    pool = _pool(rng, 2, NP, PS, H, D, dtype)
    key = torch.randn(B, H, T, D).to(dtype).transpose(1, 2)
    value = torch.randn(B, H, T, D).to(dtype).transpose(1, 2)
    slots = torch.from_numpy(rng.permutation(NP * PS)[: B * T].reshape(B, T)).long()
    slots[1, 4:] = -1
    gpu = pool.cuda()
    ops.kv_write(key.cuda(), value.cuda(), slots.cuda(), gpu)
    ops.kv_write(key, value, slots, pool)
    torch.testing.assert_close(gpu.cpu(), pool, rtol=0, atol=0)
    tables = torch.from_numpy(rng.permutation(NP)[: B * 3].reshape(B, 3).astype(np.int32))
    src = torch.tensor([[5, 7, 8, -1], [2, 3, 4, 9], [4, 6, 9, 11]], dtype=torch.int64)
    dst = torch.tensor([3, 1, 1], dtype=torch.int64)
    gpu = pool.cuda()
    ops.kv_compact(gpu, tables.cuda(), src.cuda(), dst.cuda())
    ops.kv_compact(pool, tables, src, dst)
    torch.testing.assert_close(gpu.cpu(), pool, rtol=0, atol=0)


def test_kv_compact_random_cases():
    # Random sizes (page_size 1 included), arbitrary (not only increasing) sources, -1 ends a row.
    rng = np.random.default_rng(7)
    for _ in range(25):
        B, PS, P, X = rng.integers(1, 4), rng.integers(1, 5), rng.integers(1, 4), 2 * rng.integers(1, 3)
        NP = B * P + rng.integers(0, 3)
        H, D = rng.integers(1, 3), rng.integers(1, 6)
        pool = _pool(rng, X, NP, PS, H, D, torch.float32)
        tables = torch.from_numpy(rng.permutation(NP)[: B * P].reshape(B, P).astype(np.int32))
        N = rng.integers(0, 5)
        src = torch.from_numpy(rng.integers(-1, P * PS + 1, size=(B, N))).long()
        dst = torch.from_numpy(rng.integers(-1, P * PS, size=(B,))).long()
        expected = ref.kv_compact(pool.numpy(), tables.numpy(), src.numpy(), dst.numpy())
        ops.kv_compact(pool, tables, src, dst)
        np.testing.assert_array_equal(pool.numpy(), expected)
