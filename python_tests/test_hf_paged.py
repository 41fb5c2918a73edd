"""PagedModelRunner over small random-weight HF models (Llama, Qwen2, Phi-3, GPT-NeoX, Gemma): the
logits of prefill, ragged chunks of 1..6 tokens with rollbacks of rejected tokens, truncation and a
tree verification followed by compaction agree with plain HF forwards over the full sequences at
every kept position (fp32 tightly, bf16 loosely); plus the runner's error paths."""
import copy

import pytest
import torch
import transformers

from specdec_ext.runners import PagedModelRunner, PoolFullError
from specdec_ext.runners.hf_paged import cache_argument_name

VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


def make_model(arch, dtype=torch.float32):
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **COMMON))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **COMMON))
    elif arch == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(num_key_value_heads=2, **COMMON))
    elif arch == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**COMMON))
    elif arch == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **COMMON))
    else:
        raise ValueError(arch)
    # Random init is tiny for some architectures: scale up so that the logits are informative.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.to(dtype).eval()


class Oracle:
    """Plain HF forwards (no cache, one sequence at a time) on a separate copy of the model."""

    def __init__(self, model):
        self.model = copy.deepcopy(model)
        self.model.set_attn_implementation("sdpa")

    @torch.no_grad()
    def logits(self, tokens):
        return self.model(torch.tensor([tokens])).logits[0].float()  # [len, V]


def check(got, want, tol, what):
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def run_scenario(arch, dtype, tol, static_shapes=False):
    model = make_model(arch, dtype)
    oracle = Oracle(model)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (40,), generator=gen).tolist() for _ in range(3)]
    full = [oracle.logits(s) for s in seqs]  # (a) one plain forward over each full sequence
    runner = PagedModelRunner(model, max_batch_size=4, max_seq_len=48, page_size=4, static_shapes=static_shapes)
    assert runner.vocab_size == VOCAB

    prompt_lens = [5, 11, 2]
    last = runner.start([s[:n] for s, n in zip(seqs, prompt_lens)])
    assert last.shape == (3, VOCAB) and last.dtype == torch.float32
    for b in range(3):
        check(last[b], full[b][prompt_lens[b] - 1], tol, f"{arch} prefill row {b}")
    assert runner.lengths.tolist() == prompt_lens

    def chain_step(chunks, kept):
        L = runner.lengths.tolist()
        T = max(chunks)
        ids = torch.randint(3, VOCAB, (3, T), generator=gen)  # rejected / padding tokens
        for b in range(3):
            ids[b, : kept[b]] = torch.tensor(seqs[b][L[b]: L[b] + kept[b]])
        logits = runner.forward(ids, num_tokens=torch.tensor(chunks, dtype=torch.int32))
        assert logits.shape == (3, T, VOCAB) and logits.dtype == torch.float32
        for b in range(3):
            for t in range(kept[b]):
                check(logits[b, t], full[b][L[b] + t], tol, f"{arch} chain row {b} token {t}")
            if kept[b] < chunks[b]:  # the first rejected token sees the kept ones + itself
                ctx = seqs[b][: L[b] + kept[b]] + [int(ids[b, kept[b]])]
                check(logits[b, kept[b]], oracle.logits(ctx)[-1], tol, f"{arch} rejected row {b}")
        runner.commit(torch.tensor(kept))
        assert runner.lengths.tolist() == [l + k for l, k in zip(L, kept)]

    chain_step([1, 3, 6], [1, 1, 4])
    chain_step([6, 2, 5], [6, 0, 2])   # a row keeping nothing, a row keeping everything
    chain_step([4, 5, 1], [2, 5, 1])

    # Truncate (e.g. a draft cache after a rejection), then continue over the same sequence.
    L = runner.lengths.tolist()
    runner.truncate(torch.tensor([L[0] - 3, L[1], L[2] - 1]))
    chain_step([3, 1, 2], [3, 1, 2])

    # Tree verification: token 0 is the next sequence token; the sequence continues along
    # nodes 1 -> 3 -> 5; the other nodes are distractors (siblings and cousins).
    L = runner.lengths.tolist()
    parents = torch.tensor([[-1, -1, 1, 1, 0, 3]] * 3, dtype=torch.int32)   # [B, N = 6]
    num_tokens = torch.tensor([7, 7, 5], dtype=torch.int32)                 # row 2 uses nodes 0..3
    ids = torch.randint(3, VOCAB, (3, 7), generator=gen)
    for b in range(3):
        ids[b, 0] = seqs[b][L[b]]
        ids[b, 1 + 1] = seqs[b][L[b] + 1]
        ids[b, 1 + 3] = seqs[b][L[b] + 2]
        ids[b, 1 + 5] = seqs[b][L[b] + 3]
    logits = runner.forward(ids, num_tokens=num_tokens, tree_parents=parents)
    node_parents = parents[0].tolist()
    for b in range(3):
        for t in range(int(num_tokens[b])):
            path, node = [], t - 1
            while node >= 0:
                path.append(int(ids[b, node + 1]))
                node = node_parents[node]
            ctx = seqs[b][: L[b]] + [int(ids[b, 0])] + path[::-1]
            check(logits[b, t], oracle.logits(ctx)[-1], tol, f"{arch} tree row {b} token {t}")
    path = torch.tensor([[1, 3, 5, -1, -1, -1], [1, -1, -1, -1, -1, -1], [1, 3, -1, -1, -1, -1]])
    accepted = torch.tensor([3, 1, 2], dtype=torch.int32)
    runner.commit_tree(path, accepted)
    assert runner.lengths.tolist() == [L[0] + 4, L[1] + 2, L[2] + 3]

    # After compaction the cache must hold exactly the sequence: continue with chunks.
    chain_step([5, 2, 3], [5, 2, 3])
    chain_step([1, 6, 4], [0, 3, 4])
    runner.kv.check_invariants()
    # Every committed position is checked: the prefix read back through one more token.
    L = runner.lengths.tolist()
    logits = runner.forward(torch.tensor([[seqs[b][L[b]]] for b in range(3)]))
    for b in range(3):
        check(logits[b, 0], full[b][L[b]], tol, f"{arch} final row {b}")


