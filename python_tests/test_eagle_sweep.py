"""An outside tester's sweep of the EAGLE-3 support (docs/eagle.md): checkpoints as SafeAILab/EAGLE,
SpecForge and speculators write them and the variants real ones have (a head narrower than its target,
fp16 pytorch_model.bin, an int t2d mask, sharded safetensors, d2t/t2d that do not describe the vocabulary),
drafting (chains k = 1..8 and trees of many shapes on every runner, ragged batches, EOS, 0-2 new tokens,
prompts near the context, a draft vocabulary smaller than the tree's branching, the processors, seeded
sampling and the law of the first tokens) and ``specdec train-eagle`` (a run killed and restarted, a save
interrupted, layer ids it cannot tap, data files, a target without a tokenizer).

The eight defects the sweep found (docstrings: "Was a defect") are fixed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import save_file

from eagle_utils import random_head, tiny_target
from sampling_stats import chi_square_p, exact_joint
from test_generate_utils import CHAR_VOCAB, char_tokenizer, hf_greedy
import specdec_ext
from specdec_ext import cli
from specdec_ext.eagle import Eagle3Model, EagleConfig, EagleDrafterSpec, load_eagle, save_eagle

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2], [7, 7, 81, 13, 40]]  # ragged, one of a single token
NEW = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=7)


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, draft_vocab=40, seed=5)


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, NEW) for p in PROMPTS]


def layer_config(head, **changes) -> dict:
    """config.json of the "eagle" layout as SafeAILab/EAGLE's traineagle3/config.json and SpecForge spell it."""
    c = head.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
              "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": 0, "use_cache": True,
              "draft_vocab_size": c.draft_vocab_size}
    if c.target_hidden_size != c.hidden_size:
        config["target_hidden_size"] = c.target_hidden_size
    config.update(changes)
    return config


def tensors(head, embed: bool = False, dtype=None) -> dict:
    out = {}
    for name, tensor in head.state_dict().items():
        if name == "embed_tokens.weight" and not embed:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.clone().contiguous()
    return out


