"""Encoding and strict checking of one block file (pure Python: bytes in, bytes out)."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

import xxhash

from kvfs.blockformat import FORMAT, HEADER_READ, BlockFormatError, build_header, parse_block_header
from kvfs.kv.layout import KVLayout
from kvfs.protocol import ALIGN

log = logging.getLogger(__name__)

TENSOR = "kv"


class ChecksumMismatch(BlockFormatError):
    """A block's bytes do not match its checksum: the block is corrupt, never used."""


def layer_checksums(payload, layer_bytes: int) -> list[str]:
    mv = memoryview(payload).cast("B")
    if len(mv) % layer_bytes:
        raise BlockFormatError(f"payload of {len(mv)} bytes is not whole layers of {layer_bytes}")
    return [f"{xxhash.xxh3_64_intdigest(mv[i:i + layer_bytes]):016x}" for i in range(0, len(mv), layer_bytes)]


def encode_header(layout: KVLayout, *, namespace: str, hash_hex: str, parent_hex: str, tokens: int,
                  hash_algo: str, payload, token_ids: list[int] | None = None,
                  created: float | None = None) -> bytes:
    """The safetensors header (padded to 4 KiB) for one block whose payload is ``payload``."""
    mv = memoryview(payload).cast("B")
    if len(mv) != layout.block_bytes:
        raise BlockFormatError(f"payload is {len(mv)} bytes, layout needs {layout.block_bytes}")
    meta = {
        "format": FORMAT,
        "kvfs.namespace": namespace,
        "kvfs.hash": hash_hex,
        "kvfs.parent": parent_hex,
        "kvfs.tokens": str(tokens),
        "kvfs.block_tokens": str(layout.block_tokens),
        "kvfs.hash_algo": hash_algo,
        "kvfs.layout": _expected(layout)[0],      # cached: asdict + dumps per block cost ~100 us
        "kvfs.checksums": ",".join(layer_checksums(mv, layout.layer_bytes)),
        "kvfs.created": f"{time.time() if created is None else created:.6f}",
    }
    tensors = {TENSOR: (layout.st_dtype, _expected(layout)[2]["shape"], len(mv))}
    if token_ids is not None:
        with_ids = dict(meta, **{"kvfs.token_ids": ",".join(map(str, token_ids))})
        try:
            return build_header(with_ids, tensors, max_bytes=HEADER_READ)
        except BlockFormatError:
            log.debug("block %s: token ids do not fit in the first %d bytes; left out", hash_hex, HEADER_READ)
    return build_header(meta, tensors, max_bytes=HEADER_READ)


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """What the loader needs from a checked block header."""

    hash: str
    parent: str
    tokens: int
    data_offset: int
    checksums: tuple[str, ...]
    metadata: dict


@functools.lru_cache(maxsize=64)
def _expected(layout: KVLayout) -> tuple[str, dict, dict]:
    """What a block of ``layout`` carries: its layout JSON and dict, and its tensor entry."""
    return (layout.to_json(), layout.to_dict(),
            {"dtype": layout.st_dtype, "shape": list(layout.block_shape()), "data_offsets": [0, layout.block_bytes]})


def check_header(first_bytes, *, path: str, expect_hash: str, layout: KVLayout,
                 expect_tokens: int | None = None) -> BlockInfo:
    """Parse and check a block header against what the caller expects; raise BlockFormatError."""
    parsed = parse_block_header(bytes(first_bytes[:HEADER_READ]))
    if parsed is None:
        raise BlockFormatError(f"{path}: not a {FORMAT} file (or header beyond {HEADER_READ} bytes)")
    meta = parsed["metadata"]
    if parsed["hash"] != expect_hash:
        raise BlockFormatError(f"{path}: holds block {parsed['hash']}, expected {expect_hash}")
    if expect_tokens is not None and parsed["tokens"] != expect_tokens:
        raise BlockFormatError(f"{path}: block ends at token {parsed['tokens']}, expected {expect_tokens}")
    want_json, want_dict, want = _expected(layout)
    if meta.get("kvfs.layout") != want_json:            # the common case: the same encoding
        try:
            file_layout = json.loads(meta.get("kvfs.layout", ""))
        except json.JSONDecodeError:
            raise BlockFormatError(f"{path}: unreadable kvfs.layout") from None
        if file_layout != want_dict:
            raise BlockFormatError(f"{path}: layout {file_layout} differs from {want_dict}")
    t = parsed["tensors"].get(TENSOR)
    if t != want:
        raise BlockFormatError(f"{path}: tensor {TENSOR!r} is {t}, expected {want}")
    sums = tuple(meta.get("kvfs.checksums", "").split(","))
    if len(sums) != layout.num_layers:
        raise BlockFormatError(f"{path}: {len(sums)} layer checksums for {layout.num_layers} layers")
    if parsed["data_offset"] % ALIGN:
        raise BlockFormatError(f"{path}: payload offset {parsed['data_offset']} is not 4 KiB aligned")
    return BlockInfo(parsed["hash"], parsed["parent"], parsed["tokens"], parsed["data_offset"], sums, meta)


def verify_layers(info: BlockInfo, payload, layout: KVLayout, path: str, layers: range | None = None) -> None:
    """Check layer slices of ``payload`` (whole payload, or ``layers`` packed back to back)."""
    mv = memoryview(payload).cast("B")
    layers = range(layout.num_layers) if layers is None else layers
    lb = layout.layer_bytes
    if len(mv) < len(layers) * lb:
        raise BlockFormatError(f"{path}: short payload ({len(mv)} bytes for {len(layers)} layers)")
    for j, layer in enumerate(layers):
        got = f"{xxhash.xxh3_64_intdigest(mv[j * lb:(j + 1) * lb]):016x}"
        if got != info.checksums[layer]:
            raise ChecksumMismatch(f"{path}: layer {layer} checksum {got} != {info.checksums[layer]}")
