"""EAGLE-3 checkpoints (specdec_ext/eagle/checkpoints.py; issue 27, item 3): tiny checkpoints written here
as SafeAILab/EAGLE (pytorch_model.bin, no embedding), SpecForge (model.safetensors, flat Llama config with
draft_vocab_size) and vLLM's speculators (nested transformer_layer_config, ``layers.0.`` names, fc bias,
norm_before_residual) write them, for tiny Llama and Qwen3 targets, load into the same weights and the
same drafts as the in-project model; save_eagle round-trips both layouts; a head made for another target
(hidden size, vocabulary, layer ids) is a ValueError naming both values before any work."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eagle_utils import eagle_generate, proposals, random_head, tiny_target
from specdec_ext.eagle import EagleMismatchError, load_eagle, save_eagle
from specdec_ext.eagle.checkpoints import config_to_dict
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30]]
FAMILIES = {"llama": "lean", "qwen3": "paged"}  # (the lean runner does not run Qwen3's q/k norms)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = tiny_target(request.param, layers=7)
    return request.param, target, random_head(target, draft_vocab=40, seed=5)


def layer_config(head) -> dict:
    """The draft layer's Llama config as SpecForge's configs/*-eagle3.json spell it."""
    c = head.config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "pad_token_id": 0}


def eagle_tensors(head, dtype=torch.bfloat16, embed=False) -> dict:
    """The tensors by SafeAILab/EAGLE's names (``midlayer.``), bf16 as released; d2t int64, t2d bool."""
    out = {}
    for name, tensor in head.state_dict().items():
        if name == "embed_tokens.weight" and not embed:
            continue
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return {k: v.contiguous() for k, v in out.items()}


def write_safeailab(head, path):
    os.makedirs(path)
    json.dump(dict(layer_config(head), draft_vocab_size=head.config.draft_vocab_size), open(path / "config.json", "w"))
    torch.save(eagle_tensors(head), path / "pytorch_model.bin")


def write_specforge(head, path):
    os.makedirs(path)
    config = dict(layer_config(head), draft_vocab_size=head.config.draft_vocab_size,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.config.layer_ids),
                                "use_aux_hidden_state": True})
    json.dump(config, open(path / "config.json", "w"))
    save_file(eagle_tensors(head, embed=True), str(path / "model.safetensors"))


def write_speculators(head, path):
    os.makedirs(path)
    layer = layer_config(head)
    layer.pop("architectures")
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.1.0", "transformer_layer_config": layer,
              "draft_vocab_size": head.config.draft_vocab_size,
              "norm_before_residual": head.config.norm_before_residual,
              "target_hidden_size": head.config.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(head.config.layer_ids),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny-target", "architectures": ["X"]}}}
    json.dump(config, open(path / "config.json", "w"))
    tensors = {(("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k): v
               for k, v in eagle_tensors(head, embed=True).items()}
    save_file(tensors, str(path / "model.safetensors"))


def bf16_rounded(head, embed: bool):
    """The head with its weights rounded through bf16 (what a bf16 checkpoint holds); without ``embed`` the
    embedding stays the target's (a checkpoint without one takes it from the target)."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if embed or name != "embed_tokens.weight":
                p.copy_(p.to(torch.bfloat16).float())
    return head


def assert_same_head(loaded, head):
    state, expected = loaded.state_dict(), head.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert loaded.config.layer_ids == head.config.layer_ids


@pytest.mark.parametrize("writer", [write_safeailab, write_specforge, write_speculators])
def test_published_layouts_load_into_the_same_head_and_drafts(pair, writer, tmp_path):
    family, target, head = pair
    overrides = dict(norm_before_residual=True, fc_bias=True) if writer is write_speculators else {}
    head = bf16_rounded(random_head(target, draft_vocab=40, seed=5, **overrides), embed=writer is not write_safeailab)
    writer(head, tmp_path / "ckpt")
    loaded = load_eagle(str(tmp_path / "ckpt"), target)
    assert_same_head(loaded, head)
    runner = FAMILIES[family]
    assert proposals(target, loaded, PROMPTS, 8, runner=runner) == proposals(target, head, PROMPTS, 8, runner=runner)
    assert eagle_generate(target, loaded, PROMPTS, 8, runner=runner) == [hf_greedy(target, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_save_eagle_round_trips(pair, layout, tmp_path):
    family, target, head = pair
    save_eagle(head, str(tmp_path), layout=layout, embed=layout == "speculators")
    config = json.load(open(tmp_path / "config.json"))
    if layout == "eagle":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.config.layer_ids)
    else:
        assert config["speculators_model_type"] == "eagle3" and "transformer_layer_config" in config
    loaded = load_eagle(str(tmp_path), target)
    assert_same_head(loaded, head)
    assert proposals(target, loaded, PROMPTS, 6, runner=FAMILIES[family], tree=(2, 2, 4)) == \
        proposals(target, head, PROMPTS, 6, runner=FAMILIES[family], tree=(2, 2, 4))


def test_a_full_vocabulary_head_needs_no_d2t(pair, tmp_path):
    _, target, _ = pair
    head = random_head(target, seed=6)  # the target's whole vocabulary
    tensors = {k: v for k, v in eagle_tensors(head).items() if k not in ("d2t", "t2d")}
    os.makedirs(tmp_path / "ckpt")
    json.dump(layer_config(head), open(tmp_path / "ckpt" / "config.json", "w"))
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    loaded = load_eagle(str(tmp_path / "ckpt"), target)
    assert torch.equal(loaded.target_ids, torch.arange(96)) and bool(loaded.t2d.all())


def test_default_layer_ids_come_from_the_target(pair, tmp_path):
    _, target, head = pair
    write_safeailab(head, tmp_path / "ckpt")  # no ids pinned in the config
    assert load_eagle(str(tmp_path / "ckpt"), target).config.layer_ids == (2, 3, 4)  # 7 layers: (2, L // 2, L - 3)


def test_a_head_for_another_target_is_refused_naming_both_values(pair, tmp_path):
    family, target, head = pair
    write_speculators(head, tmp_path / "ckpt")
    with pytest.raises(EagleMismatchError, match="size 64, this target's are 96"):
        load_eagle(str(tmp_path / "ckpt"), tiny_target(family, hidden=96, layers=7))
    with pytest.raises(EagleMismatchError, match="vocabulary of 96 tokens, this target's LM head scores 100"):
        load_eagle(str(tmp_path / "ckpt"), tiny_target(family, vocab=100, layers=7))
    with pytest.raises(EagleMismatchError, match=r"layers \[2, 3, 4\], this target has 4 layers"):
        load_eagle(str(tmp_path / "ckpt"), tiny_target(family, layers=4))
    save_eagle(head, str(tmp_path / "mine"))
    with pytest.raises(EagleMismatchError, match="target of 7 layers, this target has 8"):
        load_eagle(str(tmp_path / "mine"), tiny_target(family, layers=8))


def test_missing_files_and_tensors_are_named(pair, tmp_path):
    _, target, head = pair
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle(str(tmp_path), target)
    write_safeailab(head, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="pass target="):
        load_eagle(str(tmp_path / "ckpt"))
    tensors = eagle_tensors(head)
    del tensors["fc.weight"]
    torch.save(tensors, tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        load_eagle(str(tmp_path / "ckpt"), target)
    with pytest.raises(ValueError, match="layout must be one of"):
        save_eagle(head, str(tmp_path / "x"), layout="medusa")
    assert config_to_dict(head.config, "eagle")["vocab_size"] == 96