def write(path, config: dict, state: dict, fmt: str = "safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "safetensors":
        save_file(state, os.path.join(path, "model.safetensors"))
    else:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    return str(path)


def greedy(target, draft, prompts=PROMPTS, new=NEW, **kw):
    return specdec_ext.generate(prompts, target, draft, max_new_tokens=new, eos_token_id=False, **kw)


# ============================================================================== checkpoints: defects
@pytest.mark.parametrize("draft_vocab", [40, None])
def test_a_safeailab_eagle3_head_with_its_released_llama_architecture_is_an_eagle_draft(target, references, tmp_path,
                                                                                        draft_vocab):
    """Was a defect, fixed: SafeAILab/EAGLE's EAGLE-3 config (eagle/traineagle3/config.json, which its released heads carry)
    says ``"architectures": ["LlamaForCausalLM"]`` with ``draft_vocab_size``; load_eagle reads it, but
    generate(draft=DIR) does not see an EAGLE-3 head (spec.is_eagle_checkpoint wants LlamaForCausalLMEagle3) and
    loads it as a draft model: with a reduced vocabulary HF's size-mismatch RuntimeError; with the full
    vocabulary a randomly initialised 1-layer Llama drafts silently (plan.drafter == "model")."""
    h = random_head(target, draft_vocab=draft_vocab, seed=6)
    path = write(tmp_path / "eagle3", layer_config(h, architectures=["LlamaForCausalLM"], torch_dtype="float16"),
                 tensors(h, dtype=torch.float16), fmt="bin")
    assert load_eagle(path, target).config.draft_vocab_size == h.config.draft_vocab_size  # the loader reads it
    result = greedy(target, path, k=3)
    assert result.plan.drafter == "eagle"
    assert result.token_ids == references


def test_a_d2t_outside_the_target_vocabulary_is_refused_when_loading(target, head, references, tmp_path):
    """Was a defect, fixed: A d2t that maps draft ids past the target's vocabulary (here written as absolute target ids, not
    the documented offsets "target id - draft id") loads without a word; generate then dies mid-decode in the
    chain kernel ("eagle_chain: target_ids[28] = 99 is outside the embedding's [0, 96)"), naming neither the
    checkpoint nor d2t. Expected: load_eagle refuses it, naming d2t."""
    state = tensors(head)
    state["d2t"] = head.target_ids.clone()  # absolute ids: target ids d + ids[d] run past 96
    path = write(tmp_path / "abs", layer_config(head), state)
    with pytest.raises(ValueError, match="d2t"):
        load_eagle(path, target)


def test_a_d2t_that_disagrees_with_t2d_is_refused_when_loading(target, head, tmp_path):
    """Was a defect (silent), fixed: t2d marks the target ids that have a draft id; a d2t pointing at other ids (in range)
    loads and drafts tokens the head was never trained to score there, without a word. Expected: load_eagle
    refuses the inconsistent pair, naming d2t / t2d."""
    state = tensors(head)
    state["d2t"] = torch.zeros_like(state["d2t"])  # draft id d -> target id d, but t2d marks head.target_ids
    assert not torch.equal(head.target_ids, torch.arange(40))
    path = write(tmp_path / "inconsistent", layer_config(head), state)
    with pytest.raises(ValueError, match="d2t|t2d"):
        load_eagle(path, target)


def test_sharded_safetensors_with_an_index_load_or_are_refused_naming_the_index(target, head, references,
                                                                                tmp_path):
    """Was a defect, fixed: HF's save_pretrained (SpecForge saves so) shards above max_shard_size into
    model-0000i-of-0000n.safetensors with model.safetensors.index.json; load_eagle says the directory "holds
    none of ('model.safetensors', 'pytorch_model.bin', ...)" though it holds the weights. Expected: it loads
    them (and drafts exactly) or names the sharded layout it does not read."""
    state = tensors(head)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    path = tmp_path / "ckpt"
    os.makedirs(path)
    json.dump(layer_config(head), open(path / "config.json", "w"))
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(path / file))
    json.dump({"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}},
              open(path / "model.safetensors.index.json", "w"))
    try:
        loaded = load_eagle(str(path), target)
    except (OSError, ValueError) as error:
        said = str(error).replace(str(path), "DIR")  # (the test's directory name holds "sharded")
        assert "model.safetensors.index.json" in said or "shard" in said, said
        return
    assert greedy(target, EagleDrafterSpec(loaded), k=3).token_ids == references


def narrow_head(target, seed: int = 3) -> Eagle3Model:
    """A head of width 32 for the width-64 target (target_hidden_size 64): fc reads 3 x 64, its own embedding."""
    config = EagleConfig.for_target(target, draft_vocab_size=40, hidden_size=32, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, intermediate_size=48)
    torch.manual_seed(seed)
    head = Eagle3Model(config)
    head.set_draft_vocab(torch.arange(0, 80, 2))
    return head.eval().requires_grad_(False)


def test_a_head_narrower_than_its_target_without_its_embedding_is_refused_by_name(target, tmp_path):
    """Was a defect, fixed: A head whose hidden_size (32) differs from the target's (64) cannot take the target's embedding;
    a checkpoint of it without embed_tokens.weight (SafeAILab's releases leave it out) fails in load_eagle with
    torch's "The size of tensor a (32) must match the size of tensor b (64) at non-singleton dimension 1".
    Expected: a ValueError naming embed_tokens.weight."""
    h = narrow_head(target)
    path = write(tmp_path / "narrow", layer_config(h), tensors(h, embed=False))
    with pytest.raises(ValueError, match="embed_tokens"):
        load_eagle(path, target)


# ============================================================================== checkpoints: what works
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_a_head_narrower_than_its_target_with_its_embedding_drafts_exactly(target, references, tmp_path, layout):
    h = narrow_head(target)
    if layout == "eagle":
        path = write(tmp_path / "narrow", layer_config(h), tensors(h, embed=True))
        assert json.load(open(os.path.join(path, "config.json")))["target_hidden_size"] == 64
    else:
        path = str(tmp_path / "narrow")
        save_eagle(h, path, layout=layout)
    loaded = load_eagle(path, target)
    assert loaded.config.hidden_size == 32 and loaded.fc.weight.shape == (32, 3 * 64)
    assert torch.equal(loaded.embed_tokens.weight, h.embed_tokens.weight)
    for kw in (dict(k=3), dict(draft_tree=(2, 3, 6))):
        assert greedy(target, path, runner="paged", **kw).token_ids == references


def test_fp16_pytorch_model_bin_with_an_int_t2d_loads_and_drafts_exactly(target, head, references, tmp_path):
    """fp16 tensors in pytorch_model.bin (SafeAILab's releases) and a t2d stored as an int64 0/1 mask."""
    state = tensors(head, dtype=torch.float16)
    state["t2d"] = head.t2d.to(torch.int64)
    path = write(tmp_path / "fp16", layer_config(head, torch_dtype="float16"), state, fmt="bin")
    loaded = load_eagle(path, target)
    assert loaded.fc.weight.dtype == torch.float32 and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.t2d, head.t2d) and torch.equal(loaded.target_ids, head.target_ids)
    assert torch.equal(loaded.fc.weight, head.fc.weight.half().float())
    assert greedy(target, path, k=4).token_ids == references


