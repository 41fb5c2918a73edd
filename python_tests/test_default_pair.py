"""The bundled default model pair (specdec_ext/default_pair) loads offline and is consistent.

Needs neither the compiled extension nor a network: transformers loads local files only.
"""
import importlib
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_default_pair():
    try:
        return importlib.import_module("specdec_ext.default_pair")
    except ImportError:
        # specdec_ext/__init__.py needs the compiled _C; the default pair itself does not, so load
        # the subpackage from its file to keep this test independent of the build.
        path = os.path.join(ROOT, "specdec_ext", "default_pair", "__init__.py")
        spec = importlib.util.spec_from_file_location("_specdec_default_pair", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


dp = _import_default_pair()

CODE_SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "import torch\n\n\nclass Net(torch.nn.Module):\n\tdef forward(self, x):\n\t\treturn x\n",
    "s = 'héllo wörld 世界 🙂'\r\nprint(f\"{s!r:>10}\")   \n",
    "   leading and trailing spaces   \n\n",
    "x=[1,2,3];y={'a':(4,5)}\\\n  # \u00a0nbsp and \u2028line sep\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    return dp.load_default_pair()


def test_loads_offline_in_eval_mode(pair):
    target, draft, tok = pair
    assert not target.training and not draft.training
    assert target.dtype == torch.float32 and draft.dtype == torch.float32
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())


def test_tokenizer_round_trips_code(pair):
    _, _, tok = pair
    for text in CODE_SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text


def test_vocab_sizes_match_tokenizer(pair):
    target, draft, tok = pair
    v = len(tok)
    assert target.config.vocab_size == draft.config.vocab_size == v
    assert target.get_output_embeddings().weight.shape[0] == v
    assert draft.get_output_embeddings().weight.shape[0] == v
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == eot
    assert target.config.eos_token_id == draft.config.eos_token_id == eot


def test_forward_gives_finite_logits(pair):
    target, draft, tok = pair
    ids = torch.tensor([[tok.eos_token_id] + tok.encode(CODE_SAMPLES[1], add_special_tokens=False)])
    with torch.no_grad():
        for model in (target, draft):
            logits = model(input_ids=ids).logits
            assert logits.shape == (1, ids.shape[1], len(tok))
            assert torch.isfinite(logits).all()


def test_bf16_load_and_size_limit():
    target, draft, _ = dp.load_default_pair(dtype=torch.bfloat16)
    assert target.dtype == draft.dtype == torch.bfloat16
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dp.PAIR_DIR) for f in fs)
    assert total <= 64 * 2 ** 20


def test_missing_files_raise_clearly(monkeypatch, tmp_path):
    monkeypatch.setattr(dp, "_REQUIRED", {str(tmp_path / "target"): ("config.json",)})
    with pytest.raises(FileNotFoundError, match="default model pair"):
        dp.load_default_pair()


def test_greedy_speculative_generation_equals_the_targets_own_greedy(pair):
    import specdec_ext

    target, draft, tok = pair
    prompt = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    new_tokens = 32
    with torch.no_grad():
        expected = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    result = specdec_ext.generate([ids], target, draft, tokenizer=tok, max_new_tokens=new_tokens, k=4,
                                  eos_token_id=False)
    assert result.token_ids[0] == expected
    assert result.stats.tokens_per_pass > 1.5  # the drafts are really accepted
