"""KVCache on a plain directory: save, lookup, load (whole and layer by layer), errors."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

torch = pytest.importorskip("torch")
import xxhash  # noqa: E402
from safetensors import safe_open  # noqa: E402

import kvfs  # noqa: E402
from kvfs.kv.block import ChecksumMismatch  # noqa: E402
from kvfs.blockformat import BlockFormatError  # noqa: E402
from kvfs.kv.loader import BlockNotFound  # noqa: E402
from kvfs.kv.writer import BlockWriter, SaveError, SaveJob  # noqa: E402
from support.kv import LAYOUT, _run_exit_child, assert_exit_child_saves_read_back  # noqa: E402

pytestmark = pytest.mark.torch


def _kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.block_shape(tokens), generator=g).to(LAYOUT.torch_dtype)


@pytest.fixture
def cache(tmp_path):
    c = kvfs.KVCache(tmp_path, model="test/model", layout=LAYOUT)
    yield c
    c.close()


def test_save_lookup_load_roundtrip(cache):
    toks = list(range(1000, 1100))           # 6 whole blocks + 4 tokens
    kv = _kv(100)
    assert cache.lookup(toks) == 0
    res = cache.save(toks, kv, wait=True)
    assert (res.blocks, res.present, res.queued, res.dropped) == (6, 0, 6, 0)
    assert cache.lookup(toks) == 96
    assert cache.lookup(toks[:50]) == 48
    assert cache.lookup(toks[:40] + [1] * 60) == 32
    assert cache.lookup([7] * 64) == 0
    assert torch.equal(cache.load(toks[:96]), kv[:, :, :96])
    out = torch.empty(LAYOUT.block_shape(64), dtype=LAYOUT.torch_dtype)
    stats = cache.load_into(toks[:64], out)
    assert torch.equal(out, kv[:, :, :64]) and stats.blocks == 4 and stats.sources == {"mount": 4}
    assert not cache.one_call_lookup      # a plain directory: stat fallback


def test_block_files_are_safetensors(cache):
    toks = list(range(64))
    kv = _kv(64)
    cache.save(toks, kv, wait=True)
    for i, path in enumerate(cache.block_paths(toks)):
        with open(path, "rb") as f:
            assert len(f.read(4096)) == 4096
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            assert torch.equal(f.get_tensor("kv"), kv[:, :, 16 * i:16 * (i + 1)])
        assert meta["kvfs.tokens"] == str(16 * (i + 1))
        assert meta["kvfs.token_ids"] == ",".join(map(str, toks[16 * i:16 * (i + 1)]))
        assert meta["kvfs.parent"] == ("" if i == 0 else cache.block_hashes(toks)[i - 1])
    assert not [n for d, _, fs in os.walk(cache.ns_dir) for n in fs if n.endswith(".tmp")]


def test_save_skips_present_blocks_and_shares_prefixes(cache):
    shared = list(range(500, 564))            # 4 blocks
    a, b = shared + [1] * 32, shared + [2] * 32
    kv_a, kv_b = _kv(96, 1), _kv(96, 2)
    cache.save(a, kv_a, wait=True)
    res = cache.save(b, kv_b, wait=True)
    assert (res.present, res.queued) == (4, 2)
    assert cache.save_statistics().written == 8
    # the shared blocks hold a's KV (first writer wins), b's own tail is b's
    assert torch.equal(cache.load(b)[:, :, 64:], kv_b[:, :, 64:])
    assert torch.equal(cache.load(b)[:, :, :64], kv_a[:, :, :64])


def test_salted_tenants_share_nothing(tmp_path):
    toks = list(range(64))
    with kvfs.KVCache(tmp_path, "m", LAYOUT, cache_salt="a") as a, kvfs.KVCache(tmp_path, "m", LAYOUT, cache_salt="b") as b:
        a.save(toks, _kv(64), wait=True)
        assert a.lookup(toks) == 64 and b.lookup(toks) == 0
        with pytest.raises(BlockNotFound):
            b.load(toks)


def test_layer_by_layer_load(cache):
    toks = list(range(80))
    kv = _kv(80)
    cache.save(toks, kv, wait=True)
    out = torch.zeros(LAYOUT.block_shape(80), dtype=LAYOUT.torch_dtype)
    seen = []
    for layer in cache.load_layers(toks, out):
        assert torch.equal(out[layer], kv[layer])      # ready when yielded
        seen.append(layer)
    assert seen == list(range(LAYOUT.num_layers)) and torch.equal(out, kv)


def test_missing_and_evicted_blocks(cache):
    toks = list(range(96))
    cache.save(toks, _kv(96), wait=True)
    os.unlink(cache.block_paths(toks)[2])        # evicted from the middle
    assert cache.lookup(toks) == 32
    with pytest.raises(BlockNotFound, match="not cached"):
        cache.load(toks)
    with pytest.raises(BlockNotFound):
        list(cache.load_layers(toks, torch.empty(LAYOUT.block_shape(96), dtype=LAYOUT.torch_dtype)))
    assert torch.equal(cache.load(toks[:32]), cache.load(toks[:32]))


def test_corrupt_payload_is_an_error_not_wrong_bytes(cache):
    toks = list(range(32))
    cache.save(toks, _kv(32), wait=True)
    path = cache.block_paths(toks)[1]
    with open(path, "r+b") as f:
        f.seek(4096 + LAYOUT.layer_bytes * 2 + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumMismatch, match="layer 2"):
        cache.load(toks)
    out = torch.empty(LAYOUT.block_shape(32), dtype=LAYOUT.torch_dtype)
    with pytest.raises(ChecksumMismatch):
        list(cache.load_layers(toks, out))
    os.truncate(path, 4096 + 1000)
    with pytest.raises(BlockFormatError, match="bytes"):
        cache.load(toks)
    with open(path, "wb") as f:
        f.write(b"not a block at all")
    with pytest.raises(BlockFormatError, match="not a kvfs-block-v1"):
        cache.load(toks)


def _set_backing(path: str, backing: str, *, size=None, checksum=None, tier="nvme"):
    data = open(backing, "rb").read()
    doc = {"tier": tier, "path": backing, "offset": 0, "size": len(data) if size is None else size,
           "checksum": checksum or f"{xxhash.xxh3_64_intdigest(data):016x}", "direct": tier == "nvme"}
    os.setxattr(path, "user.kvfs.backing", json.dumps(doc).encode())


def test_fast_path_reads_backing_file_and_verifies(tmp_path, cache):
    """The daemon's fast-path protocol, served by real user xattrs on a real directory."""
    toks = list(range(64))
    kv = _kv(64)
    cache.save(toks, kv, wait=True)
    backing_dir = tmp_path / "backing"
    backing_dir.mkdir()
    paths = cache.block_paths(toks)
    for i, p in enumerate(paths):
        b = str(backing_dir / f"b{i}")
        shutil.copyfile(p, b)
        try:
            _set_backing(p, b)
        except OSError as e:
            pytest.skip(f"this filesystem has no user xattrs: {e}")
        with open(p, "r+b") as f:     # the mount copy differs: proves the backing copy is read
            f.seek(4096)
            f.write(b"\0" * 64)
    assert torch.equal(cache.load(toks), kv)
    assert cache.last_load.sources == {"nvme": 4}
    out = torch.empty_like(kv)
    assert list(cache.load_layers(toks, out)) == [0, 1, 2, 3] and torch.equal(out, kv)
    # a wrong checksum from the daemon: an error, never the bytes
    _set_backing(paths[1], str(backing_dir / "b1"), checksum="0123456789abcdef")
    with pytest.raises(ChecksumMismatch, match="nvme tier"):
        cache.load(toks)
    # backing gone (the lease was not honoured): fall back to the mount, whose bytes are bad here
    _set_backing(paths[1], str(backing_dir / "b1"))
    os.unlink(backing_dir / "b1")
    with pytest.raises(ChecksumMismatch):
        cache.load(toks)
    # with fast_path off the (damaged) mount copy is read and caught
    with kvfs.KVCache(tmp_path, model="test/model", layout=LAYOUT, fast_path=False) as slow:
        with pytest.raises(ChecksumMismatch):
            slow.load(toks[:16])


