"""Shared builders for the generate/audit/CLI tests: tiny random-weight models and a char tokenizer.

(No tests here; the name keeps it next to the files that import it.)
"""
from __future__ import annotations

import contextlib
import copy

import torch
import transformers

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;()[]=+-*/\n_'\"#<>!?")
CHAR_VOCAB = 64  # 61 real tokens, the embeddings padded to 64
ARCHS = ("llama", "gpt_neox")


@contextlib.contextmanager
def one_thread():
    """The CPU is shared: tiny models run much faster (and steadier) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_model(arch: str = "llama", *, vocab: int = 96, hidden: int = 32, layers: int = 1, seed: int = 0,
               logit_scale: float = 1.0, max_positions: int = 256):
    """A random-weight causal LM; ``logit_scale`` sharpens its distributions (scales lm_head)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=max_positions, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    elif arch == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def noisy_copy(model, noise: float = 0.2, seed: int = 1):
    """A draft that agrees with the target often but not always: weights + noise * std * N(0, 1)."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(noise * p.std() * torch.randn_like(p))
    return draft.eval()


def char_tokenizer(chars=CHARS):
    """A character-level PreTrainedTokenizerFast (<eos> = 0, <unk> = 1, then one token per char)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def hf_greedy(model, prompt, max_new_tokens, eos_token_id=None):
    """Plain HF greedy generation of one prompt: the reference tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_eos_and_max_new_tokens(run, references, eos, max_news=(1, 2, 7)):
    """``run(max_new_tokens, eos_token_id)`` -> GenerationResult must end each row at its first EOS
    (inclusive, reason "eos") or at the cap, and give exactly the first max_new reference tokens."""
    out = run(len(references[0]), eos)
    for ref, got, reason in zip(references, out.token_ids, out.finish_reasons):
        if eos in ref:
            assert got == ref[: ref.index(eos) + 1] and reason == "eos"
        else:
            assert got == ref and reason == "length"
    for max_new in max_news:
        assert run(max_new, False).token_ids == [r[:max_new] for r in references]
