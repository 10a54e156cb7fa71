"""Pages on the NVMe tier read by the adapters' ``PageStore.read_into``: O_DIRECT straight into a
page-aligned destination (no staging copy), through the staging buffer otherwise; the same
bytes either way, and a damaged object is a miss with a counted checksum error."""
from __future__ import annotations

import os

from support.mount import wait_for
from kvfs.integrations.pages import PageStore
from kvfs.kv.blockio import AlignedBuffer, LeaseClient

MiB = 1 << 20


def test_nvme_pages_read_straight_into_page_aligned_destinations(kvfs_mount, tmp_path):
    cfg = tmp_path / "stay.toml"        # pages read twice stay on NVMe (no promotion to RAM)
    cfg.write_text("promote_hits = 1000000\n")
    m = kvfs_mount(ram="8MiB", config=cfg)
    ps = PageStore(m.path, "pages")
    os.makedirs(m.path / "pages")
    names = [f"p{i:02d}" for i in range(12)]
    data = [os.urandom(MiB) for _ in names]
    try:
        assert all(ps.write_many(names, lambda i: [data[i]]))
        wait_for(lambda: m.stats()["settled"], 60, "the pages to settle")
        lease = LeaseClient(str(m.path), str(m.path / "pages"))
        backs = lease.acquire(names)
        lease.release()
        lease.close()
        nvme = [i for i, b in enumerate(backs) if b is not None and b.tier == "nvme" and b.direct]
        assert len(nvme) >= 4, "12 MiB through an 8 MiB RAM tier left nothing on NVMe"
        pool = AlignedBuffer(len(names) * MiB + 4096)
        for shift in (0, 512):          # page aligned: straight in; 512 bytes off: via staging
            dests = [[pool.mv[shift + i * MiB:shift + (i + 1) * MiB]] for i in range(len(names))]
            assert all(ps.read_into(names, dests)), shift
            assert all(bytes(dests[i][0]) == data[i] for i in range(len(names))), shift
        assert ps.statistics().lease_fallbacks == 0
        # damage a page whose predecessor is also on NVMe: that one is read while the
        # damaged one is hashed (kvfs.integrations.leased.Ahead) and must still be right
        bad = next(i for i in nvme if i - 1 in nvme)
        lease = LeaseClient(str(m.path), str(m.path / "pages"))
        b = lease.acquire([names[bad]])[0]          # still the NVMe object, read twice
        lease.release()
        lease.close()
        assert b is not None and b.tier == "nvme" and b.path == backs[bad].path
        with open(b.path, "r+b") as f:  # a damaged NVMe object (the disk under the tier)
            f.seek(b.offset + 1000)
            byte = f.read(1)
            f.seek(b.offset + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        dests = [[pool.mv[i * MiB:(i + 1) * MiB]] for i in range(len(names))]
        pool.mv[:] = b"\0" * len(pool.mv)
        got = ps.read_into(names, dests)         # the run ends at the damaged page: a miss
        assert got == [True] * bad + [False] * (len(names) - bad), got
        assert all(bytes(dests[i][0]) == data[i] for i in range(bad))
        assert ps.statistics().checksum_errors == 1
        assert ps.read_into([names[bad]], [dests[bad]]) == [False]     # a miss, not wrong bytes
        assert ps.statistics().checksum_errors == 2
        off = [[pool.mv[512:512 + MiB]]]        # not page aligned: staging, copy and hash per piece
        assert ps.read_into([names[bad]], off) == [False]
        assert ps.read_into([names[bad - 1]], off) == [True] and bytes(off[0][0]) == data[bad - 1]
        assert ps.statistics().checksum_errors == 3
        # LMCache's lookup-and-pin path: each page on its own, the damaged one alone a miss
        pool.mv[:] = b"\0" * len(pool.mv)
        k, held = ps.hold(names)
        try:
            assert k == len(names)
            got = ps.read_held(held, names, dests)
        finally:
            ps.release_hold(held)
        assert got == [i != bad for i in range(len(names))], got
        assert all(bytes(dests[i][0]) == data[i] for i in range(len(names)) if i != bad)
        assert ps.statistics().checksum_errors == 4
    finally:
        ps.close()


def test_leased_pages_never_go_o_direct_into_a_mapping_of_a_fuse_file(kvfs_mount, tmp_path):
    """Issue 32 (2): a destination mapped from a file of the mount itself is read through the
    reader's own aligned buffer, never with O_DIRECT into it (the read would hold the NVMe
    file's lock while its page faults wait on the daemon); the bytes are the same."""
    import mmap

    from kvfs.integrations.leased import in_place
    from kvfs.kv.mapcheck import maps_fuse_file
    cfg = tmp_path / "stay.toml"
    cfg.write_text("promote_hits = 1000000\n")
    m = kvfs_mount(ram="8MiB", config=cfg)
    ps = PageStore(m.path, "pages")
    os.makedirs(m.path / "pages")
    names = [f"p{i:02d}" for i in range(12)]
    data = [os.urandom(MiB) for _ in names]
    (m.path / "dest").write_bytes(bytes(len(names) * MiB))
    fd = os.open(m.path / "dest", os.O_RDONLY)
    mm = mmap.mmap(fd, len(names) * MiB, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    mv = memoryview(mm)
    anon = AlignedBuffer(MiB)
    try:
        assert maps_fuse_file(mv[MiB:2 * MiB]) and not maps_fuse_file(anon.mv)
        assert all(ps.write_many(names, lambda i: [data[i]]))
        wait_for(lambda: m.stats()["settled"], 60, "the pages to settle")
        lease = LeaseClient(str(m.path), str(m.path / "pages"))
        backs = lease.acquire(names)
        lease.release()
        lease.close()
        nvme = [i for i, b in enumerate(backs) if b is not None and b.tier == "nvme" and b.direct]
        assert nvme, "12 MiB through an 8 MiB RAM tier left nothing on NVMe"
        i = nvme[0]
        assert in_place(backs[i], [anon.mv], MiB)
        assert not in_place(backs[i], [mv[i * MiB:(i + 1) * MiB]], MiB)
        dests = [[mv[k * MiB:(k + 1) * MiB]] for k in range(len(names))]
        assert all(ps.read_into(names, dests))
        assert all(bytes(dests[k][0]) == data[k] for k in range(len(names)))
    finally:
        del dests
        mv.release()
        mm.close()
        os.close(fd)
        anon.close()
        ps.close()
