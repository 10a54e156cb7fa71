"""The kvfs block file format (``kvfs-block-v1``): a safetensors file with a 4 KiB-aligned payload.

A block file is a valid safetensors file::

    [8 bytes: little-endian u64 N][N bytes: JSON header, padded with spaces][payload]

``8 + N`` is a multiple of 4096, so the tensor payload starts on a 4 KiB boundary (O_DIRECT,
GPUDirect Storage). The payload is one tensor ``"kv"`` of shape
``[num_layers, 2, block_tokens, num_kv_heads, head_dim]`` (layer outermost, so one layer is
one contiguous byte range). ``__metadata__`` (str -> str) holds:

- ``format``: ``"kvfs-block-v1"``
- ``kvfs.namespace``: namespace directory name
- ``kvfs.hash``: this block's prefix hash (lowercase hex)
- ``kvfs.parent``: the parent block's hash (``""`` for the first block of a prompt)
- ``kvfs.tokens``: tokens in the prefix up to and including this block (decimal)
- ``kvfs.block_tokens``: tokens per block (decimal)
- ``kvfs.hash_algo``: hash algorithm name
- ``kvfs.layout``: canonical JSON of the KV layout
- ``kvfs.checksums``: comma-separated xxh3_64 hex of each layer's payload slice
- ``kvfs.created``: creation time, Unix seconds
- ``kvfs.token_ids``: optional, comma-separated token ids of this block (collision checks)

This module is pure Python (json, struct, xxhash): the daemon imports
:func:`parse_block_header` to recognise blocks without torch.
"""
from __future__ import annotations

import json
import logging
import re
import struct

from kvfs.protocol import ALIGN

log = logging.getLogger(__name__)

FORMAT = "kvfs-block-v1"
#: Bytes a reader should fetch to parse a kvfs block header: writers keep the whole
#: JSON header (before padding) inside the first HEADER_READ bytes.
HEADER_READ = 4096
#: safetensors' own limit on the header length.
MAX_HEADER = 100 * 1024 * 1024

_HEX = re.compile(r"^[0-9a-f]{8,128}$")
_REQUIRED = ("kvfs.namespace", "kvfs.hash", "kvfs.parent", "kvfs.tokens", "kvfs.block_tokens")

# safetensors dtype codes and their sizes in bytes
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class BlockFormatError(ValueError):
    """A file is not a well-formed kvfs block (or not the block that was expected)."""


def header_length(first_bytes: bytes) -> int | None:
    """``8 + N`` for a safetensors file (the payload offset), or None if not plausible."""
    if len(first_bytes) < 8:
        return None
    (n,) = struct.unpack_from("<Q", first_bytes, 0)
    if n < 2 or n > MAX_HEADER:
        return None
    return 8 + n


def _decode_json(first_bytes: bytes) -> dict | None:
    total = header_length(first_bytes)
    if total is None:
        return None
    raw = bytes(first_bytes[8:total])
    if not raw.lstrip().startswith(b"{"):
        return None
    try:
        # a truncated buffer still parses when only padding spaces were cut off
        header = json.loads(raw)        # trailing padding spaces are JSON whitespace
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return header if isinstance(header, dict) else None


def _validate_meta(meta: dict) -> str | None:
    """Return a reason string if ``meta`` is not valid kvfs-block-v1 metadata."""
    for key in _REQUIRED:
        if not isinstance(meta.get(key), str):
            return f"missing {key}"
    if not _HEX.match(meta["kvfs.hash"]):
        return "kvfs.hash is not lowercase hex"
    parent = meta["kvfs.parent"]
    if parent and not _HEX.match(parent):
        return "kvfs.parent is not lowercase hex"
    if not (meta["kvfs.tokens"].isdigit() and meta["kvfs.block_tokens"].isdigit()):
        return "kvfs.tokens/kvfs.block_tokens are not decimal"
    tokens, block = int(meta["kvfs.tokens"]), int(meta["kvfs.block_tokens"])
    if block <= 0 or tokens <= 0 or tokens % block:
        return "kvfs.tokens is not a positive multiple of kvfs.block_tokens"
    if (tokens == block) != (parent == ""):
        return "kvfs.parent must be empty exactly for the first block"
    return None


def parse_block_header(first_bytes: bytes) -> dict | None:
    """Parse a kvfs block header from the first bytes of a file (pass >= HEADER_READ bytes).

    Returns None when the bytes are not a kvfs-block-v1 file (not safetensors, another
    format, truncated JSON, or invalid kvfs metadata). Otherwise a dict::

        {"namespace": str, "hash": str, "parent": str, "tokens": int, "block_tokens": int,
         "data_offset": int, "metadata": {...str: str}, "tensors": {name: {dtype, shape,
         data_offsets}}}

    ``parent`` is ``""`` for a chain's first block. Pure Python; never raises on bad input.
    """
    header = _decode_json(first_bytes)
    if header is None:
        return None
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    reason = _validate_meta(meta)
    if reason is not None:
        log.debug("not a kvfs block: %s", reason)
        return None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return {
        "namespace": meta["kvfs.namespace"],
        "hash": meta["kvfs.hash"],
        "parent": meta["kvfs.parent"],
        "tokens": int(meta["kvfs.tokens"]),
        "block_tokens": int(meta["kvfs.block_tokens"]),
        "data_offset": header_length(first_bytes),
        "metadata": dict(meta),
        "tensors": tensors,
    }


def build_header(metadata: dict[str, str], tensors: dict[str, tuple[str, list[int], int]],
                 *, max_bytes: int | None = None) -> bytes:
    """Encode a safetensors header whose payload starts at a multiple of ALIGN.

    ``tensors`` maps name -> (safetensors dtype, shape, nbytes); tensors are laid out in
    the given order, back to back. Returns the ``8 + N`` header bytes. Raises
    BlockFormatError if the unpadded JSON would exceed ``max_bytes - 8``.
    """
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise BlockFormatError("metadata must map str to str")
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        if dtype not in DTYPE_SIZES:
            raise BlockFormatError(f"unknown safetensors dtype {dtype!r}")
        count = 1
        for d in shape:
            count *= d
        if count * DTYPE_SIZES[dtype] != nbytes:
            raise BlockFormatError(f"tensor {name!r}: shape {shape} x {dtype} != {nbytes} bytes")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode("utf-8")
    if max_bytes is not None and 8 + len(raw) > max_bytes:
        raise BlockFormatError(f"header of {len(raw)} bytes does not fit in {max_bytes}")
    total = -(-(8 + len(raw)) // ALIGN) * ALIGN
    raw += b" " * (total - 8 - len(raw))
    return struct.pack("<Q", len(raw)) + raw
