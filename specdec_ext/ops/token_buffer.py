"""The token buffer op: commit_tokens (the op itself and its fake kernel). The contract is csrc/token_buffer.h.

``commit_tokens(tokens, num_accepted, active, token_buffer, seq_lens, num_kept, next_input) -> None``

A step's emitted tokens into each row's token buffer, in place, in one call, without host
synchronisation (capturable). Row b keeps ``kept = min(num_accepted[b] + 1, w)`` tokens when
``active[b]`` and ``num_accepted[b] >= 0``, else none: ``token_buffer[b, seq_lens[b] + j] = tokens[b, j]``
for j < kept (positions past the buffer are skipped), ``seq_lens[b] += kept``, ``num_kept[b] = kept``,
and ``next_input[b, 0]`` becomes the row's last token ``token_buffer[b, seq_lens[b] - 1]`` (every row).

    tokens        the verdict's tokens, int64, unit stride along w (a column slice is fine).  Shape: [B, w]
    num_accepted  accepted drafts per row, int32; a negative RowStatus keeps nothing.         Shape: [B]
    active        bool; a frozen row keeps nothing.                                          Shape: [B]
    token_buffer  int64, contiguous, written in place.                                       Shape: [B, S]
    seq_lens      int64, contiguous, advanced in place.                                      Shape: [B]
    num_kept      int64, contiguous, written.                                                Shape: [B]
    next_input    int64, any strides; column 0 written (the next pending tokens).           Shape: [B, T]

``commit_tokens`` is the registered op (``torch.ops.specdec_ext.commit_tokens.default``), not a Python
wrapper: it has no defaults to fill and no statuses to raise (its checks raise from C++), and every
decode step calls it between two model passes, where a Python frame more is host time the step pays.
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.specdec_ext)
from .fake_checks import check_operand_devices

commit_tokens = torch.ops.specdec_ext.commit_tokens.default


# Fake kernel: the op writes its outputs in place and returns nothing; it repeats the device check (a mixed-device
# call reaches it when one argument is a meta tensor: fake_checks.check_operand_devices).
@torch.library.register_fake("specdec_ext::commit_tokens")
def _commit_tokens_fake(*operands):  # (tokens, num_accepted, active, token_buffer, seq_lens, num_kept, next_input)
    check_operand_devices("commit_tokens", operands)
