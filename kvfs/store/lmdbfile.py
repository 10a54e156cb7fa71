"""A sanity check of an LMDB data file before it is mapped (kvfs.store.index)."""
from __future__ import annotations

import struct
from pathlib import Path

from kvfs.errors import IndexDamaged
from kvfs.store.records import FSCK_HINT


def check_lmdb_file(path: Path) -> None:
    """Refuse a ``data.mdb`` shorter than its newest meta page says (LMDB maps the file:
    touching a page past its end is a SIGBUS, not an error)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    with open(path, "rb") as f:
        head = f.read(16 + 200)
        if len(head) < 152:
            raise IndexDamaged(f"{path} is truncated ({size} bytes); {FSCK_HINT}")
        psize = struct.unpack_from("<I", head, 40)[0]       # mm_dbs[FREE].md_pad = page size
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise IndexDamaged(f"{path} has no valid LMDB meta page; {FSCK_HINT}")
        f.seek(psize)
        second = f.read(152)
    best = None
    for page in (head, second):
        if len(page) < 152 or struct.unpack_from("<I", page, 16)[0] != 0xBEEFC0DE:
            continue
        last_pg, txnid = struct.unpack_from("<QQ", page, 136)
        if best is None or txnid > best[1]:
            best = (last_pg, txnid)
    if best is None:
        raise IndexDamaged(f"{path} has no valid LMDB meta page; {FSCK_HINT}")
    need = (best[0] + 1) * psize
    if size < need:
        raise IndexDamaged(f"{path} is truncated ({size} of at least {need} bytes); {FSCK_HINT}")
