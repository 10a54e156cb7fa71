"""The KV layer with CUDA tensors: loads into device memory (whole, layer by layer, through a
real mount and a plain directory), saves from device memory, stream ordering both ways.

Needs a CUDA device: on a machine without one (CI here) the module is skipped as a whole;
benchmarks/cuda_check.sh runs it with benchmarks/gpu_load.py on a GPU node.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import kvfs  # noqa: E402
from kvfs.kv.block import ChecksumMismatch  # noqa: E402
from support.kv import LAYOUT  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine (run benchmarks/cuda_check.sh on a GPU node)",
                allow_module_level=True)

pytestmark = [pytest.mark.torch, pytest.mark.cuda]
REPO = Path(__file__).resolve().parents[2]
# 1 MiB per block: big enough that a copy outlasts a launch, small enough for a quick test
BIG = kvfs.KVLayout(num_layers=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, block_tokens=32)


def _kv(layout, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape(tokens), generator=g).to(layout.torch_dtype)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=["mount", "dir"])
def root(request, tmp_path):
    if request.param == "dir":
        return tmp_path
    m = request.getfixturevalue("kvfs_mount")(ram="256MiB")
    return m.path


@pytest.mark.parametrize("fast_path", [True, False])
def test_load_into_a_cuda_tensor_equals_what_was_saved(root, fast_path):
    toks, kv = _tokens(8 * 32, 1), _kv(BIG, 8 * 32, 1)
    with kvfs.KVCache(root, "cuda/load", BIG, fast_path=fast_path) as cache:
        cache.save(toks, kv, wait=True)
        out = torch.zeros(BIG.block_shape(len(toks)), dtype=BIG.torch_dtype, device="cuda")
        stats = cache.load_into(toks, out)
        assert stats.blocks == 8
        assert torch.equal(out.cpu(), kv)
        got = cache.load(toks, device="cuda:0")
        assert got.device.type == "cuda" and torch.equal(got.cpu(), kv)
        # the host buffers the copies came from (per-block staging for a plain directory's
        # xattr path, chunks otherwise) are page-locked: asynchronous H2D
        bufs = cache._loader._bufs + cache._loader._chunks
        assert bufs and all(b.pinned for b in bufs)


def test_load_into_waits_for_work_already_queued_on_out(root):
    """A runtime reuses its KV buffer: kernels queued on the current stream that still read
    ``out`` must see the old contents, the load's copies land after them."""
    toks, kv = _tokens(4 * 32, 2), _kv(BIG, 4 * 32, 2)
    with kvfs.KVCache(root, "cuda/order", BIG) as cache:
        cache.save(toks, kv, wait=True)
        out = torch.zeros(BIG.block_shape(len(toks)), dtype=BIG.torch_dtype, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU time on the current stream
        before = out.clone()                     # queued behind the sleep: must read zeros
        cache.load_into(toks, out)
        after = out.clone()                      # ordered after the load by finish()
        torch.cuda.synchronize()
        assert not before.any(), "the load overwrote a buffer the current stream was still reading"
        assert torch.equal(after.cpu(), kv)


def test_load_layers_publishes_each_layer_to_the_current_stream(root):
    toks, kv = _tokens(6 * 32, 3), _kv(BIG, 6 * 32, 3)
    with kvfs.KVCache(root, "cuda/layers", BIG) as cache:
        cache.save(toks, kv, wait=True)
        out = torch.zeros(BIG.block_shape(len(toks)), dtype=BIG.torch_dtype, device="cuda")
        seen = []
        for layer in cache.load_layers(toks, out):
            # no synchronize: this kernel is ordered only by the event the loader published
            seen.append((layer, out[layer].clone()))
        torch.cuda.synchronize()
        assert [layer for layer, _ in seen] == list(range(BIG.num_layers))
        for layer, snap in seen:
            assert torch.equal(snap.cpu(), kv[layer]), f"layer {layer} was not in place when yielded"


def test_save_from_a_cuda_tensor_snapshots_it(root):
    """``save`` of device memory takes the values at the call: a kernel that overwrites the
    tensor right after (same stream) does not reach the saved blocks."""
    toks, kv = _tokens(8 * 32, 4), _kv(BIG, 8 * 32, 4)
    dev = kv.cuda()
    with kvfs.KVCache(root, "cuda/save", BIG) as cache:
        res = cache.save(toks, dev)
        dev.zero_()
        res.wait()
        cache.flush()
        assert cache.lookup(toks) == len(toks)
        assert torch.equal(cache.load(toks), kv)


def test_a_damaged_block_is_an_error_not_wrong_bytes_on_the_device(tmp_path):
    toks, kv = _tokens(2 * 32, 5), _kv(BIG, 2 * 32, 5)
    with kvfs.KVCache(tmp_path, "cuda/bad", BIG) as cache:
        cache.save(toks, kv, wait=True)
        path = cache.block_paths(toks)[1]
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            f.write(b"\xff" * 8)
        out = torch.zeros(BIG.block_shape(len(toks)), dtype=BIG.torch_dtype, device="cuda")
        with pytest.raises(ChecksumMismatch):
            cache.load_into(toks, out)


_EXIT_CHILD = r"""
import sys, torch, kvfs
lay = kvfs.KVLayout(num_layers=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, block_tokens=32)
cache = kvfs.KVCache(sys.argv[1], "cuda/exit", lay)
for i in range(8):
    g = torch.Generator().manual_seed(100 + i)
    toks = torch.randint(0, 128000, (4 * 32,), generator=g).tolist()
    kv = torch.randn(lay.block_shape(len(toks)), generator=g).to(lay.torch_dtype).cuda()
    cache.save(toks, kv)
# a normal exit with the saves still queued: they must be written before the process ends
"""


def test_saves_from_device_memory_survive_a_normal_exit(root):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(root)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    with kvfs.KVCache(root, "cuda/exit", BIG) as cache:
        for i in range(8):
            g = torch.Generator().manual_seed(100 + i)
            toks = torch.randint(0, 128000, (4 * 32,), generator=g).tolist()
            kv = torch.randn(BIG.block_shape(len(toks)), generator=g).to(BIG.torch_dtype)
            assert cache.lookup(toks) == len(toks), f"prompt {i} lost at exit"
            assert torch.equal(cache.load(toks, device="cuda").cpu(), kv)
