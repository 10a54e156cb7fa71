"""What a descriptor reads when the file changed size under it (docs/design.md, "Versions
and sizes").

A read-only descriptor reads the sealed version it opened (or the buffer it joined), but
the kernel keeps one size per inode: the newest version's, which every descriptor of the
inode is told by ``fstat`` and which bounds its page-cache reads and mappings. So every
read of a regular file is fitted to that size here, whatever the handle reads:

* it ends at the inode's current size (never past it: ``fstat``, ``read`` and ``mmap`` of
  one descriptor agree; the kernel clips its own page-cache reads there too);
* below it, the handle's own bytes up to its *floor*, then zeros: the floor is the size of
  its content, lowered to every size the file was cut to (truncate, ``O_TRUNC``) while the
  handle read an older version. The kernel does the same to the pages it caches for the
  inode (a cut drops the pages past it and zeroes the tail of the last one), so a page the
  kernel kept and a page it reads again through the daemon hold the same bytes.

A reader of the current version is unaffected: its content's size is the current size.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def fit(data, offset: int, size: int, content_size: int, floor: int | None, cur: int | None):
    """``data`` (what the handle's content holds at ``offset``, at most ``size`` bytes, up to
    ``content_size``) as the read of a file of ``cur`` bytes whose bytes from ``floor`` on are
    zeros. ``cur`` None: the inode is gone from the namespace (only its descriptors hold it):
    the content as it is."""
    if cur is None:
        cur = content_size
    end = min(offset + size, cur)
    want = end - offset
    if want <= 0:
        return b""
    keep = want
    if floor is not None:
        keep = max(0, min(keep, floor - offset))
    if len(data) >= want and keep == want:
        return data if len(data) == want else data[:want]
    head = bytes(data[:keep]) if keep else b""
    return head + bytes(want - len(head))


def cut(handles, ino: int, size: int, current) -> None:
    """The file ``ino`` was cut to ``size`` bytes in ``current`` (its write state): every other
    handle of the inode reads an older version, whose bytes from ``size`` on now read as
    zeros (until the file grows again they lie past its end anyway)."""
    for h in handles:
        if h.ino != ino or (h.ws is not None and h.ws is current):
            continue
        h.floor = size if h.floor is None else min(h.floor, size)
        log.debug("inode %d cut to %d: an older version's handle reads zeros from %d", ino, size, h.floor)
