"""Hidden-state taps: the target's hidden states at chosen layers, kept per committed token (EAGLE-3's
features, specdec_ext/eagle/).

A runner built with ``hidden_taps=(l_1, ..., l_n)`` keeps, for every token it has processed, the
*input* of decoder layer l_i (HF's ``output_hidden_states=True`` entry ``hidden_states[l_i]``; 0 is
the embedding), concatenated in the order given: [n * H] per token, fp32. They live beside the KV
cache and follow it: a forward writes its tokens' states TENTATIVELY at their storage slots, ``commit``
keeps them with the tokens, ``commit_tree`` moves the accepted path's next to the prefix, ``truncate``
and a later forward drop the rest (rollback is the lengths, as for the cache). The drafter reads the
committed ones with ``runner.tapped_states(positions)``.

Layer ids follow vLLM's ``eagle_aux_hidden_state_layer_ids`` and SafeAILab/EAGLE's target models: the
input of layer i. The default is theirs, (2, L // 2, L - 3) (vLLM's ``get_eagle3_aux_hidden_state_layers``,
EAGLE's ``modeling_llama_kv``); SpecForge names the same states by the layer they are the output of
(1, L // 2 - 1, L - 4). The states are concatenated in the order of the ids (vLLM and EAGLE collect them
in layer order, which is the same for the default's ascending ids; they keep a repeated id once, where
this keeps it as often as it is named, so a shallow target's (2, 3, 3) still gives 3 states).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["default_tap_layers", "check_tap_layers", "TapBuffer", "LayerInputHooks", "decoder_layers_of"]

MIN_DEFAULT_LAYERS = 5  # (2, L // 2, L - 3) is non-decreasing and in range from 5 layers on


def default_tap_layers(num_layers: int) -> Tuple[int, int, int]:
    """EAGLE-3's default layers of a target of ``num_layers`` decoder layers: (2, L // 2, L - 3)."""
    if num_layers < MIN_DEFAULT_LAYERS:
        raise ValueError(f"EAGLE-3's default hidden-state layers (2, L // 2, L - 3) need a target of at least "
                         f"{MIN_DEFAULT_LAYERS} layers, this one has {num_layers}: pass layer ids explicitly")
    return 2, num_layers // 2, num_layers - 3


def check_tap_layers(layers: Optional[Sequence[int]], num_layers: int) -> Optional[Tuple[int, ...]]:
    """``layers`` as a tuple, each an int in [0, num_layers) (the input of that layer); None stays None."""
    if layers is None:
        return None
    ids = tuple(layers)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in ids):
        raise ValueError(f"hidden_taps must be layer ids in [0, {num_layers}) (the input of that decoder layer; "
                         f"the target has {num_layers} layers), got {layers!r}")
    return ids


class TapBuffer:
    """The tapped states of every row and cache slot: ``states`` [rows, capacity, n * H] fp32."""

    def __init__(self, layers: Tuple[int, ...], hidden: int, rows: int, capacity: int, device):
        self.layers, self.hidden = layers, int(hidden)
        self.width = len(layers) * self.hidden
        self.states = torch.zeros((rows, capacity, self.width), dtype=torch.float32, device=device)

    def grow(self, capacity: int) -> None:
        """At least ``capacity`` slots per row, the states kept."""
        old = self.states
        if capacity <= old.shape[1]:
            return
        self.states = torch.zeros((old.shape[0], capacity, self.width), dtype=torch.float32, device=old.device)
        self.states[:, : old.shape[1]] = old

    def write(self, rows: torch.Tensor, slots: torch.Tensor, states: Sequence[torch.Tensor]) -> None:
        """Token m's states (one [M, H] per tapped layer, in ``layers`` order) at (rows[m], slots[m])."""
        self.states[rows, slots] = torch.cat([s.reshape(-1, self.hidden).float() for s in states], dim=-1)

    def write_valid(self, rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                    states: Sequence[torch.Tensor]) -> None:
        """``write`` of the tokens where ``valid`` [B, T] (rows [B], slots [B, T]); the others go to the
        last slot, a scratch one (no host read)."""
        B, T = slots.shape
        scratch = self.states.shape[1] - 1
        where = torch.where(valid, slots, torch.full_like(slots, scratch))
        self.write(rows[:, None].expand(B, T).reshape(-1), where.reshape(-1), states)

    def move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """commit_tree: row ``row``'s slots ``src`` -> ``dst`` (the gather copies before the write)."""
        self.states[row, dst] = self.states[row, src]

    def gather(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The states of cache rows ``rows`` [B] at ``positions`` [B, W] (clamped into the buffer) -> [B, W, n*H]."""
        index = positions.to(self.states.device).clamp(0, self.states.shape[1] - 1)
        return self.states[rows.to(self.states.device)[:, None], index]


def decoder_layers_of(model) -> Sequence[torch.nn.Module]:
    """The HF model's decoder layers, in order (``model.model.layers`` and the usual other homes)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for owner in (decoder, getattr(model, "model", None), getattr(model, "transformer", None)):
        for name in ("layers", "h", "blocks"):
            layers = getattr(owner, name, None) if owner is not None else None
            if isinstance(layers, torch.nn.ModuleList) and len(layers):
                return list(layers)
    raise ValueError(f"{type(model).__name__}: no decoder layers found (model.layers / h / blocks) to tap")


class LayerInputHooks:
    """Forward pre-hooks on a HF model's decoder layers that keep the inputs of ``layers`` during a runner's
    own forwards (``capturing``). The state is per thread: the hooks sit on the model, which other callers
    (another generation's runner, another thread's) run at the same time, and their forwards must neither be
    captured nor overwrite this one's."""

    def __init__(self, model, layers: Tuple[int, ...]):
        modules = decoder_layers_of(model)
        self._local = threading.local()  # .into: the dict this thread's forward fills, or absent
        self.handles = [modules[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i in sorted(set(layers))]

    @contextlib.contextmanager
    def capturing(self, into: Dict[int, torch.Tensor]):
        """Within it, this thread's forwards of the model put the input of tapped layer i in ``into[i]``
        [B, T, H]."""
        self._local.into = into
        try:
            yield into
        finally:
            self._local.into = None

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            into = getattr(self._local, "into", None)
            if into is not None:
                into[index] = args[0] if args else kwargs["hidden_states"]
        hook.specdec_internal = True  # (runners/lean.py: not a user's hook, which the lean forward cannot honour)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