ARCHS = ["llama", "qwen2", "phi3", "gpt_neox", "gemma"]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_plain_forward_fp32(arch):
    run_scenario(arch, torch.float32, 2e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_matches_plain_forward_bf16(arch):
    run_scenario(arch, torch.bfloat16, 1.5e-1)


def test_errors_name_the_row():
    model = make_model("llama")
    runner = PagedModelRunner(model, max_batch_size=3, max_seq_len=10, page_size=4, num_pages=5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        runner.start([[5], []])
    with pytest.raises(ValueError, match="prompt 0 has 11 tokens, more than max_seq_len=10"):
        runner.start([[5] * 11])
    with pytest.raises(ValueError, match="exceed max_batch_size"):
        runner.start([[5]] * 4)
    runner.start([[5] * 8, [6] * 3])
    with pytest.raises(ValueError, match="row 0 would hold 11 tokens, more than max_seq_len=10"):
        runner.forward(torch.full((2, 3), 7))
    # Pool: 5 pages of 4; row 0 owns 2, row 1 owns 1; row 1 growing to 10 positions needs 2 more.
    runner.forward(torch.full((2, 2), 7), num_tokens=torch.tensor([2, 0]))
    runner.commit(torch.tensor([2, 0]))  # row 0: 10 tokens, 3 pages
    with pytest.raises(PoolFullError, match=r"row 1 needs 2 more page\(s\).*only 1 of 5 pages are free"):
        runner.forward(torch.full((2, 7), 7), num_tokens=torch.tensor([0, 7]))
    assert isinstance(PoolFullError("x"), ValueError)
    runner.kv.check_invariants()
    with pytest.raises(ValueError, match=r"commit: num_kept\[1\] = 1 is outside \[0, 0\]"):
        runner.forward(torch.full((2, 1), 7), num_tokens=torch.tensor([0, 0]))
        runner.commit(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"truncate: new_lengths\[0\] = 11"):
        runner.truncate(torch.tensor([11, 1]))
    runner.truncate(torch.tensor([1, 1]))
    runner.kv.check_invariants()
    assert runner.kv.num_free_pages == 3


def test_static_shapes_mode_gives_the_same_logits():
    """The CUDA-graph mode: chain steps over every page with device-only lengths, then a tree forward
    that returns the runner to host bookkeeping."""
    run_scenario("llama", torch.float32, 2e-4, static_shapes=True)


def test_model_still_runs_plain_hf_forwards():
    """A model switched to "specdec_paged" behaves as sdpa outside a paged forward, including a
    multi-token forward over a DynamicCache (the case a missing mask registration gets wrong)."""
    model = make_model("qwen2")
    oracle = Oracle(model)
    runner = PagedModelRunner(model, max_batch_size=2, max_seq_len=32, page_size=4)
    runner.start([[5, 6, 7], [8, 9]])
    seq = list(range(3, 20))
    want = oracle.logits(seq)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([seq])).logits[0], want, atol=1e-5, rtol=1e-5)
        cache = {cache_argument_name(model): transformers.DynamicCache(config=model.config)}
        model(torch.tensor([seq[:10]]), use_cache=True, **cache)
        got = model(torch.tensor([seq[10:]]), use_cache=True, **cache).logits[0]
    torch.testing.assert_close(got, want[10:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward(torch.zeros((2, 0), dtype=torch.int64))


def test_tree_and_chain_steps_match_the_recompute_runner():
    """Same tree layout, path and commit semantics as specdec_ext.runners.recompute (the oracle the
    decode loop is tested against)."""
    from specdec_ext.runners import RecomputeRunner

    model = make_model("phi3")
    runners = [PagedModelRunner(model, max_batch_size=2, max_seq_len=40, page_size=3),
               RecomputeRunner(copy.deepcopy(model), max_batch_size=2, max_seq_len=40)]
    gen = torch.Generator().manual_seed(3)
    outs = [r.start([[5, 6, 7, 8], [9]]) for r in runners]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    parents = torch.tensor([[-1, 0, -1, 2, 1], [-1, -1, 1, 1, 0]], dtype=torch.int32)
    for step in range(3):
        ids = torch.randint(3, VOCAB, (2, 6), generator=gen)
        num = torch.tensor([6, [4, 3, 6][step]])
        outs = [r.forward(ids, num, tree_parents=parents) for r in runners]
        for b in range(2):
            torch.testing.assert_close(outs[0][b, : num[b]], outs[1][b, : num[b]], atol=1e-4, rtol=1e-4)
        path = torch.tensor([[0, 1, 4, -1, -1], [1, -1, -1, -1, -1]], dtype=torch.int32)
        accepted = torch.tensor([[3, 2, 0][step], [1, 0, 1][step]], dtype=torch.int32)
        for r in runners:
            r.commit_tree(path, accepted)
        assert runners[0].lengths.tolist() == runners[1].lengths.tolist()
        ids = torch.randint(3, VOCAB, (2, 3), generator=gen)
        outs = [r.forward(ids) for r in runners]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        for r in runners:
            r.commit(torch.tensor([2, step % 4]))
