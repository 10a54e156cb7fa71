"""Existing runtimes' storage I/O patterns, reproduced with our own code, against a kvfs mount.

- vLLM's file-system offload tier: ``<root>/<model>_<cfg12>_r<rank>/<h[:3]>/<h[3:5]>_g<g>/<h>.bin``,
  16 writer threads racing ``makedirs``, temp ``<name>.bin_<rand>.tmp`` opened
  O_CREAT|O_EXCL|O_TRUNC, one write, ``rename`` over the final name, an O_DIRECT probe, then
  O_DIRECT reads into page-aligned buffers; a short read counts as corruption (file deleted).
- LMCache's local-disk backend: one ``<key>.pt`` file per chunk written in place from a thread
  pool, an in-memory index, O_DIRECT reads, LRU eviction by ``os.remove``.
- SGLang HiCache's file backend: a flat directory of ``<key>_<model>_<tp>_<tpsize>.bin``, temp
  ``.<uuid>.tmp`` written by numpy ``tofile`` then renamed; existence by ``stat`` in batches of
  128; one ``readinto`` per page.

What kvfs adds underneath (tiering, persistence, checksums, bounded space) is checked here.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

from support.mount import wait_for

pytestmark = pytest.mark.mount
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _settled(m) -> bool:
    """No demotion, eviction or promotion running or queued; RAM and NVMe at or under their
    high watermark (90 %), where the daemon leaves them alone."""
    st = m.stats()
    return st["settled"] and all(st["tiers"][t]["used"] <= 0.9 * st["tiers"][t]["capacity"]
                                 for t in ("ram", "nvme"))


def _payload(i: int, size: int) -> bytes:
    seed = hashlib.sha256(f"block-{i}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


# -- vLLM ---------------------------------------------------------------------------------
def _vllm_path(root, h: str) -> str:
    return os.path.join(root, "llama-8b_0123456789ab_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin")


def _vllm_probe_odirect(root) -> bool:
    probe = os.path.join(root, f".odirect_probe_{uuid.uuid4().hex}")
    buf = _aligned(4096)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def _vllm_write(root, h: str, data: bytes, direct: bool) -> None:
    final = _vllm_path(root, h)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}_{uuid.uuid4().hex[:8]}.tmp"
    flags = os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_WRONLY | (O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        if direct:
            buf = _aligned(len(data))
            buf[:] = data
            assert os.write(fd, buf) == len(data)
        else:
            assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, final)
    except FileExistsError:
        os.unlink(tmp)


def _vllm_read(root, h: str, size: int, direct: bool) -> bytes | None:
    path = _vllm_path(root, h)
    # (vLLM checks access(F_OK) first; on a cache that evicts, the file may go between the
    # check and the open, so open directly and take ENOENT as the miss it is)
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except FileNotFoundError:
        return None
    try:
        buf = _aligned(size)
        n = os.readv(fd, [buf])
    finally:
        os.close(fd)
    if n != size:                       # vLLM: a short read is corruption; delete the file
        os.unlink(path)
        raise AssertionError(f"short read {n} of {size} for {path}")
    return bytes(buf)


def test_vllm_file_tier_pattern(kvfs_mount):
    m = kvfs_mount(ram="8MiB", nvme_size="512MiB")
    root = str(m.path / "vllm")
    os.makedirs(root, exist_ok=True)
    direct = _vllm_probe_odirect(root)
    size, n = 256 * 1024, 64                       # 16 MiB: twice the RAM tier
    hashes = [hashlib.sha256(f"prefix-{i}".encode()).hexdigest() for i in range(n)]
    with ThreadPoolExecutor(16) as pool:           # 16 writers racing makedirs on shared parents
        list(pool.map(lambda i: _vllm_write(root, hashes[i], _payload(i, size), direct), range(n)))
        # the same blocks again: rename over existing names must be tolerated
        list(pool.map(lambda i: _vllm_write(root, hashes[i], _payload(i, size), direct), range(0, n, 7)))
    leftovers = [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]
    assert not leftovers
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: _vllm_read(root, hashes[i], size, direct), range(n)))
    assert all(g == _payload(i, size) for i, g in enumerate(got))
    wait_for(lambda: _settled(m), 120, "background demotion to settle")
    tiers = [os.getxattr(_vllm_path(root, h), "user.kvfs.tier").decode() for h in hashes]
    assert "nvme" in tiers and "ram" in tiers, tiers      # tiering under the runtime's feet
    for i in (0, n // 2, n - 1):
        want = f"{xxhash.xxh3_64_intdigest(_payload(i, size)):016x}"
        assert os.getxattr(_vllm_path(root, hashes[i]), "user.kvfs.checksum").decode() == want
    assert _vllm_read(root, "f" * 64, size, direct) is None
    m.remount()                                    # the cache survives a daemon restart
    assert _vllm_read(root, hashes[3], size, direct) == _payload(3, size)
    assert _vllm_read(root, hashes[n - 1], size, direct) == _payload(n - 1, size)


def test_vllm_pattern_is_bounded_by_eviction(kvfs_mount):
    m = kvfs_mount(ram="4MiB", nvme_size="16MiB")
    root = str(m.path / "vllm")
    os.makedirs(root, exist_ok=True)
    size, n = 256 * 1024, 160                      # 40 MiB into 20 MiB of tiers
    hashes = [hashlib.sha256(f"p-{i}".encode()).hexdigest() for i in range(n)]
    for i in range(n):
        _vllm_write(root, hashes[i], _payload(i, size), direct=False)
    wait_for(lambda: _settled(m), 120, "background eviction to settle")
    present = [os.path.exists(_vllm_path(root, h)) for h in hashes]
    assert present[-1] and not all(present)        # newest kept, oldest evicted
    assert sum(present) * size <= 20 * 2**20
    read = 0
    for i in range(n):                             # what exists is whole; no short reads
        if present[i]:
            # eviction runs in the background until the tiers reach their low watermark: a block
            # listed a moment ago may be gone now (a miss), but never reads wrong or short
            got = _vllm_read(root, hashes[i], size, direct=False)
            assert got is None or got == _payload(i, size)
            read += got is not None
    assert read > 0


# -- LMCache ------------------------------------------------------------------------------
class _LMCacheLikeDisk:
    """One file per chunk, written in place by a thread pool; index in memory; LRU remove."""

    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self.index: dict[str, int] = {}          # key -> size, in LRU order
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(4)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "-") + ".pt")

    def put(self, key: str, data: bytes):
        def write():
            with open(self.path(key), "wb") as f:
                f.write(data)
            with self.lock:
                self.index[key] = len(data)
                while sum(self.index.values()) > self.max_bytes:
                    old = next(iter(self.index))
                    del self.index[old]
                    os.remove(self.path(old))
        return self.pool.submit(write)

    def get(self, key: str) -> bytes | None:
        with self.lock:
            size = self.index.pop(key, None)
            if size is None:
                return None
            self.index[key] = size
        buf = _aligned(-(-size // 4096) * 4096)
        fd = os.open(self.path(key), os.O_RDONLY | O_DIRECT)
        try:
            n = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        assert n == size, f"short read {n} of {size}"
        return bytes(buf[:size])


def test_lmcache_local_disk_pattern(kvfs_mount):
    m = kvfs_mount(ram="8MiB", nvme_size="512MiB")
    disk = _LMCacheLikeDisk(str(m.path / "lmcache"), max_bytes=24 * 2**20)
    size = 512 * 1024 + 123                         # chunk files need not be page multiples
    keys = [f"vllm@llama-8b@1@0@{hashlib.sha256(str(i).encode()).hexdigest()[:16]}" for i in range(64)]
    for f in [disk.put(k, _payload(i, size)) for i, k in enumerate(keys)]:
        f.result()
    kept = [k for k in keys if k in disk.index]
    assert len(kept) < len(keys)                    # its own LRU removed the oldest
    wait_for(lambda: _settled(m), 120, "background demotion to settle")
    for i, k in enumerate(keys):
        got = disk.get(k)
        assert got is None if k not in kept else got == _payload(i, size)
        assert os.path.exists(disk.path(k)) == (k in kept)
    tiers = {os.getxattr(disk.path(k), "user.kvfs.tier").decode() for k in kept}
    assert tiers <= {"ram", "nvme"} and "nvme" in tiers
    disk.pool.shutdown()
    m.remount()   # LMCache's own index is gone after a restart; kvfs kept the files
    for i, k in enumerate(keys):
        if k in kept:
            with open(disk.path(k), "rb") as f:
                assert f.read() == _payload(i, size)


# -- SGLang HiCache -----------------------------------------------------------------------
def _sglang_path(root, key):
    return os.path.join(root, f"{key}_llama-8b_0_1.bin")


def _sglang_set(root, key, page: np.ndarray):
    tmp = os.path.join(root, f".{uuid.uuid4().hex}.tmp")
    page.tofile(tmp)
    os.replace(tmp, _sglang_path(root, key))


def _sglang_batch_exists(root, keys) -> int:
    """Leading keys that exist, checked by stat in batches of 128."""
    for start in range(0, len(keys), 128):
        for j, k in enumerate(keys[start:start + 128]):
            try:
                os.stat(_sglang_path(root, k))
            except FileNotFoundError:
                return start + j
    return len(keys)


def _sglang_get(root, key, out: np.ndarray) -> None:
    with open(_sglang_path(root, key), "rb", buffering=0) as f:
        n = f.readinto(memoryview(out).cast("B"))
    if n != out.nbytes:
        raise OSError(errno.EIO, f"short read {n} of {out.nbytes}")


def test_sglang_hicache_file_pattern(kvfs_mount):
    m = kvfs_mount(ram="8MiB", nvme_size="512MiB")
    root = str(m.path / "hicache")
    os.makedirs(root)
    keys, key = [], b""
    for i in range(300):                            # chained SHA-256 page keys
        key = hashlib.sha256(key + f"page-{i}".encode()).digest()
        keys.append(key.hex())
    pages = [np.full(32 * 1024, i, dtype=np.float32) for i in range(len(keys))]   # 128 KiB pages
    assert _sglang_batch_exists(root, keys) == 0    # negative lookups first...
    for k, p in zip(keys[:260], pages):
        _sglang_set(root, k, p)
    assert _sglang_batch_exists(root, keys) == 260  # ...do not hide files written since
    out = np.empty(32 * 1024, dtype=np.float32)
    for i in (0, 127, 128, 259):
        _sglang_get(root, keys[i], out)
        assert np.array_equal(out, pages[i])
    assert not [f for f in os.listdir(root) if f.endswith(".tmp")]
    wait_for(lambda: _settled(m), 120, "background demotion to settle")
    tiers = {os.getxattr(_sglang_path(root, k), "user.kvfs.tier").decode() for k in keys[:260]}
    assert "nvme" in tiers                          # 32 MiB of pages through an 8 MiB RAM tier
    m.remount()
    assert _sglang_batch_exists(root, keys) == 260
    _sglang_get(root, keys[200], out)
    assert np.array_equal(out, pages[200])
