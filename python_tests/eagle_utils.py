"""Shared builders of the EAGLE-3 tests: tiny targets of two families, random heads, an EAGLE decode.

(No tests here; imported by test_eagle*.py.)
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import transformers

from specdec_ext.decode import LoopConfig, decode
from specdec_ext.eagle import Eagle3Model, EagleConfig, EagleDrafter
from specdec_ext.plan import required_cache_len
from specdec_ext.runners import make_runner
from specdec_ext.sampling import SamplingParams
from specdec_ext.stops import RowState, StopCriteria


def tiny_target(family: str = "llama", *, layers: int = 6, hidden: int = 64, vocab: int = 96, seed: int = 0,
                logit_scale: float = 3.0):
    """A random-weight Llama or Qwen3 causal LM (sharpened by ``logit_scale`` so greedy runs vary)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=hidden // 4, **common))
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def random_head(target, *, draft_vocab: Optional[int] = None, seed: int = 1, scale: float = 1.0,
                layer_ids=None, **overrides) -> Eagle3Model:
    """An EAGLE-3 head for ``target`` with random weights (its embedding the target's), a draft vocabulary
    of ``draft_vocab`` target ids (a random subset, sorted) when given."""
    config = EagleConfig.for_target(target, draft_vocab_size=draft_vocab, layer_ids=layer_ids, **overrides)
    torch.manual_seed(seed)
    head = Eagle3Model(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1 and name != "embed_tokens.weight":
                p.mul_(scale)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    if draft_vocab is not None:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randperm(config.vocab_size, generator=generator)[:draft_vocab].sort().values
        head.set_draft_vocab(ids)
    return head.eval().requires_grad_(False)


def eagle_generate(target_model, head: Eagle3Model, prompts: Sequence[Sequence[int]], new: int, *, k: int = 4,
                   tree=None, runner: str = "lean", sampling: SamplingParams = SamplingParams(),
                   seeds: Optional[Sequence[int]] = None, adaptive=None) -> List[List[int]]:
    """The loop (decode.py) with an EagleDrafter over a tapped target runner: each row's new tokens."""
    B = len(prompts)
    drafter_slots = k
    S = required_cache_len(max(len(p) for p in prompts), new, 16)
    target = make_runner(runner, target_model, max_batch_size=B, max_seq_len=S, hidden_taps=head.config.layer_ids)
    drafter = EagleDrafter(target, head, k=k, tree=tree)
    drafter_slots = drafter.slots
    config = LoopConfig(slots=drafter_slots, sampling=sampling, max_seq_len=S, cost_probe=False, adaptive=adaptive)
    rows = [RowState() for _ in range(B)]
    seeds = torch.tensor(list(seeds) if seeds is not None else [0] * B, dtype=torch.int64)
    for _ in decode(target, drafter, prompts, seeds, StopCriteria(max_new_tokens=new), config, rows=rows):
        pass
    return [r.tokens for r in rows]


def proposals(target_model, head: Eagle3Model, prompts: Sequence[Sequence[int]], new: int, *, k: int = 3,
              tree=None, runner: str = "lean") -> List[List[List[int]]]:
    """Every step's drafted token ids per row ([step][row][slot]) of a greedy EAGLE decode."""
    B = len(prompts)
    S = required_cache_len(max(len(p) for p in prompts), new, 16)
    target = make_runner(runner, target_model, max_batch_size=B, max_seq_len=S, hidden_taps=head.config.layer_ids)
    drafter = EagleDrafter(target, head, k=k, tree=tree)
    seen: List[List[List[int]]] = []
    original = drafter.propose

    def spy(meta, budget=None):
        proposal = original(meta, budget)
        seen.append(proposal.token_ids.tolist())
        return proposal

    drafter.propose = spy
    config = LoopConfig(slots=drafter.slots, sampling=SamplingParams(), max_seq_len=S, cost_probe=False)
    for _ in decode(target, drafter, prompts, torch.zeros(B, dtype=torch.int64), StopCriteria(max_new_tokens=new),
                    config):
        pass
    return seen
