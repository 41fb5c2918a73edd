#!/usr/bin/env python
"""A draft with another tokenizer (issue 29) against HF's universal assisted generation, on the bundled pair.

No second tokenizer family is available offline, so the draft's tokenizer is the bundled one with its ids
permuted (every non-special token moved to another id) and the draft model's embedding and head rows
permuted alike: the same draft, predicting the same text, behind a vocabulary that differs at every id.
``generate`` then takes the cross-tokenizer path (greedy-through-text at T = 0, the intersection at T > 0:
here every token is shared), and its cost over the shared-vocabulary drafter is the price of the text
path. HF's universal assisted generation gets the same pair (``assistant_model``, ``tokenizer``,
``assistant_tokenizer``).

    python benchmarks/bench_cross_tokenizer.py [--prompts 4] [--max-new-tokens 64] [--k 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import transformers

import specdec_ext
from specdec_ext.bench.workloads import code_prompts


def permuted_pair(draft, tokenizer):
    """(draft model, tokenizer) with every non-special id reversed: a vocabulary that differs everywhere."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    special = {token["id"] for token in spec["added_tokens"]}
    ids = sorted(i for i in spec["model"]["vocab"].values() if i not in special)
    new_id = dict(zip(ids, reversed(ids)))
    spec["model"]["vocab"] = {token: new_id.get(i, i) for token, i in spec["model"]["vocab"].items()}
    permuted = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                                    eos_token=tokenizer.eos_token, clean_up_tokenization_spaces=False)
    model = copy.deepcopy(draft)
    old_of_new = torch.arange(model.get_input_embeddings().weight.shape[0])
    for old, new in new_id.items():
        old_of_new[new] = old
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight.copy_(weight[old_of_new].clone())
    return model.eval(), permuted


HF_PADDING = 64  # HF takes the universal path only for a draft of another vocabulary size


def padded_for_hf(draft):
    """The draft with HF_PADDING more vocabulary rows whose logits are -1e4 (never drawn, never argmax):
    the same predictions behind a vocabulary size HF's universal assisted generation accepts."""
    model = copy.deepcopy(draft)
    size = model.get_input_embeddings().weight.shape[0]
    old_head = model.get_output_embeddings()
    model.config.tie_word_embeddings = False
    model.resize_token_embeddings(size + HF_PADDING)
    head = torch.nn.Linear(old_head.in_features, size + HF_PADDING, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:size].copy_(old_head.weight[:size])
        head.bias.zero_()
        head.bias[size:] = -1e4
    model.set_output_embeddings(head)
    return model.eval()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_assisted(target, prompts, tokenizer, max_new_tokens, **kw):
    """HF generate per prompt (batch 1, as assisted generation requires); (new token lists, seconds)."""
    outs, seconds = [], 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out, s = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                                min_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                                                tokenizer=tokenizer, **kw))
        outs.append(out[0, len(prompt):].tolist())
        seconds += s
    return outs, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out code prompts (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    parser.add_argument("--k", type=int, default=4, help="draft length of ours and HF's (default: 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specdec_ext.load_default_pair()
    target, draft = target.float(), draft.float()
    other_draft, other_tokenizer = permuted_pair(draft, tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in code_prompts(args.prompts, 8)]
    n = args.max_new_tokens
    common = dict(max_new_tokens=n, eos_token_id=False, tokenizer=tokenizer, cost_probe=False)
    specdec_ext.generate(prompts[:1], target, draft, k=args.k, **{**common, "max_new_tokens": 4})  # warm-up
    rows = []
    for name, model, extra in (
        ("ours, shared vocabulary", draft, {}),
        ("ours, other tokenizer (through text)", other_draft, dict(draft_tokenizer=other_tokenizer)),
        ("ours, shared vocabulary, T=1", draft, dict(temperature=1.0, seed=0)),
        ("ours, other tokenizer, T=1 (intersection)", other_draft,
         dict(draft_tokenizer=other_tokenizer, temperature=1.0, seed=0)),
    ):
        # one prompt per call, as HF's assisted generation runs (batch 1)
        results, seconds = timed(lambda: [specdec_ext.generate([p], target, model, k=args.k, **common, **extra)
                                          for p in prompts])
        tokens = [r.token_ids[0] for r in results]
        per_pass = sum(r.stats.emitted for r in results) / sum(r.stats.row_steps for r in results)
        rows.append((name, sum(map(len, tokens)) / seconds, per_pass, None if "T=1" in name else tokens))
    plain, seconds = hf_assisted(target, prompts, tokenizer, n, do_sample=False)
    rows.append(("HF plain greedy", n * len(prompts) / seconds, 1.0, plain))
    hf_kw = dict(do_sample=False, num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant")
    same, seconds = hf_assisted(target, prompts, tokenizer, n, assistant_model=draft, **hf_kw)
    rows.append(("HF assisted, shared vocabulary", n * len(prompts) / seconds, None, same))
    universal, seconds = hf_assisted(target, prompts, tokenizer, n, assistant_model=padded_for_hf(other_draft),
                                     assistant_tokenizer=other_tokenizer, **hf_kw)
    rows.append(("HF universal assisted (other tokenizer)", n * len(prompts) / seconds, None, universal))
    # sampled, T = 1: HF's plain sampling, and its universal assisted generation sampling (its
    # UniversalSpeculativeDecodingGenerator where the vocabularies overlap)
    torch.manual_seed(0)
    _, seconds = hf_assisted(target, prompts, tokenizer, n, do_sample=True, temperature=1.0, top_k=0)
    rows.append(("HF plain sampling, T=1", n * len(prompts) / seconds, 1.0, None))
    sampled_kw = dict(do_sample=True, temperature=1.0, top_k=0, num_assistant_tokens=args.k,
                      num_assistant_tokens_schedule="constant")
    # HF's sampled path prunes the draft's head to the shared tokens and fails (transformers 5.24:
    # AssistantToTargetTranslator has no assistant_overlap_token_ids) when every draft token is shared, as
    # in the permuted pair: one token only the draft has (a padded row) lets it run
    hf_tokenizer = copy.deepcopy(other_tokenizer)
    hf_tokenizer.add_tokens(["<only-in-the-draft>"])
    _, seconds = hf_assisted(target, prompts, tokenizer, n, assistant_model=padded_for_hf(other_draft),
                             assistant_tokenizer=hf_tokenizer, **sampled_kw)
    rows.append(("HF universal assisted (other tokenizer), T=1", n * len(prompts) / seconds, None, None))
    print(f"{len(prompts)} prompts x {n} new tokens, one per call, k={args.k}, {args.threads} thread(s), fp32, "
          "bundled pair (the draft's tokenizer: the bundled one with its ids permuted)")
    print(f"{'method':<48} {'tokens/s':>9} {'tokens/pass':>12}  greedy == HF plain")
    for name, speed, per_pass, tokens in rows:
        same_as_plain = "" if tokens is None else str(tokens == plain)
        print(f"{name:<48} {speed:9.1f} {'' if per_pass is None else f'{per_pass:.2f}':>12}  {same_as_plain}")


if __name__ == "__main__":
    main()
