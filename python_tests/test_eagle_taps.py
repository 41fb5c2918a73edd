"""The hidden-state tap (runners/taps.py; issue 27, item 1): a runner built with ``hidden_taps`` (lean on
the CPU kernels and on torch, paged, recompute) keeps the inputs of the tapped layers for its committed
tokens, HF's ``output_hidden_states=True`` of the committed sequence (a float64 reference, fp32 tolerance),
after ragged prefill, chain commits, tree compaction and truncation. Mutations (a rejected tree node's
states kept, a rejected chain token's states kept) are caught by the same check."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from specdec_ext.runners import RunnerCapabilities, capabilities_of, make_runner
from specdec_ext.runners.lean import LeanLlamaRunner
from specdec_ext.runners.recompute import RecomputeRunner
from specdec_ext.runners.taps import TapBuffer, default_tap_layers

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 6
TAPS = default_tap_layers(LAYERS)  # (2, 3, 3)
PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30, 8]]


def tiny_llama(layers: int = LAYERS, seed: int = 0, hidden: int = 64, vocab: int = 96):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def reference(model):
    return copy.deepcopy(model).double()


def hf_states(reference, tokens, taps=TAPS) -> torch.Tensor:
    """HF's hidden states of ``tokens`` at the tapped layers' inputs, concatenated: [n, len(taps) * H] fp64."""
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[layer][0] for layer in taps], dim=-1)


def check(runner, reference, committed, atol):
    """Every row's tapped states of its committed tokens equal HF's (runner lengths = len(committed[b]))."""
    lengths = runner.lengths.tolist()
    assert lengths == [len(c) for c in committed]
    width = max(lengths)
    positions = torch.arange(width)[None, :].expand(len(committed), width).contiguous()
    states = runner.tapped_states(positions)
    for b, tokens in enumerate(committed):
        expected = hf_states(reference, tokens)
        torch.testing.assert_close(states[b, : len(tokens)].double(), expected, atol=atol, rtol=1e-4)


def drive(runner, reference, atol):
    """Prefill, a chain commit, a tree commit, a truncation, another chain: checked after each."""
    committed = [list(p) for p in PROMPTS]
    runner.start(PROMPTS)
    check(runner, reference, committed, atol)
    chain = torch.tensor([[7, 8, 9, 10], [11, 12, 0, 0]])
    runner.forward(chain, torch.tensor([4, 2]))
    runner.commit(torch.tensor([3, 1]))
    committed = [committed[0] + [7, 8, 9], committed[1] + [11]]
    check(runner, reference, committed, atol)
    tree = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])  # token 0 the root, node i = token i + 1
    parents = torch.tensor([[-1, 0, -1, 2], [-1, -1, 1, 0]], dtype=torch.int32)
    runner.forward(tree, torch.tensor([5, 5]), tree_parents=parents)
    runner.commit_tree(torch.tensor([[2, 3, -1, -1], [1, 2, -1, -1]], dtype=torch.int32), torch.tensor([2, 2]))
    committed = [committed[0] + [20, 23, 24], committed[1] + [30, 32, 33]]
    check(runner, reference, committed, atol)
    runner.truncate(torch.tensor([len(committed[0]) - 2, len(committed[1]) - 1]))
    committed = [committed[0][:-2], committed[1][:-1]]
    check(runner, reference, committed, atol)
    runner.forward(torch.tensor([[40, 41], [42, 43]]))
    runner.commit(torch.tensor([1, 2]))
    committed = [committed[0] + [40], committed[1] + [42, 43]]
    check(runner, reference, committed, atol)


def lean(model, **kw):
    return LeanLlamaRunner(model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS, **kw)


def test_lean_kernels_tap_hf_hidden_states(model, reference):
    runner = lean(model)
    assert runner.kernels_reason is None and runner.capabilities.hidden_taps
    assert not runner.capabilities.greedy_chain  # chains would commit tokens without their states
    drive(runner, reference, atol=2e-5)


def test_lean_torch_path_taps(model, reference, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    runner = lean(model)
    assert runner.kernels_reason is not None
    drive(runner, reference, atol=2e-5)


def test_recompute_taps_are_hf_exactly(model, reference):
    runner = RecomputeRunner(model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS)
    assert runner.capabilities == RunnerCapabilities(chunked_prefill=True, hidden_taps=True)
    drive(runner, reference, atol=2e-5)


def test_paged_taps_follow_its_pages(model, reference):
    runner = make_runner("paged", model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS)
    assert runner.capabilities == RunnerCapabilities(device_steps=True, hidden_taps=True)
    drive(runner, reference, atol=2e-5)


def test_paged_static_shapes_taps_on_the_device(model, reference):
    """The static-shapes mode (CUDA graphs: chains are device work) taps its chain forwards as host mode
    does; its tree forward and commit_tree go through host mode."""
    runner = make_runner("paged", model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS, static_shapes=True)
    assert runner.capabilities == RunnerCapabilities(device_steps=False, hidden_taps=True)
    drive(runner, reference, atol=2e-5)


def test_taps_leave_the_logits_alone(model):
    """The segmented kernel stack gives the untapped runner's logits bit for bit (greedy = greedy)."""
    plain, tapped = (LeanLlamaRunner(model, max_batch_size=2, max_seq_len=64, hidden_taps=t) for t in (None, TAPS))
    assert torch.equal(plain.start(PROMPTS), tapped.start(PROMPTS))
    tree = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])
    parents = torch.tensor([[-1, 0, -1, 2], [-1, -1, 1, 0]], dtype=torch.int32)
    assert torch.equal(plain.forward(tree, tree_parents=parents), tapped.forward(tree, tree_parents=parents))


