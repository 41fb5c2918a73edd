"""Log-probabilities of the emitted tokens (OpenAI's ``logprobs`` / ``top_logprobs``), read from the
verify pass that emitted them, whichever way each token came (an accepted draft, a resample or the
bonus token): token i of a row's step comes from column i of a chain, from the column of the path
node before it in a tree. The distribution is the processed target's (specdec_ext/processing.py:
penalties, logit_bias, grammar and min_p masks) at the row's temperature (greedy and infinite
temperatures: 1), before top-k and top-p, as vLLM's ``processed_logprobs``. Greedy logprobs equal
plain decoding's: the same logits, the same ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .ops import GREEDY_TEMPERATURE

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (chat) and logprobs (completions)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position."""

    token: int
    logprob: Optional[float]  # None: a prompt's first token (nothing before it to condition on)
    top: Tuple[Tuple[int, float], ...] = ()  # (token, logprob), most likely first


def check_top_logprobs(top: Optional[int], name: str = "top_logprobs") -> None:
    """``name``: the argument as the caller spells it (generate()'s ``logprobs``)."""
    if top is None:
        return
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}")


def emitted_columns(tokens: torch.Tensor, path: Optional[torch.Tensor]) -> torch.Tensor:
    """The logits column of each emitted token: [B, n+1] int64 (a chain: 0..n; a tree: 0, then
    path[i-1] + 1; columns past the row's emitted tokens are clamped, never read)."""
    B, w = tokens.shape
    if path is None:
        return torch.arange(w, device=tokens.device).expand(B, w)
    after = (path.to(torch.int64) + 1).clamp(min=0)  # [B, n]
    return torch.cat([torch.zeros((B, 1), dtype=torch.int64, device=tokens.device), after], dim=1)


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, path: Optional[torch.Tensor],
                  temperature: torch.Tensor, top: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of a step's emitted tokens.

    logits [B, n+1, V] (processed); tokens [B, n+1] int64 (-1 past the emitted ones); path [B, n] or
    None; temperature [B] fp32 -> (chosen [B, n+1] fp32, top ids [B, n+1, top] int64, top values
    [B, n+1, top] fp32)
    """
    columns = emitted_columns(tokens, path)  # [B, n+1]
    V = logits.shape[-1]
    picked = logits.gather(1, columns[..., None].expand(-1, -1, V)).float()  # [B, n+1, V]
    t = temperature.to(torch.float32)
    scale = torch.where((t >= GREEDY_TEMPERATURE) & torch.isfinite(t), t, torch.ones_like(t))  # [B]
    logprobs = torch.log_softmax(picked / scale[:, None, None], dim=-1)  # [B, n+1, V]
    chosen = logprobs.gather(2, tokens.clamp(min=0)[..., None])[..., 0]  # [B, n+1]
    top = min(top, V)  # (a vocabulary smaller than the alternatives asked for gives every token)
    values, ids = logprobs.topk(top, dim=-1) if top > 0 else (logprobs[..., :0], columns[..., None][..., :0])
    return chosen, ids, values


def host_logprobs(tokens: List[List[int]], chosen: torch.Tensor, ids: torch.Tensor,
                  values: torch.Tensor) -> List[List[TokenLogprob]]:
    """Per row, the TokenLogprob of each of ``tokens[b]`` (the row's emitted tokens this step, in order);
    one device->host read."""
    chosen_h, ids_h, values_h = chosen.tolist(), ids.tolist(), values.tolist()
    return [[TokenLogprob(token, chosen_h[b][i], tuple(zip(ids_h[b][i], values_h[b][i])))
             for i, token in enumerate(row)] for b, row in enumerate(tokens)]


PROMPT_LOGPROB_CHUNK = 512  # prompt positions per log-softmax: bounds the fp32 [positions, V] buffer


@torch.no_grad()
def prompt_logprobs(model, prompt: List[int], top: int) -> List[TokenLogprob]:
    """``echo`` with ``logprobs``: each prompt token's log-probability under the target given the tokens
    before it, with the ``top`` most likely there (the first token has none: logprob None). The model's
    own distribution (temperature 1, no processors: they shape what is generated, not the prompt), from
    one forward of the HF model over the prompt, outside any runner's cache."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)  # [1, P]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [P-1, V]: position i predicts token i+1
    entries = [TokenLogprob(int(prompt[0]), None)]
    for begin in range(0, logits.shape[0], PROMPT_LOGPROB_CHUNK):
        part = torch.log_softmax(logits[begin: begin + PROMPT_LOGPROB_CHUNK].float(), dim=-1)  # [c, V]
        following = ids[0, begin + 1: begin + 1 + part.shape[0]]  # [c]
        chosen = part.gather(1, following[:, None])[:, 0].tolist()
        values, top_ids = part.topk(top, dim=-1) if top > 0 else (part[:, :0], following[:, None][:, :0])
        for token, logprob, ids_row, values_row in zip(following.tolist(), chosen, top_ids.tolist(), values.tolist()):
            entries.append(TokenLogprob(token, logprob, tuple(zip(ids_row, values_row))))
    return entries
