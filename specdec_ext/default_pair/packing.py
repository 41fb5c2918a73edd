"""The bundled target's weights, packed losslessly: a bf16 safetensors file with its tensor bytes split into
the high and the low byte of every value, each plane deflated (zlib). The high bytes (sign, exponent, top
mantissa bit) of trained weights repeat a few values, so the file shrinks from 50.5 to 35.2 MiB; the low
bytes are close to random. The tree a GPU machine receives is capped (60 MiB), which is why it is packed.

    unpacked(packed, out)   ``out`` (the original safetensors file, byte for byte, SHA-256 checked), unpacked
                            once (atomically: concurrent first loads are safe), then reused
    packed_digest(packed)   the original's SHA-256, from the header (the cache folder's key)
    pack(path, packed)      the reverse (after retraining: ``python -m specdec_ext.default_pair.packing FILE``)

Layout: MAGIC, the SHA-256 of the original (32 bytes), then three length-prefixed (u64 little endian)
parts: the safetensors header (its 8-byte length and JSON, verbatim), the high-byte plane, the low-byte
plane (each zlib-deflated).
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys
import tempfile
import zlib

import numpy as np

MAGIC = b"SPECDEC-BF16PLANES-1\n"
PACKED_SUFFIX = ".planes"  # model.safetensors -> model.safetensors.planes
ZLIB_LEVEL = 9


def pack(path: str, packed: str) -> None:
    """Write ``packed`` from the safetensors file ``path`` (every tensor 2 bytes per value)."""
    with open(path, "rb") as f:
        data = f.read()
    header_len = 8 + struct.unpack("<Q", data[:8])[0]
    body = np.frombuffer(data, dtype=np.uint8, offset=header_len)
    if body.size % 2:
        raise ValueError(f"{path}: the tensor bytes are not 2-byte values (bf16 / fp16 expected)")
    parts = [data[:header_len], zlib.compress(body[1::2].tobytes(), ZLIB_LEVEL),
             zlib.compress(body[0::2].tobytes(), ZLIB_LEVEL)]
    with open(packed, "wb") as f:
        f.write(MAGIC + hashlib.sha256(data).digest())
        for part in parts:
            f.write(struct.pack("<Q", len(part)) + part)


def packed_digest(packed: str) -> str:
    """The SHA-256 (hex) of the original file, read from ``packed``'s header (no unpacking)."""
    with open(packed, "rb") as f:
        head = f.read(len(MAGIC) + 32)
    if not head.startswith(MAGIC) or len(head) < len(MAGIC) + 32:
        raise ValueError(f"{packed} is not a packed weights file (no {MAGIC!r} header)")
    return head[len(MAGIC):].hex()


def unpack_bytes(packed: str) -> bytes:
    """The original file's bytes (ValueError when ``packed`` is not a packed file or fails its hash)."""
    with open(packed, "rb") as f:
        blob = f.read()
    if not blob.startswith(MAGIC):
        raise ValueError(f"{packed} is not a packed weights file (no {MAGIC!r} header)")
    digest, offset, parts = blob[len(MAGIC): len(MAGIC) + 32], len(MAGIC) + 32, []
    for _ in range(3):
        (size,) = struct.unpack_from("<Q", blob, offset)
        parts.append(blob[offset + 8: offset + 8 + size])
        offset += 8 + size
    try:
        header, high, low = parts[0], zlib.decompress(parts[1]), zlib.decompress(parts[2])
    except zlib.error as error:
        raise ValueError(f"{packed} is corrupt ({error}): reinstall the package") from None
    body = np.empty(len(high) + len(low), dtype=np.uint8)
    body[1::2] = np.frombuffer(high, dtype=np.uint8)
    body[0::2] = np.frombuffer(low, dtype=np.uint8)
    data = header + body.tobytes()
    if hashlib.sha256(data).digest() != digest:
        raise ValueError(f"{packed} is corrupt: the unpacked weights fail their SHA-256 (reinstall the package)")
    return data


def unpacked(packed: str, out: str) -> str:
    """``out``, unpacked from ``packed`` unless it is there already and not older; returns ``out``. Writes a
    temporary file beside it and renames it into place, so concurrent first loads never see half a file."""
    if os.path.isfile(out) and os.path.getmtime(out) >= os.path.getmtime(packed):
        return out
    write_replacing(out, unpack_bytes(packed))
    return out


def write_replacing(out: str, data: bytes) -> None:
    """``data`` into the file ``out`` through a temporary file beside it renamed into place: a concurrent
    reader (another process's first load) sees the old file or the new one, never half of one."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".writing-")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.chmod(temporary, 0o644)  # (mkstemp makes it 0600: readable by its owner only)
        os.replace(temporary, out)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


if __name__ == "__main__":  # python -m specdec_ext.default_pair.packing path/to/model.safetensors
    for source in sys.argv[1:]:
        pack(source, source + PACKED_SUFFIX)
        print(f"{source} ({os.path.getsize(source) / 2 ** 20:.2f} MiB) -> {source + PACKED_SUFFIX} "
              f"({os.path.getsize(source + PACKED_SUFFIX) / 2 ** 20:.2f} MiB)")