def test_mutation_rejected_tree_node_states_kept_is_caught(model, reference, monkeypatch):
    monkeypatch.setattr(TapBuffer, "move", lambda self, row, src, dst: None)  # compaction forgets the states
    with pytest.raises(AssertionError):
        drive(lean(model), reference, atol=2e-5)


def test_mutation_rejected_chain_states_kept_is_caught(model, reference, monkeypatch):
    runner = RecomputeRunner(model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS)
    original = RecomputeRunner.commit

    def keep_rejected(self, num_kept):  # the last n tentative tokens' states kept: a rejected one among them
        saved = list(self._tentative_states)
        before = [s.shape[0] for s in self._states]
        original(self, num_kept)
        for b, n in enumerate(num_kept.tolist()):
            if saved[b] is not None and n:
                self._states[b] = torch.cat([self._states[b][:before[b]], saved[b][-n:]])

    monkeypatch.setattr(RecomputeRunner, "commit", keep_rejected)
    with pytest.raises(AssertionError):
        drive(runner, reference, atol=2e-5)


def test_tap_layer_ids_are_checked(model):
    with pytest.raises(ValueError, match=r"layer ids in \[0, 6\)"):
        LeanLlamaRunner(model, max_batch_size=1, max_seq_len=8, hidden_taps=(2, 6))
    with pytest.raises(ValueError, match="at least 5 layers"):
        default_tap_layers(4)
    assert capabilities_of("lean", model, hidden_taps=True) == RunnerCapabilities(chunked_prefill=True,
                                                                                  hidden_taps=True)
    with pytest.raises(ValueError, match="tapped_states"):
        LeanLlamaRunner(model, max_batch_size=1, max_seq_len=8).tapped_states(torch.zeros((1, 1), dtype=torch.long))


@pytest.mark.parametrize("kind", ["lean", "recompute"])
def test_rows_joining_and_chunked_prefill_are_tapped(model, reference, kind):
    """start_rows / extend_rows (the server's rows and chunked prefill) write their tokens' states too."""
    runner = make_runner(kind, model, max_batch_size=2, max_seq_len=64, hidden_taps=TAPS)
    runner.start([PROMPTS[1]])
    runner.start_rows([1], [PROMPTS[0][:3]])
    runner.extend_rows([1], [PROMPTS[0][3:]])
    check(runner, reference, [PROMPTS[1], PROMPTS[0]], atol=2e-5)
    runner.free_rows([0])
    runner.start_rows([0], [[9, 8, 7, 6]])
    check(runner, reference, [[9, 8, 7, 6], PROMPTS[0]], atol=2e-5)