def test_unknown_and_missing_tensors_are_refused_naming_them(target, head, tmp_path):
    state = tensors(head)
    state["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    del state["lm_head.weight"]
    path = write(tmp_path / "odd", layer_config(head), state)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\].*unexpected "
                                         r"\['midlayer.self_attn.rotary_emb.inv_freq'\]") as error:
        load_eagle(path, target)
    assert path in str(error.value)


# ============================================================================== drafting
def test_chains_of_every_length_on_every_runner_are_plain_greedy(target, head, references):
    for k in range(1, 9):
        for runner in ("lean", "paged", "recompute"):
            assert greedy(target, EagleDrafterSpec(head), k=k, runner=runner).token_ids == references, (k, runner)


@pytest.mark.parametrize("tree", [(1, 1, 1), (1, 6, 6), (4, 1, 4), (3, 3, 20), (2, 4, 30), (5, 2, 7), (8, 1, 8),
                                  (3, 5, 9)])
def test_trees_of_many_shapes_on_every_runner_are_plain_greedy(target, head, references, tree):
    for runner in ("lean", "paged", "recompute"):
        assert greedy(target, EagleDrafterSpec(head), draft_tree=tree, runner=runner).token_ids == references


def test_eos_at_every_place_and_zero_to_two_new_tokens(target, head, references):
    for eos in (references[0][3], references[1][0], references[2][10]):
        expected = [hf_greedy(target, p, NEW, eos_token_id=eos) for p in PROMPTS]
        for kw in (dict(k=4), dict(k=1), dict(draft_tree=(2, 3, 6))):
            for runner in ("lean", "paged"):
                out = specdec_ext.generate(PROMPTS, target, EagleDrafterSpec(head), max_new_tokens=NEW, runner=runner,
                                           eos_token_id=eos, **kw).token_ids
                assert out == expected, (eos, kw, runner)
    for new in (0, 1, 2):
        for kw in (dict(k=4), dict(draft_tree=(2, 3, 6)), dict()):
            assert greedy(target, EagleDrafterSpec(head), new=new, **kw).token_ids == [r[:new] for r in references]


def test_prompts_near_the_context_decode_exactly_or_are_refused_naming_the_cache(target, head):
    import random
    rnd = random.Random(0)
    long = [rnd.randrange(96) for _ in range(236)]  # the target's context is 256
    for kw in (dict(), dict(runner="paged"), dict(runner="recompute"), dict(max_seq_len=300, k=8)):
        out = greedy(target, EagleDrafterSpec(head), prompts=[long, [4]], new=20, **kw).token_ids
        assert out == [hf_greedy(target, long, 20), hf_greedy(target, [4], 20)], kw
    with pytest.raises(ValueError, match="needs 262 cache positions but the cache holds 256"):
        greedy(target, EagleDrafterSpec(head), prompts=[long[:230]], new=20, draft_tree=(2, 3, 6))


@pytest.mark.parametrize("draft_vocab", [1, 2])
def test_a_draft_vocabulary_smaller_than_the_trees_branching(target, references, draft_vocab):
    """Trees of branch 4-5 over 1 or 2 draft tokens: children past the vocabulary have q = 0."""
    h = random_head(target, draft_vocab=draft_vocab, seed=9)
    for kw in (dict(k=4), dict(draft_tree=(4, 2, 8)), dict(draft_tree=(5, 3, 12), runner="paged")):
        assert greedy(target, EagleDrafterSpec(h), **kw).token_ids == references
        for sampling in (dict(temperature=1.0), dict(temperature=0.7, top_k=3)):
            out = greedy(target, EagleDrafterSpec(h), seed=[1, 2, 3], **sampling, **kw).token_ids
            assert [len(o) for o in out] == [NEW] * 3


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
                                     dict(logit_bias={3: 5.0, 17: -100}), dict(k="auto"), dict(draft_confidence=0.5),
                                     dict(min_p=0.2, top_k=5)])
def test_processors_and_runner_options_give_what_ngram_drafting_gives(target, head, options):
    """Greedy under each option: every lossless drafter gives the same tokens (ngram drafting as the witness)."""
    expected = greedy(target, "ngram", **options).token_ids
    extras = [dict(), dict(runner="paged"), dict(runner="recompute")] + ([] if "k" in options else
                                                                          [dict(draft_tree=(2, 2, 4))])
    for extra in extras:
        assert greedy(target, EagleDrafterSpec(head), **options, **extra).token_ids == expected, extra


