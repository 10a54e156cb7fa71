"""Header sniffing: is a buffer being sealed a kvfs KV block, and what does its header say.

The one place the store reads the block format (kvfs.blockformat) (by content, not by name: runtimes
write blocks under temporary names and rename them).
"""
from __future__ import annotations

import logging

from kvfs.blockformat import parse_block_header
from kvfs.store.ram import Staging

log = logging.getLogger(__name__)

_HEADER_PEEK = 1 << 20      # the largest block header we parse


def kv_header(data: bytes) -> dict | None:
    try:
        return parse_block_header(data)
    except Exception:
        return None


async def peek_block_header(staging: Staging) -> dict | None:
    """The kvfs block header of the buffer, if it is one (by content, not by name:
    runtimes write blocks under temporary names and rename them)."""
    if staging.size < 16:
        return None
    first = await staging.read(0, 8)
    n = int.from_bytes(first, "little") + 8
    if n > min(staging.size, _HEADER_PEEK) or not (await staging.read(8, 1)) == b"{":
        return None
    return kv_header(await staging.read(0, n))
