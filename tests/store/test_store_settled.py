"""``settled`` (what tests and tools wait on) is False from the moment a promotion is queued."""
from __future__ import annotations

import os

import trio
import trio.testing

from support.store import open_store

from kvfs.store.index import ROOT_INO


async def test_settled_is_false_while_a_promotion_is_handed_to_the_waiting_loop(tmp_path):
    """The promote loop waits on its channel, so a send hands the object straight to it and the
    channel's buffer stays empty until that task runs: ``settled`` read the buffer and said
    True in that window (a mount test compared a stats snapshot with a metrics scrape taken
    just after and saw the promotion land between them)."""
    async with open_store(tmp_path) as kvstore:
        store = kvstore.store
        fh, ino, _ = await kvstore.files.create(ROOT_INO, b"f", 0o644, 0, 0, os.O_WRONLY)
        await kvstore.files.write(fh, 0, os.urandom(256 << 10))
        await kvstore.files.release(fh)
        obj = kvstore.ns.sealed[ino]
        await store.mover.demote(obj, 0)
        assert set(obj.place) == {"nvme"}
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)
            await trio.testing.wait_all_tasks_blocked()
            assert store.settled()
            for _ in range(store.policy.promote_hits):
                store.note_open(obj)
            assert not store.settled()                  # queued, its task not yet run
            while not store.settled():
                await trio.sleep(0.01)
            assert "ram" in obj.place
            nursery.cancel_scope.cancel()