@pytest.mark.parametrize("kw", [dict(draft_tree=(2, 3, 6)), dict(draft_tree=(3, 2, 5), runner="paged"),
                                dict(k=4, runner="paged"), dict(k=2, runner="recompute"),
                                dict(k=5, repetition_penalty=1.2, top_p=0.8),
                                dict(draft_tree=(2, 2, 4), top_k=10, runner="recompute")])
def test_seeded_samples_repeat_and_do_not_depend_on_the_batch(target, head, kw):
    def run(prompts, seeds):
        return specdec_ext.generate(prompts, target, EagleDrafterSpec(head), max_new_tokens=24, eos_token_id=False,
                                    temperature=0.8, seed=seeds, **kw).token_ids
    batch = run(PROMPTS, [11, 12, 13])
    assert run(PROMPTS, [11, 12, 13]) == batch
    assert [run([p], [11 + b])[0] for b, p in enumerate(PROMPTS)] == batch


@pytest.mark.parametrize("draft_vocab,kw,temperature,top_p", [(2, dict(draft_tree=(3, 2, 5)), 1.0, 1.0),
                                                              (3, dict(k=3), 0.8, 0.9),
                                                              (2, dict(draft_tree=(3, 2, 5)), 0.8, 0.9),
                                                              (None, dict(draft_tree=(2, 2, 3), runner="paged"), 1.0, 1.0)])
def test_the_first_three_tokens_follow_the_filtered_target(draft_vocab, kw, temperature, top_p):
    """generate() with 3000 seeds against the exact law of plain sampling (chi-square), trees whose branching
    passes the draft vocabulary, top-p, the paged runner."""
    model = tiny_target("llama", vocab=8, hidden=32, layers=6, seed=3, logit_scale=1.0)
    h = random_head(model, draft_vocab=draft_vocab, seed=4, scale=3.0)
    prompt, n = [1, 4, 2, 6], 3000
    out = specdec_ext.generate([prompt] * n, model, EagleDrafterSpec(h), max_new_tokens=3, temperature=temperature,
                               top_p=top_p, seed=list(range(n)), eos_token_id=False, **kw).token_ids
    assert chi_square_p(out, exact_joint(model, prompt, temperature=temperature, top_p=top_p)) > 1e-4


# ============================================================================== train-eagle
FAST = ["--pieces", "6", "--chars", "40", "--prompt-tokens", "8", "--new-tokens", "8", "--draft-vocab", "16",
        "--batch", "4", "--warmup-steps", "2", "--layer-ids", "1,3,5", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_sweep_cli")
    model = tiny_target("llama", vocab=CHAR_VOCAB, layers=6, hidden=64, seed=0, logit_scale=10.0)
    model.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    model.save_pretrained(root / "no_tokenizer")
    texts = root / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 8)
    (texts / "b.txt").write_text("for i in range(10):\n    print(i * i, end=' ')\n" * 8)
    return str(root / "target"), str(texts), str(root / "no_tokenizer"), model


CHILD = textwrap.dedent("""
    import sys, time
    from specdec_ext import cli
    from specdec_ext.eagle import training
    marker, argv = sys.argv[1], sys.argv[2:]
    original = training._save
    def save(head, optimizer, losses, step, *rest):
        original(head, optimizer, losses, step, *rest)
        if step >= 4:  # a whole checkpoint is on disk: say so and wait to be killed
            open(marker, "w").write(str(step))
            time.sleep(120)
    training._save = save
    sys.exit(cli.main(argv))
""")


