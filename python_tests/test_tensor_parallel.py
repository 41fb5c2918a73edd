"""Speculative decoding over a tensor-parallel target (specdec_ext/distributed.py), on this CPU: two
processes with gloo (torch.multiprocessing.spawn and a file:// rendezvous; results come back through
torch.save files), the target sharded with HF's tensor parallelism, the draft replicated.

Every rank's output equals the single-process generate(): greedy on a Llama and a Qwen3 target, with a
draft model, with n-gram drafts and with an EAGLE-3 head (greedy and seeded at T = 1: the sharded
target's runner taps the replicated hidden states), a ragged batch with a row that ends early at EOS; a
seeded sample at T = 1. The ranks run with tp_check="verify", which raises when they disagree on any proposal or
verdict: they agree by construction. The target loaded by path with tp_size=2 under torchrun's
environment; the CLI under torchrun; a rank that raises ends both processes with its error."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from test_generate_utils import noisy_copy, tiny_model

WORLD = 2
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [11, 12, 13], [20, 21, 20, 21, 20, 21, 22]]
NEW = 14
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_pair(root, arch):
    if arch == "llama":
        target = tiny_model(arch, vocab=64, hidden=64, layers=2, logit_scale=4.0)
    else:
        import transformers
        torch.manual_seed(0)
        config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=256, tie_word_embeddings=False)
        target = transformers.Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(4.0)
        target.generation_config.eos_token_id = None
    draft = noisy_copy(target, noise=0.3)
    target.save_pretrained(os.path.join(root, f"{arch}_target"))
    draft.save_pretrained(os.path.join(root, f"{arch}_draft"))
    from eagle_utils import random_head
    from specdec_ext.eagle import save_eagle
    # (without its embedding, as train-eagle and the bundled head save it: loaded from the sharded target's)
    save_eagle(random_head(target, draft_vocab=40, layer_ids=(0, 1, 1)), os.path.join(root, f"{arch}_eagle"),
               embed=False)
    return target, draft


SCENARIOS = {  # name -> generate() arguments (besides the prompts and the models)
    "greedy_model": dict(k=3),
    "greedy_ngram": dict(k=4, draft="ngram"),
    "greedy_eos": dict(k=3),  # eos_token_id: a token row 0 emits early (chosen by the fixture)
    "seeded_t1": dict(k=3, temperature=1.0, top_p=0.9, seed=[1, 2, 3]),
    "greedy_tree": dict(draft_tree=(2, 2, 4)),
    "greedy_heads": dict(draft="heads", draft_tree=(2, 2, 4)),  # Medusa-style heads on the target, replicated
    # an EAGLE-3 head, replicated, on the hidden states the sharded target's runner taps (replicated too)
    "greedy_eagle": dict(k=3, draft="eagle"),
    "seeded_eagle_t1": dict(k=3, draft="eagle", temperature=1.0, seed=[4, 5, 6]),
}


def _heads():
    """The same random heads on every process (seeded): hidden 64, 2 heads, vocabulary 64."""
    from specdec_ext.heads import MedusaHeads
    torch.manual_seed(5)
    return MedusaHeads(64, 2, 64).eval()


def _drafter(name, draft, root, arch):
    """A scenario's draft: the draft model, "ngram", the seeded heads or the saved EAGLE-3 head."""
    if name == "heads":
        return _heads()
    if name == "eagle":
        from specdec_ext.eagle import EagleDrafterSpec
        return EagleDrafterSpec(os.path.join(root, f"{arch}_eagle"))
    return draft if name is None else name


def _scenario_kwargs(name, eos):
    kw = dict(SCENARIOS[name])
    kw["eos_token_id"] = eos if name == "greedy_eos" else False
    return kw


