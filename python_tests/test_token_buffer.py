"""commit_tokens: exact agreement with the NumPy reference (reference_token_buffer.py) on random batches
(frozen rows, invalid verdicts, a full buffer, a strided tokens view), what a decode step's commit and a
plain segment give through it, opcheck, every bad-input path, and on a GPU the same results eagerly and
replayed from a CUDA graph."""
import numpy as np
import pytest
import torch

import reference_token_buffer as ref
from specdec_ext import ops


def _case(seed, B=6, width=5, capacity=10, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, 1000, (B, width + 3), generator=g)
    return dict(
        tokens=wide[:, 2: 2 + width],  # a column slice: row stride width + 3
        num_accepted=torch.randint(-3, width + 2, (B,), generator=g, dtype=torch.int32),
        active=torch.rand(B, generator=g) < 0.75,
        token_buffer=torch.randint(0, 1000, (B, capacity), generator=g),
        seq_lens=torch.randint(0, capacity + 1, (B,), generator=g),
        num_kept=torch.full((B,), -1, dtype=torch.int64),
        next_input=torch.full((B, 4), -7, dtype=torch.int64),
    ) if device == "cpu" else {k: v.to(device) for k, v in _case(seed, B, width, capacity).items()}


NAMES = ("tokens", "num_accepted", "active", "token_buffer", "seq_lens", "num_kept", "next_input")


def _run(case):
    out = {k: v.clone() for k, v in case.items()}
    ops.commit_tokens(*(out[k] for k in NAMES))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_commit_tokens_matches_the_reference(seed):
    case = _case(seed)
    out = _run(case)
    buffer, lengths, kept, following = ref.commit_tokens(*(case[k].numpy() for k in (
        "tokens", "num_accepted", "active", "token_buffer", "seq_lens", "next_input")))
    np.testing.assert_array_equal(out["token_buffer"].numpy(), buffer)
    np.testing.assert_array_equal(out["seq_lens"].numpy(), lengths)
    np.testing.assert_array_equal(out["num_kept"].numpy(), kept)
    np.testing.assert_array_equal(out["next_input"].numpy(), following)
    assert torch.equal(out["tokens"], case["tokens"]) and torch.equal(out["active"], case["active"])


def test_a_step_commit_keeps_the_accepted_prefix_and_the_next_pending_token():
    buffer = torch.zeros((3, 8), dtype=torch.int64)
    buffer[:, :3] = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    lengths = torch.tensor([3, 3, 3])
    kept, following = torch.empty(3, dtype=torch.int64), torch.tensor([[3, 0], [6, 0], [9, 0]])
    tokens = torch.tensor([[10, 11, 12], [13, 14, 15], [16, 17, 18]])
    # row 0 accepts both drafts (+ bonus), row 1 none (its recovered token), row 2 is frozen
    ops.commit_tokens(tokens, torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([True, True, False]),
                      buffer, lengths, kept, following)
    assert buffer.tolist() == [[1, 2, 3, 10, 11, 12, 0, 0], [4, 5, 6, 13, 0, 0, 0, 0], [7, 8, 9, 0, 0, 0, 0, 0]]
    assert lengths.tolist() == [6, 4, 3] and kept.tolist() == [3, 1, 0]
    assert following.tolist() == [[12, 0], [13, 0], [9, 0]]


def test_a_full_buffer_is_never_written_past():
    memory = torch.full((12,), -1, dtype=torch.int64)  # two rows of 4, then 4 guard positions
    buffer = memory[:8].view(2, 4)
    buffer.copy_(torch.arange(8).view(2, 4))
    lengths, kept = torch.tensor([3, 4]), torch.empty(2, dtype=torch.int64)
    following = torch.zeros((2, 1), dtype=torch.int64)
    ops.commit_tokens(torch.tensor([[50, 51, 52], [60, 61, 62]]), torch.tensor([2, 2], dtype=torch.int32),
                      torch.tensor([True, True]), buffer, lengths, kept, following)
    # row 0 fills its last position and spills nothing into row 1; row 1 writes nothing into the guard
    assert memory.tolist() == [0, 1, 2, 50, 4, 5, 6, 7, -1, -1, -1, -1]
    assert lengths.tolist() == [6, 7] and kept.tolist() == [3, 3]
    assert following.tolist() == [[0], [0]]  # the last token lies past the buffer: left as it was


def test_opcheck():
    case = _case(3)
    torch.library.opcheck(torch.ops.specdec_ext.commit_tokens.default,
                          tuple(case[k] for k in NAMES))


@pytest.mark.parametrize("change, message", [
    (dict(num_accepted=torch.zeros(6, dtype=torch.int64)), "num_accepted must have dtype Int"),
    (dict(active=torch.ones(6, dtype=torch.int32)), "active must have dtype Bool"),
    (dict(tokens=torch.zeros((5, 5), dtype=torch.int64)), "tokens dimension 0 must be B"),
    (dict(tokens=torch.zeros((6, 5, 1), dtype=torch.int64)), "tokens must be a 2-D tensor"),
    (dict(tokens=torch.zeros((5, 6), dtype=torch.int64).t()), "tokens must have unit stride"),
    (dict(tokens=torch.zeros((6, 5), dtype=torch.int32)), "tokens must have dtype Long"),
    (dict(seq_lens=torch.zeros(7, dtype=torch.int64)), "seq_lens dimension 0 must be B"),
    (dict(num_kept=torch.zeros(6, dtype=torch.int32)), "num_kept must have dtype Long"),
    (dict(token_buffer=torch.zeros((6, 20), dtype=torch.int64)[:, ::2]), "token_buffer must be contiguous"),
    (dict(next_input=torch.zeros((6, 0), dtype=torch.int64)), "next_input must have at least one column"),
    (dict(next_input=torch.zeros(6, dtype=torch.int64)), "next_input must be a 2-D tensor"),
])
def test_bad_input_is_named(change, message):
    case = {**_case(0), **change}
    with pytest.raises((RuntimeError, ValueError), match=message):
        ops.commit_tokens(*(case[k] for k in NAMES))


def test_an_empty_batch_is_a_no_op():
    empty = _case(0, B=0)
    out = _run(empty)
    assert out["token_buffer"].shape == (0, 10)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("B", [1, 6, 300])
def test_cuda_matches_the_cpu(B):
    case = _case(B, B=B)
    cpu, gpu = _run(case), _run(_case(B, B=B, device="cuda"))
    for name in ("token_buffer", "seq_lens", "num_kept", "next_input"):
        assert torch.equal(gpu[name].cpu(), cpu[name]), name


@cuda
def test_cuda_graph_replay_commits_like_eager_calls():
    eager = _case(5, device="cuda")
    captured = {k: v.clone() for k, v in eager.items()}
    graph = torch.cuda.CUDAGraph()
    start = {k: v.clone() for k, v in captured.items()}
    with torch.cuda.graph(graph):
        ops.commit_tokens(*(captured[k] for k in NAMES))
    for k in captured:  # capture does not run the kernel: start from the same state as the eager calls
        captured[k].copy_(start[k])
    for _ in range(2):
        graph.replay()
        ops.commit_tokens(*(eager[k] for k in NAMES))
    torch.cuda.synchronize()
    for k in NAMES:
        assert torch.equal(captured[k], eager[k]), k


@cuda
def test_mixed_devices_are_named():
    case = _case(1)
    case["seq_lens"] = case["seq_lens"].cuda()
    with pytest.raises(RuntimeError, match="seq_lens must be on the same device as token_buffer"):
        _run(case)