def test_writer_bound_drops_instead_of_blocking(tmp_path):
    writer = BlockWriter(str(tmp_path), "ns", LAYOUT, "sha256_cbor", max_pending=1)
    entered, release = threading.Event(), threading.Event()

    def blocked():
        entered.set()
        release.wait()

    payload = _kv(16)[None].contiguous()

    def job(h, ready=None):
        return SaveJob(hashes=[h], parents=[""], first=0, token_ids=[list(range(16))],
                       payload=lambda j: payload[j].view(torch.uint8).numpy(), ready=ready)

    assert writer.submit(job("aa" * 16, blocked), timeout=1.0)
    entered.wait()
    assert writer.submit(job("bb" * 16), timeout=1.0)            # fills the queue
    assert not writer.submit(job("cc" * 16), timeout=0.01)       # would block: dropped
    assert writer.statistics().dropped == 1
    release.set()
    writer.flush()
    assert writer.statistics().written == 2
    assert not os.path.exists(os.path.join(tmp_path, "cc", "cc" * 16 + ".kv"))
    writer.close()


def test_background_failure_surfaces_on_flush(cache):
    toks = list(range(32))
    shard = os.path.dirname(cache.block_paths(toks)[0])
    with open(shard, "w") as f:          # a file where the shard directory must go
        f.write("x")
    res = cache.save(toks, _kv(32))
    with pytest.raises(SaveError):
        cache.flush()
    with pytest.raises(OSError):
        res.wait()


