"""Faults on the real target: killed mid-read, stalled (SIGSTOP), restarted."""
from __future__ import annotations

import os
import random
import signal

import pytest
import trio

from kvfs.errors import NoSuchObject, TierUnavailable
from support.nvmet import SUBNQN
from support.store import make_info
from support.target import open_tier

pytestmark = pytest.mark.target
CMD_TIMEOUT = 2.0


async def wait_until(pred, timeout: float, what: str):
    with trio.move_on_after(timeout):
        while not pred():
            await trio.sleep(0.05)       # polling tier state with a deadline
        return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def back_intact(tier, objs, deleted, what: str):
    """The tier reconnects (its queued delete applied), every object in ``objs`` reads back
    intact and the ``deleted`` (oid, location) is gone."""
    await wait_until(lambda: tier.available and tier.status()["pending_deletes"] == 0, 60, what)
    assert tier.status()["state"] == "connected"
    for o, (lc, d) in objs.items():
        assert bytes(await tier.read(o, lc, 0, len(d))) == d
    with pytest.raises(NoSuchObject):
        await tier.read(*deleted, 0, 10)


async def fill(tier, n=16, size=1 << 20):
    rnd = random.Random(7)
    objs = {}
    for oid in range(1, n + 1):
        data = rnd.randbytes(size - oid * 512)
        objs[oid] = (await tier.put(make_info(oid, data), memoryview(data)), data)
    return objs


async def test_kill_during_reads_then_restart(fresh_target):
    url = fresh_target.url + f"?timeout={CMD_TIMEOUT}"
    tier = await open_tier(url, instance_id="faults", size="100%")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.serve)
            objs = await fill(tier)
            ok, failed = [0], [0]
            stop = trio.Event()

            async def reader(seed):
                rnd = random.Random(seed)
                while not stop.is_set():
                    oid = rnd.choice(list(objs))
                    loc, data = objs[oid]
                    with trio.fail_after(CMD_TIMEOUT * 3):      # never waits past the command timeout
                        try:
                            got = await tier.read(oid, loc, 0, len(data))
                        except TierUnavailable:
                            failed[0] += 1
                            await trio.sleep(0.01)
                            continue
                    assert bytes(got) == data                   # never other bytes
                    ok[0] += 1

            async with trio.open_nursery() as readers:
                for i in range(6):
                    readers.start_soon(reader, i)
                await wait_until(lambda: ok[0] >= 12, 60, "reads before the kill")
                fresh_target.kill()
                await wait_until(lambda: failed[0] >= 6, CMD_TIMEOUT * 3, "reads failing after the kill")
                stop.set()
            assert not tier.available
            st = tier.status()
            assert st["state"] == "disconnected" and st["errors"] >= 1
            oid, (loc, data) = next(iter(objs.items()))
            with trio.fail_after(1):                    # fails at once while disconnected
                with pytest.raises(TierUnavailable):
                    await tier.read(oid, loc, 0, 10)
                with pytest.raises(TierUnavailable):
                    await tier.put(make_info(99, b"z"), memoryview(b"z"))
            del objs[oid]
            await tier.delete(oid, loc)                 # remembered, applied on reconnect
            assert tier.status()["pending_deletes"] == 1

            fresh_target.start()
            # the queued delete is applied just after the tier reports itself available
            await back_intact(tier, objs, (oid, loc), "reconnect after restart and the queued delete applied")
            assert tier.status()["reconnects"] >= 1
            nursery.cancel_scope.cancel()
    finally:
        await tier.close()
    again = await open_tier(url, instance_id="faults", fmt=False, size="100%")
    try:
        assert again.objects == len(objs)
        assert {o async for o, _, _ in again.scan()} == set(objs)
    finally:
        await again.close()


