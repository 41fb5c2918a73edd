"""Medusa-style draft heads on the target: m small heads that read the target's last hidden state.

Head i (1-based) sees the hidden state h_t that the target's LM head turns into the logits of token
t+1 and predicts token t+1+i: ``logits_i = lm_head(h_t + silu(W_i h_t + b_i))``. The residual block is
the only trained part (hidden_size^2 + hidden_size parameters per head); the LM head is the target's
own, shared and frozen, so heads cost no second vocabulary matrix. ``W_i`` starts at zero, where head
i predicts what the target predicts for token t+1 (the best guess before training).

Files: a directory with ``config.json`` (``num_heads``, ``hidden_size``, ``vocab_size``,
``target_name_or_path``) and ``heads.safetensors``. The bundled target's heads ship in
``specdec_ext/default_pair/heads`` (trained by ``tools/train_heads.py``).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

HEADS_CONFIG = "config.json"
HEADS_WEIGHTS = "heads.safetensors"

__all__ = ["MedusaHeads", "load_heads", "lm_head_of", "HeadsMismatchError"]


class HeadsMismatchError(ValueError):
    """The heads were not made for this target (hidden size or vocabulary differ)."""


def lm_head_of(model) -> nn.Module:
    """The target's output projection (hidden state -> logits)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None): "
                         "heads need the target's LM head")
    return head


class ResidualBlock(nn.Module):
    """h + silu(W h + b), W initialised to zero (the block starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """m residual heads over a target's last hidden state (see the module docstring)."""

    def __init__(self, hidden_size: int, num_heads: int, vocab_size: int, target_name_or_path: str = ""):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaHeads: {name} must be an int >= 1, got {value!r}")
        self.hidden_size, self.num_heads, self.vocab_size = hidden_size, num_heads, vocab_size
        self.target_name_or_path = target_name_or_path
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))

    def hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Head inputs of the LM head: [..., H] -> [..., m, H]."""
        return torch.stack([block(last_hidden) for block in self.blocks], dim=-2)

    def forward(self, last_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of tokens t+2 .. t+m+1.

        Parameters
        ----------
        last_hidden : torch.Tensor
            The target's hidden state that its LM head maps to the logits of token t+1.
            Shape: [..., H]
        lm_head : nn.Module
            The target's output projection (``lm_head_of(target)``).

        Returns
        -------
        torch.Tensor
            Head i's logits (row i-1 predicts token t+1+i).
            Shape: [..., m, V]
        """
        return lm_head(self.hidden(last_hidden.to(self.blocks[0].linear.weight.dtype)))

    def check_target(self, target) -> None:
        """Raise HeadsMismatchError unless these heads fit ``target`` (hidden size and vocabulary)."""
        head = lm_head_of(target)
        weight = getattr(head, "weight", None)
        if weight is None or weight.dim() != 2:
            raise HeadsMismatchError("the target's LM head has no 2-D weight; heads need a linear LM head")
        vocab, hidden = weight.shape
        if hidden != self.hidden_size:
            raise HeadsMismatchError(f"the heads read hidden states of size {self.hidden_size}, the target's LM "
                                     f"head takes {hidden}: these heads were trained for another target")
        if vocab != self.vocab_size:
            raise HeadsMismatchError(f"the heads were trained for a vocabulary of {self.vocab_size} tokens, the "
                                     f"target's LM head scores {vocab}: these heads were trained for another target")

    # ------------------------------------------------------------------ files
    def save(self, directory: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` and ``heads.safetensors`` (weights cast to ``dtype``)."""
        from safetensors.torch import save_file
        os.makedirs(directory, exist_ok=True)
        config = dict(num_heads=self.num_heads, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                      target_name_or_path=self.target_name_or_path)
        with open(os.path.join(directory, HEADS_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, os.path.join(directory, HEADS_WEIGHTS))


def load_heads(directory: str, dtype: Optional[torch.dtype] = None, device=None) -> MedusaHeads:
    """Load heads saved by :meth:`MedusaHeads.save` (eval mode, no gradients)."""
    from safetensors.torch import load_file
    config_path, weights_path = os.path.join(directory, HEADS_CONFIG), os.path.join(directory, HEADS_WEIGHTS)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"load_heads: {path} is missing (a heads directory holds {HEADS_CONFIG} "
                                    f"and {HEADS_WEIGHTS}; tools/train_heads.py writes them)")
    with open(config_path) as f:
        config = json.load(f)
    heads = MedusaHeads(int(config["hidden_size"]), int(config["num_heads"]), int(config["vocab_size"]),
                        str(config.get("target_name_or_path", "")))
    state = load_file(weights_path)
    heads.load_state_dict(state)
    heads.to(dtype=dtype or next(iter(state.values())).dtype, device=device)
    heads.eval().requires_grad_(False)
    return heads
