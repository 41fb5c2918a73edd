"""The bundled default model pair (specdec_ext/default_pair) loads offline and is consistent.

Needs neither the compiled extension nor a network: transformers loads local files only.
"""
import hashlib
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
        spec = importlib.util.spec_from_file_location("_specdec_default_pair", path,
                                                      submodule_search_locations=[os.path.dirname(path)])
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
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dp.PAIR_DIR) for f in fs
                if f.endswith((".json", ".safetensors", ".planes", ".md", ".txt")))
    assert total <= 48 * 2 ** 20  # what ships (the target packed, packing.py); the tree's limit is 60 MiB


def test_the_packed_target_unpacks_to_its_digest(tmp_path):
    packing = importlib.import_module(dp.__name__ + ".packing")
    packed = os.path.join(dp.PACKED_TARGET_DIR, "model.safetensors" + packing.PACKED_SUFFIX)
    digest = packing.packed_digest(packed)
    assert os.path.basename(dp.TARGET_DIR) == f"target-{digest[:16]}"
    with open(os.path.join(dp.TARGET_DIR, "model.safetensors"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest
    source = tmp_path / "w.safetensors"
    source.write_bytes(open(os.path.join(dp.DRAFT_DIR, "model.safetensors"), "rb").read())
    packing.pack(str(source), str(tmp_path / "w.planes"))
    assert packing.unpack_bytes(str(tmp_path / "w.planes")) == source.read_bytes()
    corrupt = bytearray((tmp_path / "w.planes").read_bytes())
    corrupt[-100] ^= 0xFF
    (tmp_path / "bad.planes").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="is corrupt"):
        packing.unpack_bytes(str(tmp_path / "bad.planes"))


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


@pytest.mark.parametrize("speculative", [False, True])
def test_a_stream_hands_every_token_id_to_a_piece_when_a_character_spans_tokens(pair, speculative):
    """An emoji is three byte tokens of the bundled tokenizer: the steps that end inside one yield no text yet,
    and their token ids went with nothing (joined, the pieces' token_ids missed two of every three)."""
    import specdec_ext

    target, draft, tok = pair
    kw = dict(tokenizer=tok, max_new_tokens=12, stream=True, regex="🙂🙂🙂")
    stream = (specdec_ext.generate("s = '", target, draft, k=4, **kw) if speculative
              else specdec_ext.plain_generate("s = '", target, **kw))
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text[0] == "🙂🙂🙂"
    assert [t for piece in pieces for t in piece.token_ids] == stream.result.token_ids[0]
    assert len(stream.result.token_ids[0]) >= 9  # (three tokens a character)


def test_importing_the_package_writes_nothing_and_the_target_is_unpacked_on_first_use(tmp_path):
    """The bundled target's weights are unpacked into the cache when it is first loaded, not when specdec_ext is
    imported (an import wrote 51 MB, and failed, `specdec --help` included, where the cache was unwritable)."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache)}
    probe = ("import specdec_ext, specdec_ext.cli, os, sys; from specdec_ext.models import is_bundled_target; "
             "assert not is_bundled_target('/tmp'); print(os.path.exists(sys.argv[1]))")
    run = subprocess.run([sys.executable, "-c", probe, str(cache)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
    unwritable = {**os.environ, "SPECDEC_CACHE_DIR": "/proc/nope"}
    helped = subprocess.run([sys.executable, "-m", "specdec_ext", "--help"], env=unwritable, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    made = subprocess.run([sys.executable, "-c", "from specdec_ext.default_pair import TARGET_DIR; print(TARGET_DIR)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and os.path.isfile(os.path.join(made.stdout.strip(), "model.safetensors"))
    assert made.stdout.strip().startswith(str(cache))
