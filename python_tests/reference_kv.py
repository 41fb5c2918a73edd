"""NumPy references of the paged KV cache ops (csrc/kv_cache.h), written the obvious way."""
import numpy as np


def kv_write(key, value, slot_mapping, kv_cache):
    """Return a copy of kv_cache [2, NP, PS, H, D] with key/value [B, T, H, D] scattered by slot."""
    out = np.array(kv_cache, copy=True)
    num_pages, page_size = out.shape[1], out.shape[2]
    for b in range(slot_mapping.shape[0]):
        for t in range(slot_mapping.shape[1]):
            s = int(slot_mapping[b, t])
            if s < 0 or s >= num_pages * page_size:
                continue
            out[0, s // page_size, s % page_size] = key[b, t]
            out[1, s // page_size, s % page_size] = value[b, t]
    return out


def kv_compact(kv_cache, block_tables, src_positions, dst_start):
    """Return a copy of kv_cache [X, NP, PS, H, D] after the per-row sequential copies."""
    out = np.array(kv_cache, copy=True)
    num_pages, page_size = out.shape[1], out.shape[2]
    max_pages = block_tables.shape[1]

    def slot(b, p):
        if p < 0 or p >= max_pages * page_size:
            return None
        page = int(block_tables[b, p // page_size])
        if page < 0 or page >= num_pages:
            return None
        return page, p % page_size

    for b in range(block_tables.shape[0]):
        for j in range(src_positions.shape[1]):
            p = int(src_positions[b, j])
            if p < 0:
                break
            src, dst = slot(b, p), slot(b, int(dst_start[b]) + j)
            if src is None or dst is None:
                continue
            out[:, dst[0], dst[1]] = out[:, src[0], src[1]]
    return out