def test_a_killed_run_resumes_from_its_last_checkpoint_and_its_export_loads(target_dir, tmp_path, capsys):
    """The training subprocess killed (SIGKILL) after its checkpoint of step 4; the same command again
    resumes at step 4, ends at 8, and --export's int8 head loads and drafts plain greedy."""
    target, texts, _, model = target_dir
    out, exported, marker = str(tmp_path / "run"), str(tmp_path / "export"), str(tmp_path / "saved")
    argv = ["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "8", "--save-every", "2",
            *FAST]
    child = subprocess.Popen([sys.executable, "-c", CHILD, marker, *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 100
        while not os.path.exists(marker) and child.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert os.path.exists(marker), f"the training subprocess ended ({child.poll()}) before its checkpoint"
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert open(marker).read() == "4"
    assert cli.main([*argv, "--export", exported]) == 0
    assert "trained steps 4..8" in capsys.readouterr().out
    state = torch.load(os.path.join(out, "trainer.pt"), weights_only=False)
    assert state["step"] == 8 and len(state["losses"]) == 8
    prompt = [3, 4, 5, 6, 7]
    for path in (out, exported):
        result = specdec_ext.generate([prompt], model, path, max_new_tokens=12, k=3, eos_token_id=False)
        assert result.plan.drafter == "eagle" and result.token_ids == [hf_greedy(model, prompt, 12)]


def test_a_run_interrupted_while_saving_a_checkpoint_resumes(target_dir, tmp_path, monkeypatch):
    """Was a defect, fixed: save_eagle removes the run's model.safetensors before writing the new one, and the trainer
    state is written after it: a Ctrl-C (or kill) during the second checkpoint's save leaves trainer.pt and
    config.json without weights, and the same command then fails ("load_eagle: ... holds none of
    ('model.safetensors', ...)"): the run cannot be resumed. Expected: it resumes from the last whole
    checkpoint (step 3) and finishes."""
    import safetensors.torch

    target, texts, _, _ = target_dir
    out = str(tmp_path / "run")
    argv = ["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "9", "--save-every", "3",
            *FAST]
    original, calls = safetensors.torch.save_file, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the Ctrl-C lands while the checkpoint of step 6 is written
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    assert cli.main(argv) == 130
    monkeypatch.setattr(safetensors.torch, "save_file", original)
    assert cli.main(argv) == 0
    assert torch.load(os.path.join(out, "trainer.pt"), weights_only=False)["step"] == 9


def test_layer_ids_the_target_lacks_are_refused_before_the_data_are_made(target_dir, tmp_path, capsys):
    """Was a defect, fixed: --layer-ids -1,3,5 (or 1,3,9 on 6 layers) is refused only after the target has continued every
    piece (data.pt written in --out: on a real target the longest part of the run); the command's bad input is
    otherwise refused before any work (test_eagle_command). Expected: refused with nothing written."""
    target, texts, _, _ = target_dir
    out = str(tmp_path / "run")
    assert cli.main(["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "2", *FAST,
                     "--layer-ids=-1,3,5"]) == 1
    assert "layers [-1, 3, 5]" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "data.pt"))


def test_a_data_file_of_exactly_chars_characters_is_a_piece(target_dir, tmp_path):
    """Was a defect (off by one), fixed: texts.read_pieces takes starts in range(0, len(text) - chars): a file of exactly
    --chars characters gives no piece, and train-eagle says "--data: no file holds a piece of --chars 40
    characters" of a file that holds exactly one."""
    from specdec_ext.eagle.texts import read_pieces

    path = tmp_path / "exact.txt"
    path.write_text("x = 1\n" * 6 + "pass")  # 40 characters
    assert read_pieces([str(path)], 4, 40, seed=0) == [path.read_text()]


def test_train_eagle_refuses_a_target_without_a_tokenizer_and_bad_data_by_name(target_dir, tmp_path):
    target, texts, no_tokenizer, _ = target_dir
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as error:
        cli.main(["train-eagle", "--target", no_tokenizer, "--data", texts, "--out", out, "--steps", "2", *FAST])
    assert f"--target {no_tokenizer}: could not load a causal LM and its tokenizer" in str(error.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="holds no files"):
        cli.main(["train-eagle", "--target", target, "--data", str(empty), "--out", out, "--steps", "2", *FAST])
    assert not os.path.exists(out)


def test_a_head_trained_on_two_layers_and_binary_data_drafts_exactly(target_dir, tmp_path):
    """--layer-ids with two layers (fc reads 2 x H) on a file of arbitrary bytes: it trains, loads and drafts."""
    target, _, _, model = target_dir
    data = tmp_path / "bytes.bin"
    data.write_bytes(bytes(range(256)) * 2)
    out = str(tmp_path / "run")
    assert cli.main(["train-eagle", "--target", target, "--data", str(data), "--out", out, "--steps", "2",
                     "--save-every", "2", *FAST, "--layer-ids", "1,4"]) == 0
    loaded = load_eagle(out, model)
    assert loaded.config.layer_ids == (1, 4) and loaded.fc.weight.shape == (64, 2 * 64)
    prompt = [3, 4, 5, 6]
    assert greedy(model, EagleDrafterSpec(loaded), prompts=[prompt], new=10).token_ids == [hf_greedy(model, prompt, 10)]