async def test_stalled_target_times_out_then_recovers(fresh_target):
    # a command timeout well above what a command takes on a busy 2-core machine (the fill
    # below must not time out), and a hang guard well above it for the stalled read
    url = fresh_target.url + "?timeout=3&kato=4"
    tier = await open_tier(url, instance_id="stall", size="100%")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.serve)
            objs = await fill(tier, n=4)
            os.kill(fresh_target.pid, signal.SIGSTOP)
            try:
                oid, (loc, data) = next(iter(objs.items()))
                with trio.fail_after(60):                   # a hang guard, not a time bound
                    with pytest.raises(TierUnavailable, match="timed out|stalled"):
                        await tier.read(oid, loc, 0, len(data))
                assert not tier.available
            finally:
                os.kill(fresh_target.pid, signal.SIGCONT)
            await wait_until(lambda: tier.available, 60, "reconnect after SIGCONT")
            for o, (lc, d) in objs.items():
                assert bytes(await tier.read(o, lc, 0, len(d))) == d
            nursery.cancel_scope.cancel()
    finally:
        await tier.close()


async def test_namespace_gone_blank_volume_after_restart(fresh_target, tmp_path):
    """The target comes back exporting a different (blank) namespace: the tier stays
    unavailable with bounded errors and writes nothing to it; once the right volume is
    back it reconnects by itself and its objects read back intact."""
    url = fresh_target.url + f"?timeout={CMD_TIMEOUT}"
    tier = await open_tier(url, instance_id="nsgone", size="100%")
    ours = fresh_target.image
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.serve)
            objs = await fill(tier, n=6)
            fresh_target.kill()
            blank = tmp_path / "blank.img"
            fresh_target.image = blank
            fresh_target.start()
            await wait_until(lambda: tier.vol.reconnects >= 1 and tier.status()["state"] == "changed", 60,
                             "a reconnect that finds the wrong volume")
            seen = tier.vol.reconnects
            await wait_until(lambda: tier.vol.reconnects > seen, 30, "another try (the tier keeps retrying)")
            assert not tier.available
            oid, (loc, data) = next(iter(objs.items()))
            with trio.fail_after(1):                     # bounded: fails at once, never other bytes
                with pytest.raises(TierUnavailable):
                    await tier.read(oid, loc, 0, len(data))
                with pytest.raises(TierUnavailable):
                    await tier.put(make_info(99, b"z"), memoryview(b"z"))
            await tier.delete(oid, loc)                  # queued, not written to the blank volume
            del objs[oid]
            st = tier.status()
            assert st["errors"] >= 1 and "not the one this tier uses" in st["last_error"]
            fresh_target.kill()
            with open(blank, "rb") as f:                 # nothing was written to the foreign volume
                while chunk := f.read(1 << 20):
                    assert not any(chunk)
            fresh_target.image = ours
            fresh_target.start()
            await back_intact(tier, objs, (oid, loc), "reconnect to the right volume")
            nursery.cancel_scope.cancel()
    finally:
        await tier.close()


async def test_namespace_disabled_in_configfs_then_enabled(fresh_target):
    """The namespace is disabled on the running target (the controller stays up): I/O fails
    with bounded errors, the tier goes unavailable and keeps retrying; re-enabled, it
    reconnects by itself and its objects read back intact."""
    url = fresh_target.url + f"?timeout={CMD_TIMEOUT}"
    enable = f"/sys/kernel/config/nvmet/subsystems/{SUBNQN}/namespaces/1/enable"
    tier = await open_tier(url, instance_id="nsdisabled", size="100%")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.serve)
            objs = await fill(tier, n=6)
            await trio.to_thread.run_sync(fresh_target.guest, f"echo 0 > {enable}")
            oid, (loc, data) = next(iter(objs.items()))
            with trio.fail_after(CMD_TIMEOUT * 3):      # never waits past the command timeout
                with pytest.raises(TierUnavailable):
                    await tier.read(oid, loc, 0, len(data))
            await wait_until(lambda: not tier.available, CMD_TIMEOUT * 3, "the tier to go unavailable")
            errors = tier.status()["errors"]
            assert errors >= 1
            for o, (lc, d) in objs.items():
                with trio.fail_after(1):
                    with pytest.raises(TierUnavailable):
                        await tier.read(o, lc, 0, len(d))
            await trio.to_thread.run_sync(fresh_target.guest, f"echo 1 > {enable}")
            await wait_until(lambda: tier.available, 60, "reconnect after the namespace is back")
            assert tier.status()["state"] == "connected" and tier.vol.reconnects >= 1
            for o, (lc, d) in objs.items():
                assert bytes(await tier.read(o, lc, 0, len(d))) == d
            nursery.cancel_scope.cancel()
    finally:
        await tier.close()
