"""Loader throughput into GPU memory versus torch's pinned host-to-device copy limit, in one run.

    python benchmarks/gpu_load.py MOUNT_OR_DIR [--blocks 64] [--runs 5] [--json out.json]

Measures, on a CUDA machine: (1) the H2D limit, a pinned host tensor copied to the device;
(2) KVCache.load_into a CUDA tensor with the fast path; (3) with the fast path off (through
the mount); (4) layer-by-layer loading; (5) GDS through kvikio when installed (reads the
backing files straight into device memory; verification off, so it is reported apart).
Exits with a clear message when CUDA is not available.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def median_time(fn, runs, sync):
    fn()
    sync()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def raw_shm_read(lay, args, nbytes: int) -> dict:
    """The read side's physical floor: the same bytes as block-sized files in /dev/shm, read with
    os.preadv by 1, 4 and 16 threads into one page-aligned buffer (no checksum, no FUSE)."""
    import mmap
    import os
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    d = tempfile.mkdtemp(prefix="kvfs-gpu-raw-", dir="/dev/shm")
    try:
        size = lay.block_bytes
        chunk = os.urandom(1 << 20) * (size // (1 << 20) + 1)
        paths = []
        for i in range(args.blocks):
            p = os.path.join(d, f"b{i}")
            with open(p, "wb") as f:
                f.write(chunk[:size])
            paths.append(p)
        buf = mmap.mmap(-1, size * args.blocks)
        mv = memoryview(buf)

        def read(i):
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [mv[i * size:(i + 1) * size]], 0)
            finally:
                os.close(fd)
        out = {}
        for threads in (1, 4, 16):
            with ThreadPoolExecutor(threads) as pool:
                t = median_time(lambda: list(pool.map(read, range(args.blocks))), args.runs, lambda: None)
            out[str(threads)] = nbytes / t / 1e9
        mv.release()
        buf.close()
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="a kvfs mount (or a directory) to store the blocks in")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", default="", help="also measure the fast path with these reader counts "
                    "and staging buffers, e.g. 4x8,16x32 (readers x staging)")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_load.py: CUDA is not available on this machine; nothing to measure "
              "(the CPU path is covered by tests/kv and benchmarks/kv_bench.py)", file=sys.stderr)
        return 2
    import kvfs
    from kvfs import gpu
    from kvfs.kv.blockio import backing_info
    import os
    lay = kvfs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_tokens=16)
    n_tok = 16 * args.blocks
    toks = torch.randint(0, 128000, (n_tok,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = torch.randn(lay.block_shape(n_tok)).to(torch.bfloat16)
    nbytes = args.blocks * lay.block_bytes
    sync = torch.cuda.synchronize
    res = {"device": torch.cuda.get_device_name(0), "bytes": nbytes}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res["h2d_pinned_gbps"] = nbytes / median_time(lambda: dev.copy_(host, non_blocking=True), args.runs, sync) / 1e9
    del host, dev
    out = torch.empty(lay.block_shape(n_tok), dtype=lay.torch_dtype, device="cuda")
    for name, fast in (("fast_path", True), ("through_mount", False)):
        with kvfs.KVCache(args.root, "bench/gpu-load", lay, fast_path=fast) as cache:
            cache.save(toks, kv, wait=True)
            t = median_time(lambda: cache.load_into(toks, out), args.runs, sync)
            assert torch.equal(out.cpu(), kv)
            res[f"{name}_gbps"] = nbytes / t / 1e9
            res[f"{name}_sources"] = dict(cache.last_load.sources)
            if fast:
                host_out = gpu.host_empty(lay.block_shape(n_tok), lay.torch_dtype)
                t = median_time(lambda: cache.load_into(toks, host_out), args.runs, sync)
                res["cpu_destination_gbps"] = nbytes / t / 1e9     # the read side alone
                del host_out
                t = median_time(lambda: [None for _ in cache.load_layers(toks, out)], args.runs, sync)
                res["layer_by_layer_gbps"] = nbytes / t / 1e9
                if gpu.kvikio_available():
                    flat = torch.empty(lay.block_bytes + 4096, dtype=torch.uint8, device="cuda")

                    def gds():
                        for p in cache.block_paths(toks):
                            fd = os.open(p, os.O_RDONLY)
                            try:
                                b = backing_info(fd)
                                gpu.gds_read(b.path if b else p, flat, b.offset if b else 0, b.size if b else os.fstat(fd).st_size)
                            finally:
                                os.close(fd)
                    res["gds_unverified_gbps"] = nbytes / median_time(gds, args.runs, sync) / 1e9
                else:
                    res["gds_unverified_gbps"] = None
    res["raw_shm_read_gbps"] = raw_shm_read(lay, args, nbytes)
    sweep = [tuple(map(int, c.split("x"))) for c in args.sweep.split(",") if c]
    for readers, staging in sweep:
        with kvfs.KVCache(args.root, "bench/gpu-load", lay, readers=readers, staging=staging) as cache:
            t = median_time(lambda: cache.load_into(toks, out), args.runs, sync)
            tl = median_time(lambda: [None for _ in cache.load_layers(toks, out)], args.runs, sync)
            res.setdefault("sweep", {})[f"{readers}x{staging}"] = {
                "fast_path_gbps": nbytes / t / 1e9, "layer_by_layer_gbps": nbytes / tl / 1e9}
    for k in ("fast_path", "through_mount", "layer_by_layer"):
        res[f"{k}_vs_h2d"] = res[f"{k}_gbps"] / res["h2d_pinned_gbps"]
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
