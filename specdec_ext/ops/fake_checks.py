"""The fake (meta) kernels' one check: the C++ ops' device check, which a call with one operand on the meta device
reaches in place of the ops (torch dispatches a mixed-device call to the fake kernel). Every op's fake kernel
calls it (ops/sampling.py, tree.py, processing.py, lean_forward.py, kv_cache.py, token_buffer.py)."""
from __future__ import annotations

from typing import Sequence

import torch


def check_operand_devices(op: str, operands: Sequence, reference: int = 0) -> None:
    """The device check of the C++ ops, for the fake kernels (which torch.compile and meta tensors run):
    every tensor among ``operands`` (an op's arguments in schema order) on the device of operand
    ``reference``; the error names both as the schema does."""
    names = [argument.name for argument in getattr(torch.ops.specdec_ext, op).default._schema.arguments]
    device = operands[reference].device
    for name, operand in zip(names, operands):
        tensors = ([(f"{name}[{i}]", t) for i, t in enumerate(operand)] if isinstance(operand, (list, tuple))
                   else [(name, operand)])  # (a Tensor[] argument: each of its tensors)
        for label, tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device != device:
                raise RuntimeError(f"{op}: {label} must be on the same device as {names[reference]} ({device}), "
                                   f"got {tensor.device}")
