"""NumPy reference of commit_tokens (csrc/token_buffer.h)."""
import numpy as np


def commit_tokens(tokens, num_accepted, active, token_buffer, seq_lens, next_input):
    """-> (token_buffer, seq_lens, num_kept, next_input) after the commit; the inputs are not changed."""
    buffer, lengths, following = token_buffer.copy(), seq_lens.copy(), next_input.copy()
    B, width = tokens.shape
    capacity = buffer.shape[1]
    kept = np.zeros(B, dtype=np.int64)
    for b in range(B):
        if active[b] and num_accepted[b] >= 0:
            kept[b] = min(int(num_accepted[b]) + 1, width)
        for j in range(kept[b]):
            if 0 <= lengths[b] + j < capacity:
                buffer[b, lengths[b] + j] = tokens[b, j]
        lengths[b] += kept[b]
        if 1 <= lengths[b] <= capacity:
            following[b, 0] = buffer[b, lengths[b] - 1]
    return buffer, lengths, kept, following
