"""Header sniffing: is a buffer being sealed a kvfs KV block, and what does its header say.

The one place the store reads the block format (kvfs.blockformat) (by content, not by name: runtimes
write blocks under temporary names and rename them).
"""
from __future__ import annotations

import logging

from kvfs.blockformat import parse_block_header
from kvfs.store.staging import Staging

log = logging.getLogger(__name__)

_HEADER_PEEK = 1 << 20      # the largest block header we parse
HEAD = 9                    # bytes that tell a block header from anything else


async def peek_block_header(staging: Staging, head: bytes | None = None) -> dict | None:
    """The kvfs block header of the buffer, if it is one (by content, not by name:
    runtimes write blocks under temporary names and rename them). ``head``: the buffer's
    first HEAD bytes when the caller has them (a commit's copy): most buffers are told
    apart from them without reading the buffer again."""
    if staging.size < 16:
        return None
    first = head[:HEAD] if head is not None and len(head) >= HEAD else await staging.read(0, HEAD)
    n = int.from_bytes(first[:8], "little") + 8
    if n > min(staging.size, _HEADER_PEEK) or first[8:9] != b"{":
        return None
    data = await staging.read(0, n)
    try:
        return parse_block_header(data)
    except Exception:       # noqa: BLE001 -- e.g. RecursionError: JSON nested too deep is no block
        return None
