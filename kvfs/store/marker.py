"""The clean-unmount marker: a meta record in the index that lets the next mount skip
recovery (kvfs.store.objtable, ``Store.start``).

``write`` puts it after every pending change, in its own LMDB transaction, and notes that
transaction's id. ``take`` removes it in the first write transaction of whoever opens the
index next (a daemon, fsck, a tool), and trusts it only if no transaction came between
(the marker's transaction is the last one): anything that wrote to the index after the
clean unmount (an old kvfs, a hand edit, a planted record) makes the next mount recover
in full, decoding and checking every record.
"""
from __future__ import annotations

import logging

from kvfs.errors import IndexDamaged
from kvfs.store import records

log = logging.getLogger(__name__)

KEY = b"clean"
VERSION = 1
LAST = b"last_txn"          # the id of the last write transaction kvfs made (``stamp``)
VALID = b"v"                # in the index's ``recover`` database: the running totals are valid


def take(txn, meta_db, where) -> dict | None:
    """Remove the marker in the write transaction ``txn``; return it if it can be trusted."""
    raw = txn.pop(KEY, db=meta_db)
    if raw is None:
        return None
    try:
        marker = records.decode_meta(raw)
    except IndexDamaged:
        log.warning("%s: ignoring an unreadable clean-unmount marker", where)
        return None
    if marker.get("version") != VERSION or marker.get("txnid") != txn.id() - 1:
        log.info("%s: the index changed after its clean unmount: recovering in full", where)
        return None
    return marker


def write(index, marker: dict) -> None:
    """Record a clean unmount (``marker``: totals the next mount may trust instead of
    decoding every record) after every pending change of ``index``, on the disk."""
    index.commit()
    with index.env.begin(write=True) as txn:
        txn.put(KEY, records.encode({**marker, "version": VERSION, "txnid": txn.id()}), db=index.meta)
        stamp(txn, index.meta)
    index.env.sync(True)


def stamp(txn, meta_db) -> None:
    """Note ``txn`` as kvfs's last write (every write transaction of kvfs.store.index does)."""
    txn.put(LAST, txn.id().to_bytes(8, "big"), db=meta_db)


def untouched(txn, meta_db, recover_db) -> bool:
    """In the opener's first write transaction ``txn``: whether the last write before it was
    kvfs's own. If not, the running totals (kvfs.store.tally) are no longer valid, for this
    opener and every later one, until a full recovery recounts them. Stamps ``txn``."""
    raw = txn.get(LAST, db=meta_db)
    ok = raw is not None and int.from_bytes(raw, "big") == txn.id() - 1
    if not ok:
        txn.delete(VALID, db=recover_db)
    stamp(txn, meta_db)
    return ok
