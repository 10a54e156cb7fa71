"""The userspace NVMe/TCP initiator against the real Linux nvmet-tcp target in QEMU."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import trio

from kvfs.remote import pdu as P
from kvfs.remote.controller import Controller
from kvfs.remote.errors import NvmeStatusError, TransportError
from kvfs.remote.url import parse_url
from support.nvmet import SUBNQN, free_port

pytestmark = pytest.mark.target


async def connect(url: str, query: str = "") -> Controller:
    return await Controller.connect(parse_url(url + query))


async def test_identify(remote_url, nvmet_target):
    c = await connect(remote_url)
    try:
        assert c.ident.model == "Linux"
        assert c.ident.subnqn == SUBNQN
        assert c.ident.serial == "KVFS0123456789"
        # Linux nvmet (kernel 6.1): Dataset Management + Write Zeroes, no Compare, no fused
        # commands, no reservations -- docs/scale-out.md's plain read/write case
        assert c.ident.oncs & 0b1100 == 0b1100 and not c.ident.oncs & 1 and not c.ident.compare_and_write
        assert not c.ident.reservations
        assert c.vs >> 16 == 1 and c.cap.mqes >= 32
        assert c.ident.ioccsz * 16 - 64 == c.io[0].inline_max > 0
        assert c.ns.lba_size == 512
        assert c.ns.size == nvmet_target.size
        assert c.admin.maxh2cdata >= 4096
        assert len(c.io) == 2 and all(q.depth == 64 for q in c.io)
    finally:
        await c.shutdown()


SIZES = [512, 1024, 4096, 4608, 16384, 16896, 65536, 131072 + 512, 1 << 20, (1 << 20) + 512, 3 << 20, 8 << 20]


@pytest.mark.parametrize("query", ["", "?digest=header,data", "?digest=header", "?queues=1&depth=32&max_io=65536"])
async def test_read_write_sizes_and_offsets(remote_url, query):
    c = await connect(remote_url, query)
    rnd = random.Random(hash(query))
    nblocks = c.ns.nsze
    try:
        written = []
        lba = 7                                     # deliberately odd start
        for n in SIZES:
            data = rnd.randbytes(n)
            await c.write(lba, data)
            written.append((lba, data))
            lba += n // 512 + rnd.randrange(1, 5000)
        assert lba < nblocks
        last = nblocks - 16                          # the very end of the namespace
        tail = rnd.randbytes(16 * 512)
        await c.write(last, tail)
        written.append((last, tail))
        for lba, data in written:
            buf = bytearray(len(data))
            await c.read(lba, memoryview(buf))
            assert buf == data, f"mismatch at LBA {lba} size {len(data)}"
        # reads that straddle neighbouring writes and split differently from the writes
        lba, data = written[-3]
        buf = bytearray(len(data) - 1024)
        await c.read(lba + 1, memoryview(buf))
        assert buf == data[512:512 + len(buf)]
        if "digest=header,data" in query:
            assert c.io[0].hdgst and c.io[0].ddgst
        if query == "":
            stats = [(q.inline_writes, q.r2ts) for q in c.io]
            assert sum(s[0] for s in stats) >= 5 and sum(s[1] for s in stats) >= 5
    finally:
        await c.shutdown()


async def test_64_commands_in_flight(remote_url):
    c = await connect(remote_url, "?queues=1&depth=64")
    rnd = random.Random(64)
    try:
        blobs = [(10_000 + i * 256, rnd.randbytes(512 * rnd.randrange(1, 129))) for i in range(128)]

        async def w(lba, data):
            await c.write(lba, data)
        async with trio.open_nursery() as n:
            for lba, data in blobs:
                n.start_soon(w, lba, data)
        assert c.io[0].peak_inflight == 64
        bufs = [bytearray(len(d)) for _, d in blobs]

        async def r(i):
            await c.read(blobs[i][0], memoryview(bufs[i]))
        async with trio.open_nursery() as n:
            for i in range(len(blobs)):
                n.start_soon(r, i)
        assert all(bufs[i] == blobs[i][1] for i in range(len(blobs)))
    finally:
        await c.shutdown()


async def test_flush_keep_alive_and_kato(remote_url):
    # Without keep-alives nvmet tears the controller down after KATO; the volume's serve()
    # sends one every KATO/2, so after several KATO periods with nothing but keep-alives on
    # the wire the same controller still serves I/O. The test waits on what happened (keep-
    # alives completed on the admin queue), never on a duration: 8 keep-alives at KATO/2 span
    # 4 KATO periods. KATO is 4 s so that a stalled test machine (2 busy cores) cannot delay a
    # keep-alive past the target's timer and count as a failure of the initiator.
    from kvfs.remote.volume import NvmeTcpVolume
    vol = NvmeTcpVolume(parse_url(remote_url + "?kato=4"))
    await vol.open()
    ctrl = vol.ctrl
    admin0 = ctrl.admin.commands
    async with trio.open_nursery() as n:
        n.start_soon(vol.serve)
        with trio.fail_after(120):                         # a hang guard, not a time bound
            while ctrl.admin.commands - admin0 < 9:        # 9 sent: 8 done (only keep-alives use admin)
                await trio.sleep(0.05)                     # polling a counter with a deadline
        assert vol.ctrl is ctrl and vol.reconnects == 0 and vol.errors == 0
        gen = await vol.write(0, bytes(4096))
        await vol.durable(gen)
        assert bytes(await vol.read(0, 4096)) == bytes(4096)
        n.cancel_scope.cancel()
    await vol.close()


async def test_nvme_status_errors_are_decoded(remote_url):
    c = await connect(remote_url)
    try:
        q = c.io[0]
        cmd = P.sqe(P.IO_READ, nsid=c.ns.nsid, cdw10=c.ns.nsze & 0xFFFFFFFF, cdw11=c.ns.nsze >> 32, cdw12=0)
        # nvmet's bdev backend reports a read past the end as Internal Error (the block layer fails the bio)
        with pytest.raises(NvmeStatusError, match=r"read past end failed: (LBA Out of Range|Internal Error)") as ei:
            await q.execute(cmd, read_into=memoryview(bytearray(512)), what="read past end")
        assert ei.value.sct == 0 and ei.value.sc in (0x80, 0x06) and ei.value.dnr
        cmd = P.sqe(P.IO_READ, nsid=77, cdw12=0)
        with pytest.raises(NvmeStatusError, match="Invalid Namespace") as ei:
            await q.execute(cmd, read_into=memoryview(bytearray(512)))
        with pytest.raises(NvmeStatusError, match="Invalid Command Opcode|Invalid Field"):
            await q.execute(P.sqe(0x7E, nsid=1))
        # the connection survives status errors
        buf = bytearray(512)
        await c.read(0, memoryview(buf))
        with pytest.raises(ValueError):
            await c.read(c.ns.nsze, memoryview(buf))
    finally:
        await c.shutdown()


async def test_connect_errors(remote_url, nvmet_target):
    with pytest.raises(NvmeStatusError, match="Connect|Invalid"):
        await connect(f"nvme-tcp://127.0.0.1:{nvmet_target.port}/nqn.2024-01.io.kvfs:no-such-subsystem")
    with trio.fail_after(10):
        with pytest.raises(TransportError, match="cannot connect|closed"):
            await connect(f"nvme-tcp://127.0.0.1:{free_port()}/{SUBNQN}?timeout=2")


def test_probe_cli(remote_url):
    out = subprocess.run([sys.executable, "-m", "kvfs.remote.cli", "probe", remote_url, "--json"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["model"] == "Linux" and d["subnqn"] == SUBNQN and d["lba_size"] == 512 and d["nsze"] > 0
    assert d["compare_and_write"] is False and d["reservations"] is False
    table = subprocess.run([sys.executable, "-m", "kvfs.remote.cli", "probe", remote_url],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"})
    assert table.returncode == 0 and "Linux" in table.stdout and SUBNQN in table.stdout
    bad = subprocess.run([sys.executable, "-m", "kvfs.remote.cli", "probe", "nvme-tcp://127.0.0.1:1/x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "NQN" in bad.stderr