def _early_eos(target, draft) -> int:
    """A token that greedy decoding emits in row 0 within its first tokens but not in row 1 (so that row 0
    ends early at it and row 1 runs to max_new_tokens)."""
    import specdec_ext
    tokens = specdec_ext.generate(PROMPTS[:2], target, draft, max_new_tokens=NEW, k=3, eos_token_id=False).token_ids
    return next(t for t in tokens[0][1:NEW // 2] if t not in tokens[1])


def _run_scenarios(target, draft, eos, root, arch):
    import specdec_ext
    out = {}
    for name in SCENARIOS:
        kw = _scenario_kwargs(name, eos)
        d = _drafter(kw.pop("draft", None), draft, root, arch)
        result = specdec_ext.generate(PROMPTS, target, d, max_new_tokens=NEW, cost_probe=False, **kw)
        out[name] = (result.token_ids, result.finish_reasons)
    return out


def _worker(rank, root, port, arch, mode, eos=None):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), SPECDEC_TP_TIMEOUT_S="60")
    torch.set_num_threads(1)
    import specdec_ext
    from specdec_ext import distributed
    from transformers import AutoModelForCausalLM
    draft = AutoModelForCausalLM.from_pretrained(os.path.join(root, f"{arch}_draft")).eval()
    if mode == "fail":
        distributed.init_from_environment("cpu")
        if rank == 1:
            raise RuntimeError("rank 1 failed on purpose")
        torch.distributed.barrier()  # rank 0 waits here for a rank that is gone
        return
    # loaded by path with tp_size: torch.distributed initialised from the torchrun-style environment
    results = {}
    for name in SCENARIOS:
        kw = _scenario_kwargs(name, eos)
        d = _drafter(kw.pop("draft", None), draft, root, arch)
        result = specdec_ext.generate(PROMPTS, os.path.join(root, f"{arch}_target"), d, tp_size=WORLD,
                                      tp_check="verify", max_new_tokens=NEW, cost_probe=False, **kw)
        results[name] = (result.token_ids, result.finish_reasons)
        assert result.plan.tensor_parallel == WORLD and result.plan.target_runner == "paged"
    torch.save(results, os.path.join(root, f"{arch}_rank{rank}.pt"))
    distributed.destroy()
    distributed.exit_rank(0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tp_results(request, tmp_path_factory):
    arch = request.param
    root = str(tmp_path_factory.mktemp(f"tp_{arch}"))
    torch.set_num_threads(1)
    target, draft = _save_pair(root, arch)
    eos = _early_eos(target, draft)
    single = _run_scenarios(target, draft, eos, root, arch)
    mp.spawn(_worker, args=(root, _free_port(), arch, "ok", eos), nprocs=WORLD, join=True)
    ranks = [torch.load(os.path.join(root, f"{arch}_rank{r}.pt")) for r in range(WORLD)]
    return arch, single, ranks


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_equals_the_single_process_output(tp_results, scenario):
    arch, single, ranks = tp_results
    for r, results in enumerate(ranks):
        assert results[scenario] == single[scenario], (arch, scenario, r)
    if scenario == "greedy_eos":
        assert single[scenario][1][:2] == ["eos", "length"]  # row 0 ended early at EOS


def test_a_rank_that_raises_ends_both_with_its_error(tmp_path):
    _save_pair(str(tmp_path), "llama")
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        mp.spawn(_worker, args=(str(tmp_path), _free_port(), "llama", "fail"), nprocs=WORLD, join=True)
    assert time.monotonic() - start < 60  # rank 0 was ended, not left waiting for the collective


def test_the_cli_under_torchrun(tmp_path):
    from test_generate_utils import char_tokenizer
    _save_pair(str(tmp_path), "llama")  # vocab 64: the char tokenizer's (61 tokens, padded)
    for name in ("llama_target", "llama_draft"):
        char_tokenizer().save_pretrained(tmp_path / name)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
               str(_free_port()), "-m", "specdec_ext", "generate", "--target", str(tmp_path / "llama_target"),
               "--draft", str(tmp_path / "llama_draft"), "--tp", "2", "--tp-check", "verify", "-k", "3",
               "--max-new-tokens", "6", "--no-eos", "--no-stream", "--explain", "--threads", "1", "--json", "def f(x):",
               "--plot", str(tmp_path / "tp.png")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # rank 0 prints, once: one JSON document
    assert "tensor parallel  the target is sharded over 2 ranks" in out.stderr
    assert result["new_tokens"] == 6 and len(result["token_ids"][0]) == 6
    assert (tmp_path / "tp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # (--plot was dropped under --tp)


def test_tensor_parallel_refuses_adaptive_k_and_a_size_that_does_not_match():
    import specdec_ext
    target = tiny_model("llama", vocab=64, hidden=32, layers=1)
    with pytest.raises(ValueError, match="tp_size=2 but the target given is sharded over 1 rank"):
        specdec_ext.generate([[1, 2]], target, noisy_copy(target, 0.1), tp_size=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        specdec_ext.generate([[1, 2]], target, noisy_copy(target, 0.1), tp_size=0, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="run under torchrun"):
        specdec_ext.generate([[1, 2]], "/nonexistent/model", "ngram", tp_size=2, max_new_tokens=2)


def test_heads_that_do_not_divide_over_the_ranks_are_named_before_the_load(tmp_path):
    """(HF's sharded forward failed in a reshape: "shape '[1, 2, -1, 64]' is invalid for input of size 342")"""
    import transformers

    from specdec_ext.distributed import _check_heads_divide

    for heads, kv_heads, words in ((3, 3, "3 attention heads"), (4, 1, "1 key/value heads")):
        config = transformers.LlamaConfig(hidden_size=48 if heads == 3 else 64, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=32)
        config.save_pretrained(tmp_path / f"h{heads}_{kv_heads}")
        with pytest.raises(ValueError, match=f"the target has {words}, which do not divide over tp_size=2 ranks"):
            _check_heads_divide(str(tmp_path / f"h{heads}_{kv_heads}"), 2)
    _check_heads_divide(str(tmp_path / "h4_1"), 1)  # one rank: anything divides
