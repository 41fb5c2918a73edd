"""Argument helpers shared by the op wrappers: per-row parameters, the verifiers' sampling keywords
(one definition for chain_verify and tree_verify: their types, defaults, seeds and documentation)."""
from __future__ import annotations

from typing import Optional, Tuple, TypedDict, Union

import torch

RowParam = Union[None, float, int, torch.Tensor]

# Temperatures below this are greedy (one-hot argmax, lowest index on ties) in every verifier, on
# every backend: kGreedyTemperature of csrc/common/sampling_math.h. Python-side filters mirror it.
GREEDY_TEMPERATURE = 1e-5


class SamplingKeywords(TypedDict, total=False):
    """The sampling keywords every verifier op takes (see ``SAMPLING_PARAMETERS_DOC``)."""
    temperature: RowParam
    top_k: RowParam
    top_p: RowParam
    seed: RowParam
    offset: RowParam
    uniforms: Optional[torch.Tensor]


def row_tensor(value: RowParam, name: str, batch: int, dtype: torch.dtype, device: torch.device):
    """A [B] tensor from a scalar (broadcast to every row), a tensor, or None (op default)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def check_same_device(op: str, reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """The device check of the C++ ops, for the fake kernels (which torch.compile and meta tensors run)."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != reference.device:
            raise RuntimeError(f"{op}: {name} must be on the same device as {reference_name} "
                               f"({reference.device}), got {tensor.device}")


def default_seeds(batch: int, device: torch.device) -> Optional[torch.Tensor]:
    """One Philox seed per row from torch's default CPU generator (``torch.manual_seed`` reproduces
    them), on ``device``; None during a CUDA graph capture, where a host-to-device copy cannot run:
    the op then reports every sampling row (greedy rows need no draws)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    info = torch.iinfo(torch.int64)
    return torch.randint(info.min, info.max, (batch,), dtype=torch.int64).to(device)


def sampling_op_args(op: str, batch: int, device: torch.device, sampling: SamplingKeywords) -> Tuple:
    """The verifier op's (temperature, top_k, top_p, seed, offset, uniforms) from the wrapper's
    keywords: numbers broadcast to [B] tensors of the op's dtypes, seeds drawn when neither seed nor
    uniforms is given."""
    unknown = set(sampling) - set(SamplingKeywords.__annotations__)
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    seed, uniforms = sampling.get("seed"), sampling.get("uniforms")
    if seed is None and uniforms is None:
        seed = default_seeds(batch, device)
    return (row_tensor(sampling.get("temperature"), "temperature", batch, torch.float32, device),
            row_tensor(sampling.get("top_k"), "top_k", batch, torch.int32, device),
            row_tensor(sampling.get("top_p"), "top_p", batch, torch.float32, device),
            row_tensor(seed, "seed", batch, torch.int64, device),
            row_tensor(sampling.get("offset"), "offset", batch, torch.int64, device),
            uniforms)


def with_sampling_parameters_doc(n: str, draws: str):
    """Decorator: the ``{sampling_parameters}`` line of a verifier's docstring becomes the numpydoc
    entries of the sampling keywords, for n draft slots; ``draws`` says what the uniforms decide."""
    def decorate(function):
        function.__doc__ = function.__doc__.replace("{sampling_parameters}", _sampling_parameters(n, draws))
        return function
    return decorate


def _sampling_parameters(n: str, draws: str) -> str:
    return f"""temperature : float or torch.Tensor, optional
        Sampling temperature per row, fp32; default 1. Below ``GREEDY_TEMPERATURE`` (1e-5, 0
        included) the row is greedy: p is one-hot at argmax (the lowest index on ties). ``inf`` is
        uniform over the finite logits (top-k / top-p then keep the largest logits).
        Shape: [B]
    top_k : int or torch.Tensor, optional
        Keep the k most likely tokens (ties at the k-th kept), int32; 0 is off (default).
        Shape: [B]
    top_p : float or torch.Tensor, optional
        Keep the smallest most-likely set with mass >= top_p (after top-k), fp32 in (0, 1]; 1 is off.
        Shape: [B]
    seed, offset : int or torch.Tensor, optional
        Philox key and counter per row, int64; draw c of a row is philox(seed, offset, c), so a row's
        result does not depend on the other rows. With neither ``seed`` nor ``uniforms`` one seed per
        row is drawn from torch's default CPU generator (``torch.manual_seed`` reproduces the call).
        Inside a CUDA graph capture nothing can be drawn: pass ``seed`` (greedy rows need none;
        sampling rows without draws fail with an error naming seed and uniforms).
        Shape: [B]
    uniforms : torch.Tensor, optional
        Explicit draws in [0, 1), fp32, used instead of ``seed``: {draws}
        Shape: [B, {n}+1]"""
