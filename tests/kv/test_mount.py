"""The KV layer on a real kvfs mount: the acceptance scenario, one-call lookup, fast path,
xattrs from block headers, persistence, and prefix-aware eviction under pressure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import xxhash  # noqa: E402
from safetensors import safe_open  # noqa: E402

import kvfs  # noqa: E402
from support.mount import wait_for  # noqa: E402
from kvfs.blockformat import parse_block_header  # noqa: E402
from kvfs.kv.tree import tree_document  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]
REPO = Path(__file__).resolve().parents[2]
SMALL = kvfs.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_tokens=16)
# 256 KiB payload per block: pressure with few files
BIG = kvfs.KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, block_tokens=16)


def _kv(layout, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape(tokens), generator=g).to(layout.torch_dtype)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (n,), generator=g).tolist()


def test_acceptance_shared_prefix(kvfs_mount):
    m = kvfs_mount()
    cache = kvfs.KVCache(m.path, model="meta-llama/Llama-3.1-8B", layout=SMALL)
    assert cache.one_call_lookup
    prefix = _tokens(1000, 0)
    prompts = [prefix + _tokens(200 + 37 * i, 10 + i) for i in range(3)]
    kvs = [_kv(SMALL, len(p), 20 + i) for i, p in enumerate(prompts)]
    for p, kv in zip(prompts, kvs):
        cache.save(p, kv)
    cache.flush()
    assert cache.save_statistics().written == 62 + 3 * 0 + sum((len(p) // 16) - 62 for p in prompts)
    fourth = prefix + _tokens(300, 99)
    assert cache.lookup(fourth) == 992                     # 1000 rounded down to whole blocks
    for p, kv in zip(prompts, kvs):
        n = cache.lookup(p)
        assert n == (len(p) // 16) * 16
        got = cache.load(p[:n])
        # the shared prefix holds the first writer's KV; each tail its own
        assert torch.equal(got[:, :, :992], kvs[0][:, :, :992])
        assert torch.equal(got[:, :, 992:], kv[:, :, 992:n])
    assert set(cache.last_load.sources) <= {"ram", "nvme", "mount"}
    for path in cache.block_paths(fourth)[:62:20]:
        with safe_open(path, "pt") as f:
            assert f.metadata()["format"] == "kvfs-block-v1"
            assert tuple(f.get_tensor("kv").shape) == SMALL.block_shape()
        with open(path, "rb") as f:
            assert parse_block_header(f.read(4096))["data_offset"] % 4096 == 0
    # another process (another hash seed) finds the same blocks on the mount
    code = ("import kvfs, json, sys, torch\n"
            "lay = kvfs.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)\n"
            f"c = kvfs.KVCache({str(m.path)!r}, model='meta-llama/Llama-3.1-8B', layout=lay)\n"
            "print(c.lookup(json.loads(sys.stdin.read()))); c.close()\n")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(fourth), capture_output=True, text=True,
                         env=dict(os.environ, PYTHONHASHSEED="7",
                                  PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))), timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 992
    cache.close()


def test_lookup_chain_of_1000_blocks_in_one_call(kvfs_mount):
    m = kvfs_mount()
    lay = kvfs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    cache = kvfs.KVCache(m.path, model="tiny", layout=lay)
    toks = _tokens(16000, 1)
    cache.save(toks, torch.zeros(lay.block_shape(16000), dtype=torch.float16), wait=True)
    assert cache.lookup(toks) == 16000
    assert cache.lookup(toks + [5] * 40) == 16000
    paths = cache.block_paths(toks)
    n, tiers = cache._lookup.tiers(paths)
    assert n == 1000 and len(tiers) >= 1
    os.unlink(paths[700])
    assert cache.lookup(toks) == 700 * 16
    cache.close()


def test_fast_path_lease_ram_and_nvme(kvfs_mount):
    m = kvfs_mount(ram="4MiB", nvme_size="256MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=BIG)
    toks = _tokens(16 * 40, 2)                    # 40 blocks x 260 KiB: most demote to NVMe
    kv = _kv(BIG, len(toks), 3)
    cache.save(toks, kv, wait=True)
    tiers = {os.getxattr(p, "user.kvfs.tier").decode() for p in cache.block_paths(toks)}
    assert "nvme" in tiers
    got = cache.load(toks)
    assert torch.equal(got, kv)
    assert cache.last_load.sources.get("nvme", 0) >= 1, cache.last_load
    # the backing locations the daemon leases out match the files' bytes (opens count hits and
    # may promote a block into daemon memory, where it has no fast path: null)
    from kvfs.kv.blockio import LeaseClient
    lc = LeaseClient(str(m.path), cache.ns_dir)
    paths = cache.block_paths(toks)
    leased = lc.acquire([lc.rel(p) for p in paths])
    assert len(leased) == len(paths) and any(b is not None and b.tier == "nvme" for b in leased)
    for p, b in zip(paths, leased):
        if b is None:
            continue
        with open(p, "rb") as f:
            data = f.read()
        with open(b.path, "rb") as f:
            f.seek(b.offset)
            assert f.read(b.size) == data
        assert b.size == len(data) and b.checksum == f"{xxhash.xxh3_64_intdigest(data):016x}"
        assert os.getxattr(p, "user.kvfs.checksum").decode() == b.checksum
    lc.release()
    lc.close()
    # the per-file xattr answers the same for a file open through the mount
    fd = os.open(paths[-1], os.O_RDONLY)
    try:
        try:
            b = json.loads(os.getxattr(fd, "user.kvfs.backing"))
        except OSError:
            b = None                                  # promoted into daemon memory meanwhile
        if b is not None:
            assert b["checksum"] == os.getxattr(paths[-1], "user.kvfs.checksum").decode()
    finally:
        os.close(fd)
    out = torch.empty_like(kv)
    assert list(cache.load_layers(toks, out)) == list(range(BIG.num_layers)) and torch.equal(out, kv)
    cache.close()


def test_block_xattrs_and_tree(kvfs_mount):
    m = kvfs_mount()
    cache = kvfs.KVCache(m.path, model="m", layout=SMALL)
    shared = _tokens(64, 4)
    for i in range(3):
        cache.save(shared + _tokens(32, 5 + i), _kv(SMALL, 96, i))
    cache.flush()
    paths = cache.block_paths(shared + _tokens(32, 5))
    hashes = cache.block_hashes(shared + _tokens(32, 5))
    assert os.getxattr(paths[0], "user.kvfs.tokens").decode() == "16"
    assert os.getxattr(paths[0], "user.kvfs.parent").decode() == ""
    assert os.getxattr(paths[3], "user.kvfs.tokens").decode() == "64"
    assert os.getxattr(paths[3], "user.kvfs.parent").decode() == hashes[2]
    cache.load(shared)
    doc = tree_document(cache.ns_dir)
    assert doc["blocks"] == 4 + 3 * 2 and len(doc["roots"]) == 1
    root = doc["roots"][0]
    assert [b["tokens"] for b in root["blocks"]] == [16, 32, 48, 64]
    assert len(root["children"]) == 3 and all(len(c["blocks"]) == 2 for c in root["children"])
    assert all(b["tier"] in ("ram", "nvme") for b in root["blocks"]) and root["blocks"][0]["hits"] >= 1
    cache.close()


def test_blocks_survive_remount(kvfs_mount):
    m = kvfs_mount()
    toks = _tokens(160, 6)
    kv = _kv(SMALL, 160, 7)
    with kvfs.KVCache(m.path, model="m", layout=SMALL) as cache:
        cache.save(toks, kv, wait=True)
    m.remount()
    with kvfs.KVCache(m.path, model="m", layout=SMALL) as cache:
        assert cache.lookup(toks) == 160
        assert torch.equal(cache.load(toks), kv)


def test_pressure_keeps_shared_heads_and_drops_tails(kvfs_mount):
    """Chains lose their tails, never their heads: the shared prefix outlives the tails."""
    m = kvfs_mount(ram="4MiB", nvme_size="24MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=BIG)
    head = _tokens(16 * 8, 8)                     # 8 shared blocks
    prompts = [head + _tokens(16 * 8, 100 + i) for i in range(24)]   # 8 + 24*8 blocks ~ 52 MiB
    for i, p in enumerate(prompts):
        cache.save(p, _kv(BIG, len(p), i), wait=True)
    assert cache.lookup(head) == len(head), "the shared head was evicted"
    for p in prompts:
        cached = [os.path.exists(q) for q in cache.block_paths(p)]
        k = cached.index(False) if False in cached else len(cached)
        assert not any(cached[k:]), f"a chain lost a middle block but kept its tail: {cached}"
    alive_tails = sum(cache.lookup(p) > len(head) for p in prompts)
    assert alive_tails < len(prompts), "nothing was evicted: the test applied no pressure"
    cache.close()


# 32 layers x 2 x 16 tokens x 8 heads x 128 x bf16 = 2 MiB per block: RAM objects this big are
# tmpfs files, so the fast path serves them from shared memory
LLAMA = kvfs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_tokens=16)


def test_lease_fast_path_from_shared_memory(kvfs_mount):
    m = kvfs_mount(ram="256MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=LLAMA)
    toks = _tokens(16 * 6, 11)
    kv = _kv(LLAMA, len(toks), 12)
    cache.save(toks, kv, wait=True)
    got = cache.load(toks)
    assert torch.equal(got, kv) and cache.last_load.sources == {"ram": 6}
    assert got.data_ptr() % 4096 == 0                     # load() hands out page-aligned memory
    part = torch.empty_like(kv[:, :, :80])                # torch's own (not page-aligned) memory
    cache.load_into(toks[:16 * 5], part)
    assert cache.last_load.sources == {"ram": 5} and torch.equal(part, kv[:, :, :80])
    strided = torch.empty(kv.shape[:2] + (96,) + kv.shape[3:], dtype=kv.dtype)[:, :, 16:]
    cache.load_into(toks[:16 * 5], strided)               # not contiguous: through staging buffers
    assert cache.last_load.sources == {"ram": 5} and torch.equal(strided, kv[:, :, :80])
    out = torch.empty_like(kv)
    assert list(cache.load_layers(toks, out)) == list(range(32)) and torch.equal(out, kv)
    assert m.stats()["leases"] == 0                       # every load gave its lease back
    hits = int(os.getxattr(cache.block_paths(toks)[0], "user.kvfs.hits"))
    assert hits >= 3                                      # a leased block counts a hit, like an open
    # a damaged shared-memory copy is caught by the loader's checksum, never returned
    fd = os.open(m.path / ".kvfs" / "lease", os.O_RDWR)
    try:
        base = os.path.relpath(cache.ns_dir, m.path)
        rels = [os.path.relpath(p, cache.ns_dir) for p in cache.block_paths(toks)]
        os.pwrite(fd, f"\0base {base}\n{rels[2]}\n".encode(), 0)
        ans = json.loads(os.pread(fd, 1 << 20, 0))
        tier, path, off, size, checksum, direct = ans["blocks"][0]
        assert tier == "ram" and path.startswith("/dev/shm/") and not direct
        assert m.stats()["leases"] == 1
        with open(path, "r+b") as f:
            f.seek(off + size - 100)
            byte = f.read(1)
            f.seek(off + size - 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    finally:
        os.close(fd)                                      # closing the descriptor ends the lease
    # the kernel sends FUSE_RELEASE after close(2) returns: poll with a deadline
    wait_for(lambda: m.stats()["leases"] == 0, 30, "the lease to be released")
    with pytest.raises(kvfs.kv.block.ChecksumMismatch):
        cache.load(toks)
    with pytest.raises(kvfs.kv.block.ChecksumMismatch):         # layer by layer too
        list(cache.load_layers(toks, out))
    with pytest.raises(kvfs.kv.block.ChecksumMismatch):         # a strided destination too
        cache.load_into(toks[:16 * 5], strided)
    cache.close()


@pytest.mark.parametrize("fast_path", [True, False])
def test_strided_destination_fills_through_host_chunks(kvfs_mount, monkeypatch, fast_path):
    """A destination that is not contiguous CPU memory (a strided view here; a CUDA tensor on
    a GPU node) is filled through host chunks of a few blocks, read in place by the readers
    and copied out one chunk at a time: 2-block chunks make 7 blocks take four chunks through
    three buffers, so a buffer is reused while others are being read."""
    monkeypatch.setattr(kvfs.kv.loader, "CHUNK_BYTES", 2 * LLAMA.block_bytes)
    m = kvfs_mount(ram="256MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=LLAMA, fast_path=fast_path)
    toks = _tokens(16 * 7, 21)
    kv = _kv(LLAMA, len(toks), 22)
    cache.save(toks, kv, wait=True)
    for trial in range(2):
        strided = torch.zeros(kv.shape[:2] + (16 * 9,) + kv.shape[3:], dtype=kv.dtype)[:, :, 16:16 * 8]
        cache.load_into(toks, strided)
        assert torch.equal(strided, kv)
        assert cache.last_load.sources == ({"ram": 7} if fast_path else {"mount": 7})
    assert m.stats()["leases"] == 0
    cache.close()


def test_lease_protocol_through_the_kernel(kvfs_mount):
    """A request larger than one FUSE write and an answer larger than one FUSE read."""
    m = kvfs_mount()
    lay = kvfs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    cache = kvfs.KVCache(m.path, model="tiny", layout=lay)
    toks = _tokens(16 * 3000, 13)
    cache.save(toks, torch.zeros(lay.block_shape(len(toks)), dtype=torch.float16), wait=True)
    assert cache.lookup(toks) == len(toks)
    k, tiers = cache.lookup_tiers(toks)
    assert k == len(toks) and tiers == ["ram"] * 3000
    from kvfs.kv.blockio import LeaseClient
    lc = LeaseClient(str(m.path), cache.ns_dir)
    rels = [lc.rel(p) for p in cache.block_paths(toks)]
    blocks = lc.acquire(rels)                              # ~210 KiB request, answer 3000 entries
    assert len(blocks) == 3000 and blocks == [None] * 3000   # small objects: no fast path
    assert m.stats()["leases"] == 1
    old = lc.generation
    lc.acquire(rels[:10])                                  # a new lease ends the previous one
    assert m.stats()["leases"] == 1
    lc.release(old)                                        # a late release of the old one: no-op
    assert m.stats()["leases"] == 1
    lc.release(lc.generation)
    assert m.stats()["leases"] == 0
    lc.close()
    os.unlink(cache.block_paths(toks)[1234])
    assert cache.lookup(toks) == 1234 * 16
    cache.close()


def test_ram_tier_on_a_huge_page_tmpfs(kvfs_mount, tmp_path):
    """``shm_dir`` on a tmpfs mounted with huge pages (faster copies out of the RAM tier, see
    docs/operations.md): the fast path serves blocks from there, verified."""
    shm = tmp_path / "shm"
    shm.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=256m", "kvfs-test-shm", str(shm)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        cfg = tmp_path / "huge.toml"
        cfg.write_text(f'[kvfs]\nshm_dir = "{shm}"\n')
        m = kvfs_mount("--config", cfg, ram="128MiB")
        cache = kvfs.KVCache(m.path, model="m", layout=LLAMA)
        toks = _tokens(16 * 4, 31)
        kv = _kv(LLAMA, len(toks), 32)
        cache.save(toks, kv, wait=True)
        assert torch.equal(cache.load(toks), kv) and cache.last_load.sources == {"ram": 4}
        lc = cache._loader.leases
        blocks = lc.acquire([lc.rel(p) for p in cache.block_paths(toks)])
        assert all(b.path.startswith(str(shm) + "/kvfs-") for b in blocks)
        lc.release()
        assert "huge pages: within_size" in (m.state / "kvfs.log").read_text()
        cache.close()
    finally:
        subprocess.run(["umount", "-l", str(shm)], capture_output=True)


def test_nvme_fast_path_catches_a_damaged_object(kvfs_mount, tmp_path):
    """O_DIRECT blocks are copied out of staging and hashed run by run: a flipped byte in the
    NVMe tier's object file is a ChecksumMismatch, never bytes in the result."""
    cfg = tmp_path / "nopromote.toml"
    cfg.write_text("[kvfs]\npromote_hits = 1000000\n")          # blocks stay on NVMe when read
    m = kvfs_mount("--config", cfg, ram="4MiB", nvme_size="256MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=LLAMA)
    toks = _tokens(16 * 6, 41)
    kv = _kv(LLAMA, len(toks), 42)
    cache.save(toks, kv, wait=True)
    paths = cache.block_paths(toks)
    # RAM holds one 2 MiB block at most: background demotion moves the others
    wait_for(lambda: [os.getxattr(p, "user.kvfs.tier").decode() for p in paths].count("nvme") >= 5, 60,
             "blocks to move to NVMe", interval=0.05)
    out = kvfs.gpu.host_empty(LLAMA.block_shape(len(toks)), LLAMA.torch_dtype)
    cache.load_into(toks, out)
    assert torch.equal(out, kv) and cache.last_load.sources.get("nvme", 0) >= 5
    lc = cache._loader.leases
    b = next(b for b in lc.acquire([lc.rel(p) for p in paths]) if b is not None and b.tier == "nvme")
    lc.release()
    assert b.direct
    with open(b.path, "r+b") as f:
        f.seek(b.offset + b.size - 5000)
        byte = f.read(1)
        f.seek(b.offset + b.size - 5000)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(kvfs.kv.block.ChecksumMismatch, match="nvme tier"):
        cache.load_into(toks, out)
    cache.close()


def _settled(m) -> bool:
    return bool(m.stats()["settled"])


def test_lookup_hold_keeps_blocks_through_eviction_until_the_load(kvfs_mount):
    """Issue 11 item 10: ``lookup(..., hold=True)`` leases what it found; eviction pressure
    between the lookup and the load cannot take those blocks. A twin chain looked up the same
    way (same hits) but released at once is evicted by the same pressure: the hold, not heat,
    is what keeps the held one."""
    m = kvfs_mount(ram="4MiB", nvme_size="16MiB")
    cache = kvfs.KVCache(m.path, model="m", layout=BIG)        # 256 KiB blocks
    held_toks, twin_toks = _tokens(16 * 8, 40), _tokens(16 * 8, 41)
    held_kv, twin_kv = _kv(BIG, len(held_toks), 40), _kv(BIG, len(twin_toks), 41)
    cache.save(twin_toks, twin_kv, wait=True)
    cache.save(held_toks, held_kv, wait=True)
    hold = cache.lookup(held_toks, hold=True)
    twin = cache.lookup(twin_toks, hold=True)
    assert (hold.tokens, hold.blocks, hold.held) == (len(held_toks), 8, True)
    assert twin.tokens == len(twin_toks)
    twin.release()
    assert m.stats()["leases"] == 1
    # pressure: 4x the NVMe budget of other chains, each saved to completion
    for i in range(32):
        toks = _tokens(16 * 8, 1000 + i)
        cache.save(toks, _kv(BIG, len(toks), 1000 + i), wait=True)
    wait_for(lambda: _settled(m), 120, "the store to settle")
    st = m.stats()
    assert st["tiers"]["nvme"]["evictions"] > 0
    assert cache.lookup(twin_toks) < len(twin_toks), "the pressure evicted nothing of the unheld twin"
    out = cache.load(held_toks, hold=hold)                     # releases the hold
    assert torch.equal(out, held_kv)
    assert not hold.held and m.stats()["leases"] == 0
    with pytest.raises(ValueError, match="released"):
        cache.load(held_toks, hold=hold)
    cache.close()


def test_lookup_hold_api_edges(kvfs_mount, tmp_path):
    m = kvfs_mount()
    cache = kvfs.KVCache(m.path, model="m", layout=SMALL)
    toks = _tokens(16 * 4, 50)
    kv = _kv(SMALL, len(toks), 50)
    cache.save(toks, kv, wait=True)
    with cache.lookup(toks + _tokens(32, 51), hold=True) as h:     # 4 of 6 blocks cached
        assert (h.tokens, h.blocks) == (64, 4) and h.held
        with pytest.raises(ValueError, match="prefix"):
            cache.load(_tokens(64, 52), hold=h)                 # other tokens: refused...
        assert not h.held                                       # ...and the hold released
    with cache.lookup(toks, hold=True) as h:
        out = torch.empty(SMALL.block_shape(32), dtype=SMALL.torch_dtype)
        cache.load_into(toks[:32], out, hold=h)                 # a shorter prefix of the hold
        assert torch.equal(out, kv[:, :, :32])
    with cache.lookup(toks, hold=True) as h:
        out = torch.empty(SMALL.block_shape(64), dtype=SMALL.torch_dtype)
        assert list(cache.load_layers(toks, out, hold=h)) == list(range(SMALL.num_layers))
        assert torch.equal(out, kv) and not h.held
    assert m.stats()["leases"] == 0
    assert cache.lookup([1] * 64, hold=True).tokens == 0
    cache.close()
    # a plain directory: nothing to hold, the answer is the plain lookup's
    (tmp_path / "plain").mkdir()
    with kvfs.KVCache(tmp_path / "plain", model="m", layout=SMALL) as plain:
        plain.save(toks, kv, wait=True)
        h = plain.lookup(toks, hold=True)
        assert (h.tokens, h.held) == (64, False)
        assert torch.equal(plain.load(toks, hold=h), kv)


def test_save_then_normal_exit_keeps_every_block_through_commit(kvfs_mount):
    """KVCache.save on kvfs goes through .kvfs/commit; queued saves still land at exit."""
    from support.kv import LAYOUT, _run_exit_child, assert_exit_child_saves_read_back
    m = kvfs_mount()
    with kvfs.KVCache(m.path, model="test/model", layout=LAYOUT) as c:
        assert c._writer._commit is not None, "the writer does not use .kvfs/commit on a kvfs mount"
    n = 30
    res = _run_exit_child(m.path, n, 120.0, release=True)
    assert res.returncode == 0, res.stderr
    assert f"unwritten {4 * n}" in res.stdout, res.stdout
    assert "unwritten" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert_exit_child_saves_read_back(m.path, n)
    ns = [d for d in os.listdir(m.path) if not d.startswith(".")]
    leftover = [f for d, _, fs in os.walk(m.path / ns[0]) for f in fs if f.startswith(".kvfs-commit")]
    assert leftover == []


def test_cache_opening_as_the_mount_dies_writes_nothing_under_it(kvfs_mount, monkeypatch):
    """The daemon killed and its mount detached after KVCache found the root on kvfs but
    before it made the namespace directory: the cache does not open, and nothing is made under
    the bare mount point (the namespace and its namespace.json once landed on the disk below,
    and the cache saved blocks there as a plain directory)."""
    import kvfs.kv.layout as layout
    from support.kv import LAYOUT
    m = kvfs_mount()
    real, killed = layout.find_control, []

    def then_killed(path):
        ctl = real(path)
        if not killed:
            killed.append(ctl is not None)
            m.kill9()                    # the daemon dies right after it was found
        return ctl
    monkeypatch.setattr(layout, "find_control", then_killed)
    with pytest.raises(OSError):
        kvfs.KVCache(m.path, model="test/model", layout=LAYOUT)
    assert killed == [True] and not os.path.ismount(m.path)


def test_save_as_the_mount_dies_writes_nothing_under_it(kvfs_mount, monkeypatch):
    """The daemon killed (mount detached) as the writer sends its commit: the blocks the
    commit could not publish go through the mount root's descriptor and fail, instead of
    making the namespace's directories and block files under the bare mount point."""
    from kvfs.kv.commit import CommitClient
    from kvfs.kv.writer import SaveError
    m = kvfs_mount()
    real, killed = CommitClient.commit, []

    def killed_first(self, *args, **kw):
        if not killed:
            killed.append(1)
            m.kill9()
        return real(self, *args, **kw)
    monkeypatch.setattr(CommitClient, "commit", killed_first)
    c = kvfs.KVCache(m.path, model="test/model", layout=SMALL, save_timeout=None)
    toks = list(range(64))
    c.save(toks, _kv(SMALL, 64, 1))
    with pytest.raises(SaveError):
        c.flush()
    assert killed and not os.path.ismount(m.path) and os.listdir(m.path) == []
    try:
        c.close()
    except (SaveError, OSError):
        pass
    assert os.listdir(m.path) == []


def test_save_sends_blocks_by_address(kvfs_mount):
    """The writer names each block's header and payload by address (``\\0mem``): nothing is
    copied into the commit client's memfd, and the blocks read back whole."""
    m = kvfs_mount()
    toks = _tokens(160, 8)
    kv = _kv(SMALL, 160, 9)
    with kvfs.KVCache(m.path, model="m", layout=SMALL) as cache:
        cache.save(toks, kv, wait=True)
        commit = cache._writer._commit
        assert commit is not None and commit.use_memory
        assert all(lane.size == 0 for lane in commit._lanes), "a block was copied into the memfd"
        assert cache.lookup(toks) == 160
        assert torch.equal(cache.load(toks), kv)