def test_concurrent_savers_of_one_prefix(tmp_path):
    toks = list(range(320))
    kv = _kv(320)
    caches = [kvfs.KVCache(tmp_path, "m", LAYOUT) for _ in range(4)]
    threads = [threading.Thread(target=c.save, args=(toks, kv), kwargs={"wait": True}) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in caches:
        c.flush()
    assert sum(c.save_statistics().written for c in caches) >= 20
    assert torch.equal(caches[0].load(toks), kv)
    for c in caches:
        c.close()


def test_bad_arguments(cache):
    toks = list(range(32))
    with pytest.raises(ValueError, match="num_layers"):
        cache.save(toks, torch.zeros(3, 2, 32, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        cache.save(toks, torch.zeros(4, 2, 32, 2, 64))
    with pytest.raises(ValueError, match="covers"):
        cache.save(toks, _kv(16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.save(toks, [[0]])
    with pytest.raises(ValueError, match="whole blocks"):
        cache.load(toks[:20])
    with pytest.raises(ValueError, match="shape"):
        cache.load_into(toks, torch.empty(4, 2, 16, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="CUDA"):
        if torch.cuda.is_available():
            pytest.skip("CUDA is present")
        cache.load(toks, device="cuda:0")
    with pytest.raises(TypeError, match="KVLayout"):
        kvfs.KVCache(cache.root, "m", layout={"num_layers": 1})
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.lookup(toks)


def test_shared_memory_object_verified_once_until_its_file_changes(tmp_path):
    """``verify_shm="once"``: a RAM-tier object is hashed the first time it is read and trusted
    afterwards only while its tmpfs file is the same (inode, size, mtime, ctime)."""
    from kvfs.kv.blockio import AlignedBuffer, Backing, VerifiedObjects, read_backing, read_backing_into
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"kvfs-test-verified-{os.getpid()}")
    data = bytes(range(256)) * 64                     # 4 KiB header + 12 KiB payload
    with open(path, "wb") as f:
        f.write(data)
    try:
        good = Backing("ram", path, 0, len(data), f"{xxhash.xxh3_64_intdigest(data):016x}", False)
        head, body = AlignedBuffer(4096), AlignedBuffer(3 * 4096)
        segs = [body.mv[i * 4096:(i + 1) * 4096] for i in range(3)]
        cuts = [(0, 2, 8192), (2, 3, 4096)]
        seen = VerifiedObjects()
        assert read_backing_into(good, head.mv, segs, cuts, verified=seen) == len(data)
        assert bytes(head.mv) + bytes(body.mv) == data and len(seen) == 1
        # trusted while unchanged: one read, no hash (a wrong checksum recorded as verified
        # is not noticed -- which is what "trusted" means)
        wrong = Backing("ram", path, 0, len(data), "0123456789abcdef", False)
        with open(path, "rb") as f:
            seen.add(VerifiedObjects.key(wrong, os.fstat(f.fileno())))
        assert read_backing_into(wrong, head.mv, segs, cuts, verified=seen) == len(data)
        # any write through the file API changes its times: hashed again, the damage caught
        with open(path, "r+b") as f:
            f.seek(5000)
            f.write(b"\xff")
        with pytest.raises(ChecksumMismatch, match="ram tier"):
            read_backing_into(good, head.mv, segs, cuts, verified=seen)
        with pytest.raises(ChecksumMismatch):
            read_backing(good, AlignedBuffer(len(data)).mv, verified=seen)
        # without the set every read is hashed
        with pytest.raises(ChecksumMismatch):
            read_backing_into(wrong, head.mv, segs, cuts)
    finally:
        os.unlink(path)
    with pytest.raises(ValueError, match="verify_shm"):
        kvfs.KVCache(tmp_path, model="m", layout=LAYOUT, verify_shm="sometimes")
    with kvfs.KVCache(tmp_path, model="m", layout=LAYOUT, verify_shm="always") as c:
        assert c._loader.verified is None


# -- exit safety (issue 11 item 10) ----------------------------------------------------------


def test_queued_saves_are_written_before_a_normal_exit(tmp_path):
    n = 50                                    # 50 prompts x 4 blocks, all queued at exit
    res = _run_exit_child(tmp_path, n, 120.0, release=True)
    assert res.returncode == 0, res.stderr
    assert f"unwritten {4 * n}" in res.stdout, res.stdout   # nothing was written before exit
    assert "unwritten" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert_exit_child_saves_read_back(tmp_path, n)


def test_exit_is_bounded_and_warns_with_the_unwritten_count(tmp_path):
    res = _run_exit_child(tmp_path, 5, 0.2, release=False)     # the writer never gets going
    assert res.returncode == 0, res.stderr
    assert "unwritten 20" in res.stdout
    assert "exiting with 20 KV blocks" in res.stderr and "still unwritten" in res.stderr, res.stderr
