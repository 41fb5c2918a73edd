"""Argument helpers shared by the op wrappers."""
from typing import Union

import torch

RowParam = Union[None, float, int, torch.Tensor]


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


def sampling_row_tensors(batch: int, device: torch.device, temperature: RowParam, top_k: RowParam,
                         top_p: RowParam, seed: RowParam, offset: RowParam):
    """The per-row sampling arguments every verifier op takes, as [B] tensors (or None):
    (temperature fp32, top_k int32, top_p fp32, seed int64, offset int64)."""
    return (row_tensor(temperature, "temperature", batch, torch.float32, device),
            row_tensor(top_k, "top_k", batch, torch.int32, device),
            row_tensor(top_p, "top_p", batch, torch.float32, device),
            row_tensor(seed, "seed", batch, torch.int64, device),
            row_tensor(offset, "offset", batch, torch.int64, device))
