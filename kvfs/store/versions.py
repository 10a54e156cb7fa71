"""What a descriptor reads when its file changed size under it (docs/design.md, "Versions
and sizes").

A read-only descriptor reads the sealed version it opened (or the write buffer it joined),
but the kernel keeps one size per inode: the newest version's, which ``fstat`` shows on
every descriptor of the inode and which bounds its page-cache reads and mappings. So every
read of a regular file is fitted to that size here, whatever the handle reads: it ends at
the inode's current size, and below it holds the handle's own bytes, then zeros past their
end. ``fstat``, ``read`` and ``mmap`` of one descriptor then agree (never EOF, never SIGBUS
inside the size it is told, never a byte of another version).

The kernel adds nothing of its own: a size it learns from the daemon (a truncate's or a
getattr's reply) drops the inode's whole page cache (``truncate_pagecache`` and
``invalidate_inode_pages2``, mapped pages unmapped), so every page a descriptor reads after
a size change comes from here; a write that extends the file through a ``direct_io`` handle
(the only kind a writer beside an older version's reader gets) leaves the cached pages of
that reader, whose bytes past its own end are zeros, as here.

A reader of the current version is unaffected: its content's size is the current size.
"""
from __future__ import annotations


def fit(data, offset: int, size: int, content_size: int, cur: int | None):
    """``data`` (what the handle's content holds at ``offset``: at most ``size`` bytes, none
    past ``content_size``) as the read of a file of ``cur`` bytes: cut at ``cur``, padded
    with zeros up to it. ``cur`` None (the inode is gone from the namespace, only its
    descriptors hold it): the content as it is."""
    if cur is None:
        cur = content_size
    want = min(offset + size, cur) - offset
    if want <= 0:
        return b""
    n = len(data)
    if n == want:
        return data
    if n > want:
        return data[:want]
    return bytes(data) + bytes(want - n)


def orphan_version(orphans: dict, ino: int, size: int, mtime: int | None, oid: int | None) -> None:
    """The version a seal made of inode ``ino`` removed from the namespace while open (an
    unlink, or a rename over its name; ``orphans``: the namespace's, ino -> record): it is the
    orphan's current content, of ``size`` bytes, held by object ``oid`` or only by the write
    state's buffer (None). Every descriptor of the inode is told this size (POSIX), and the
    record no longer names the older version's object, so a reader of that version is fitted
    to it as an older one: zeros past its own end up to this size, never EOF inside it
    (docs/design.md, "Versions and sizes")."""
    orphan = orphans.get(ino)
    if orphan is not None:
        orphan.size = size
        orphan.mtime = mtime or orphan.mtime
        orphan.oid = oid
