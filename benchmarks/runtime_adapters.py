"""Runtime storage backends on a plain directory and on kvfs, driven by the runtimes' own code.

    python benchmarks/runtime_adapters.py [--pages 1000] [--runs 3] [--json out.json]
                                          [--runtimes sglang,vllm,lmcache] [--sizes "2 MiB,256 KiB"]
                                          [--write-docs docs/benchmarks.md] [--workdir DIR]
                                          [--from-json saved.json]

For each runtime (SGLang 0.5.23, vLLM 0.33.0, LMCache 0.5.6: their released storage layers,
tests/support/released.py), in one run, three rows: the runtime's own file backend on a
plain directory, the same backend on a kvfs mount, and the kvfs adapter on the mount. vLLM
and LMCache rows: benchmarks/runtime_rows.py. For SGLang:

* ``file, plain dir``   -- SGLang's own ``HiCacheFile`` on a directory of the host disk
* ``file, kvfs``        -- the same backend on a kvfs mount (plain POSIX calls through FUSE)
* ``kvfs adapter``      -- ``kvfs.integrations.sglang`` on a kvfs mount (lookup + lease)

each driven by SGLang's released cache-controller loops (batches of 128 pages; its generic
page path for ``file``, the zero-copy ``interface_v1`` path for the adapter), a host pool in
SGLang's default ``page_first`` layout, 2 MiB pages (Llama-3.1-8B: 32 layers, 8 KV heads,
dim 128, bf16, 16 tokens) and 256 KiB pages (16 layers, 4 heads, 16 tokens), ``--pages`` pages:

* ``set``             -- the backup of all pages (fresh directory each run)
* ``get after set``   -- the prefetch of all pages right after they were written
* ``get later``       -- the same prefetch again (steady state: pages read before)
* ``exists (hits)``   -- the prefetch thread's hit query over all pages (all present)
* ``exists (miss)``   -- one hit query per absent page (the first page of a new prompt)

Medians of ``--runs`` runs (set and get-after-set: one pair per run); the host pool is
pre-faulted. Every kvfs row reads its pages back and compares them with what was written.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

from support.released import load_lmcache, load_sglang, load_vllm, storage_config  # noqa: E402
from kvfs.bench import BenchMount, warm_memory  # noqa: E402
from runtime_rows import make_rows  # noqa: E402

log = logging.getLogger("runtime_adapters")
BEGIN, END = "<!-- BEGIN runtime_adapters -->", "<!-- END runtime_adapters -->"
PLOT_NAME = "bench_runtime_adapters.png"
# (label, layers, kv heads, head dim, tokens per page): bf16 pages
PAGES = {"2 MiB": (32, 8, 128, 16), "256 KiB": (16, 4, 128, 16)}
POOL_PAGES = 128          # host slots: SGLang's storage batch; pages cycle through them
ROWS = ("file, plain dir", "file, kvfs", "kvfs adapter")
RUNTIMES = {   # runtime -> (title, its rows: own backend on the plain dir, on kvfs, the kvfs adapter)
    "sglang": ("SGLang HiCache", ROWS),
    "vllm": ("vLLM offloading tier", ("fs tier, plain dir", "fs tier, kvfs", "kvfs tier")),
    "lmcache": ("LMCache L2 adapter", ("fs adapter, plain dir", "fs adapter, kvfs", "kvfs adapter")),
}
LOADERS = {"sglang": load_sglang, "vllm": load_vllm, "lmcache": load_lmcache}
OPS = ("set", "get after set", "get later", "exists (hits)", "exists (miss)")
MODULE = {"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage",
          "interface_v1": 1}


class Row:
    """One backend of one runtime, with its controller and host pool."""

    def __init__(self, sg, name: str, directory: Path, geometry, n_pages: int):
        layers, heads, dim, ps = geometry
        self.name, self.sg, self.n = name, sg, n_pages
        self.pool = sg.HostPool(pages=POOL_PAGES, page_size=ps, layer_num=layers, head_num=heads, head_dim=dim,
                                layout="page_first")
        self.pool.kv_buffer.view(torch.uint8).fill_(1)          # pre-fault
        for i in range(POOL_PAGES):
            self.pool.fill(i * ps, i)
        self.want = [self.pool.get_data_page(i * ps, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
                     for i in range(POOL_PAGES)]
        hs = sg.hicache_storage
        if name == "kvfs adapter":
            kind, extra = "dynamic", {**MODULE, "root": str(directory)}
        else:
            kind, extra = "file", {"file_storage_path": str(directory)}
        cfg = storage_config(hs, extra=extra, layout="page_first", model="bench/model")
        self.backend = sg.StorageBackendFactory.create_backend(kind, cfg, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.ctl = sg.Controller(self.backend, self.pool, backend_type=kind, extra_config=extra)
        ps_ = self.pool.page_size
        self.indices = torch.tensor([(i % POOL_PAGES) * ps_ + t for i in range(n_pages) for t in range(ps_)],
                                    dtype=torch.int64)
        self.gen = 0

    def keys(self) -> list[str]:
        return [f"{self.gen:08x}{i:056x}" for i in range(self.n)]

    def set(self) -> float:
        self.backend.clear()
        self.gen += 1
        t0 = time.perf_counter()
        done = self.ctl.on_thread(self.ctl.backup, self.keys(), self.indices, name="hicache-backup")
        dt = time.perf_counter() - t0
        assert done == self.n * self.pool.page_size, f"{self.name}: backup stored {done} tokens"
        return dt

    def get(self) -> float:
        t0 = time.perf_counter()
        got = self.ctl.on_thread(self.ctl.prefetch, "bench", self.keys(), self.indices, name="hicache-io")
        dt = time.perf_counter() - t0
        assert got == self.n, f"{self.name}: prefetch got {got} of {self.n} pages"
        return dt

    def check(self) -> None:
        """The last POOL_PAGES pages read are in the pool slots: compare them with the writes."""
        ps = self.pool.page_size
        for i in range(POOL_PAGES):
            got = self.pool.get_data_page(i * ps, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            assert got == self.want[i], f"{self.name}: page in slot {i} differs from what was written"

    def exists_hits(self) -> float:
        keys = self.keys()
        t0 = time.perf_counter()
        hits = self.ctl.on_thread(self.ctl.hit_query, keys, name="hicache-prefetch")
        dt = time.perf_counter() - t0
        assert len(hits) == self.n
        return dt

    def exists_miss(self) -> float:
        keys = [f"ffffffff{i:056x}" for i in range(self.n)]

        def run():
            for k in keys:
                assert self.ctl.hit_query([k]) == []
        t0 = time.perf_counter()
        self.ctl.on_thread(run, name="hicache-prefetch")
        return time.perf_counter() - t0

    def finish(self, ts: dict) -> dict:
        out = {op: statistics.median(v) for op, v in ts.items()}
        if hasattr(self.backend, "statistics"):
            out["counters"] = self.backend.statistics().__dict__
        self.backend.clear()
        if hasattr(self.backend, "close"):
            self.backend.close()
        return out


def run_rows(rows: list[Row], runs: int, warm=None) -> dict:
    """Each operation on every row in turn (round-robin: all rows see the same machine load);
    ``warm()`` before each set (kvfs.bench.warm_memory: the set's fresh pages are not first-touch)."""
    ts = {r.name: {op: [] for op in OPS} for r in rows}
    for _ in range(runs):
        for r in rows:
            if warm is not None:
                warm()
            ts[r.name]["set"].append(r.set())
            ts[r.name]["get after set"].append(r.get())
    for r in rows:
        r.check()
    for _ in range(runs):
        for r in rows:
            ts[r.name]["get later"].append(r.get())
            ts[r.name]["exists (hits)"].append(r.exists_hits())
            ts[r.name]["exists (miss)"].append(r.exists_miss())
    for r in rows:
        r.check()
    return {r.name: r.finish(ts[r.name]) for r in rows}


def bench(args) -> dict:
    runtimes = [r for r in args.runtimes.split(",") if r]
    mods = {r: LOADERS[r]() for r in runtimes}
    root = Path(tempfile.mkdtemp(prefix="kvfs-adapters-", dir=args.workdir))
    res = {"meta": {"warm": not args.no_warm, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                    "kernel": os.uname().release, "python": sys.version.split()[0], "torch": torch.__version__,
                    "versions": {r: m.version for r, m in mods.items()}, "pages": args.pages, "runs": args.runs,
                    "load": os.getloadavg(), "shm_dir": _shm_desc(args.shm_dir),
                    "ram_mapped_min": args.ram_mapped_min, "passthrough": args.passthrough}}
    try:
        for rt in runtimes:
            res[rt] = {}
            for label, geometry in PAGES.items():
                if args.sizes and label not in args.sizes.split(","):
                    continue
                layers, heads, dim, ps = geometry
                page_bytes = 2 * layers * heads * dim * ps * 2
                # both kvfs rows share one mount: room for two copies of every page
                ram = f"{(2 * args.pages * page_bytes * 9 // 8 >> 20) + 256}MiB"
                t0 = time.monotonic()
                plain = root / f"plain-{rt}-{ps}-{layers}"
                plain.mkdir()
                names = RUNTIMES[rt][1]
                extra = {"shm_dir": str(args.shm_dir)} if args.shm_dir else {}
                if args.ram_mapped_min:
                    extra["ram_mapped_min"] = args.ram_mapped_min
                if args.passthrough is not None:
                    extra["passthrough"] = args.passthrough
                with BenchMount(root / f"m{rt}{layers}", ram=ram, nvme_size="8GiB", promote_hits=None, **extra) as m:
                    res["meta"]["shm_dir"] = _ram_desc(m.path)
                    dirs = {names[0]: plain, names[1]: m.path / f"{rt}-own", names[2]: m.path / f"{rt}-kvfs"}
                    for d in dirs.values():
                        d.mkdir(exist_ok=True)
                    if rt == "sglang":
                        rows = [Row(mods[rt], name, dirs[name], geometry, args.pages) for name in ROWS]
                    else:
                        rows = make_rows(rt, mods[rt], dirs, page_bytes, args.pages, names)
                    warm = None if args.no_warm else lambda: warm_memory(2 * args.pages * page_bytes + (1 << 30))
                    res[rt][label] = {"page_bytes": page_bytes, **run_rows(rows, args.runs, warm)}
                shutil.rmtree(plain, ignore_errors=True)
                print(f"[runtime_adapters] {rt} {label}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
                if args.json:                  # a partial result survives a later failure
                    args.json.write_text(json.dumps(res, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def _ram_desc(mount: Path) -> str:
    """Where the mounted daemon's RAM tier is: ``shm_dir``, or the daemon's own huge-page
    tmpfs inside it (kvfs.store.hugefs), with its ``huge=`` option."""
    ram_dir = Path(json.loads((mount / ".kvfs" / "stats").read_text())["ram_dir"])
    top = ram_dir.parent
    if ".hugefs-" in top.name:
        return f"a tmpfs the daemon mounted in {top.parent} ({_shm_desc(top).rsplit(' ', 1)[1][1:-1]})"
    return _shm_desc(top)


def _shm_desc(shm_dir: Path | None) -> str:
    """The RAM tier's directory and its tmpfs options that matter (``huge=``)."""
    path = str(shm_dir or "/dev/shm")
    best, opts = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, opts = parts[1], parts[3]
    huge = [o for o in opts.split(",") if o.startswith("huge=")]
    return f"{path} ({huge[0] if huge else 'huge=never'})"


def _rate(op: str, seconds: float, n: int, page_bytes: int) -> str:
    if op.startswith("exists"):
        return f"{seconds / n * 1e6:.1f} µs/page"
    return f"{n * page_bytes / seconds / 1e9:.2f} GB/s"


def _runtimes(res: dict) -> list[str]:
    return [r for r in RUNTIMES if r in res]


def report(res: dict) -> str:
    m = res["meta"]
    n = m["pages"]
    versions = m.get("versions", {"sglang": m.get("sglang")})
    names = {"sglang": "SGLang", "vllm": "vLLM", "lmcache": "LMCache"}
    vs = ", ".join(f"{names[r]} {versions[r]}" for r in _runtimes(res))
    out = ["## Benchmark: runtime backends on a plain directory and on kvfs", "",
           f"Measured {m['date']} on {m['cpus']} CPUs, kernel {m['kernel']}, Python {m['python']}, "
           f"{vs} (released storage layers, driven as their controllers drive them), {n} pages, median of "
           f"{m['runs']} runs, load average {m['load'][0]:.1f} at the start (a two-core VM: other "
           "work on it moves these figures; compare the ratios within one run)"
           + (", free memory touched before each set (`kvfs.bench.warm_memory`: this VM's host backs a page "
              "only at its first touch and takes it back soon after it is freed, which would make each set row pay "
              "~8x per page on whatever part of its fresh page cache or tmpfs pages is first-touch)" if m.get("warm") else "")
           + ". Plain directory: the host disk (ext4, page cache warm). "
           f"kvfs: RAM tier large enough for every page, in {m.get('shm_dir', '/dev/shm')}"
           + {True: ", FUSE passthrough on", False: ", FUSE passthrough off"}.get(m.get("passthrough"), "")
           + ". Regenerate with `python "
           "benchmarks/runtime_adapters.py --write-docs docs/benchmarks.md`.", "",
           "Ratios are against the runtime's own file backend on the plain directory, in the same run "
           "(higher is better: throughput for set/get, 1/latency for exists). Targets: exists ≥ 1.0×, "
           "get ≥ 1.0× (pages in the RAM tier), set ≥ 0.8×.", ""]
    for rt in _runtimes(res):
        title, rows_names = RUNTIMES[rt]
        for label, rows in res[rt].items():
            pb = rows["page_bytes"]
            base = rows[rows_names[0]]
            out += [f"### {title}, {label} pages", "",
                    "| operation | " + " | ".join(rows_names) + " | own on kvfs / plain | adapter / plain | target |",
                    "|---|" + "---:|" * (len(rows_names) + 3)]
            for op in OPS:
                cells = [_rate(op, rows[r][op], n, pb) for r in rows_names]
                r_file = base[op] / rows[rows_names[1]][op]
                r_ad = base[op] / rows[rows_names[2]][op]
                target = {"set": 0.8}.get(op, 1.0)
                mark = "met" if r_ad >= target else "**missed**"
                out.append(f"| {op} | " + " | ".join(cells)
                           + f" | {r_file:.2f}× | {r_ad:.2f}× | ≥ {target}× ({mark}) |")
            c = rows[rows_names[2]].get("counters", {})
            if c:
                out += ["", f"Adapter counters: {c['hits']} hits, {c['misses']} misses, "
                            f"{c['lease_fallbacks']} lease fallbacks (pages read through the mount), "
                            f"{c['bytes_read'] / 1e9:.1f} GB read, {c['written']} pages written, "
                            f"{c['errors']} errors."]
            out.append("")
    return "\n".join(out)


def plot(res: dict, png: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    panels = [(rt, label) for rt in _runtimes(res) for label in res[rt]]
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.6 * nrows), sharey=True, squeeze=False)
    for ax, (rt, label) in zip(axes.flat, panels):
        title, names = RUNTIMES[rt]
        rows = res[rt][label]
        base = rows[names[0]]
        width = 0.27
        for j, r in enumerate(names):
            vals = [base[op] / rows[r][op] for op in OPS]
            bars = ax.bar([i + (j - 1) * width for i in range(len(OPS))], vals, width, label=r)
            if j:
                for b, v in zip(bars, vals):
                    ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                va="bottom", fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(OPS)), OPS, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{title}, {label} pages ({res['meta']['pages']} pages)", fontsize=9)
        ax.legend(fontsize=7)
        ax.set_ylabel("× own backend on a plain dir (log)", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return True


def write_docs(path: Path, text: str, res: dict) -> None:
    if plot(res, path.parent / PLOT_NAME):
        head, _, rest = text.partition("\n\n")
        text = f"{head}\n\n![runtime backends vs plain directory]({PLOT_NAME})\n\n{rest}"
    doc = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + block + rest.split(END, 1)[1].lstrip("\n")
    else:
        doc = doc.rstrip("\n") + "\n\n" + block
    path.write_text(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runtimes", default="sglang,vllm,lmcache", help="comma-separated subset")
    ap.add_argument("--sizes", default="", help=f"comma-separated subset of {list(PAGES)} (default all)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write-docs", type=Path)
    ap.add_argument("--shm-dir", type=Path, default=None, help="the kvfs RAM tier's directory (default "
                    "/dev/shm); e.g. a tmpfs mounted with huge=within_size (docs/operations.md)")
    ap.add_argument("--ram-mapped-min", type=int, default=None, help="the mount's ram_mapped_min (default: kvfs's)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the plain directory and mounts go (default /tmp)")
    ap.add_argument("--passthrough", action=argparse.BooleanOptionalAction, default=None,
                    help="the mounts' passthrough setting (default: kvfs's default)")
    ap.add_argument("--no-warm", action="store_true", help="do not touch free memory before each set "
                    "(kvfs.bench.warm_memory: on a lazily backed VM a page's first touch costs ~8x)")
    ap.add_argument("--from-json", type=Path, help="report (and --write-docs) a saved --json result, measure nothing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = json.loads(args.from_json.read_text()) if args.from_json else bench(args)
    if args.json and not args.from_json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    if "sglang" in res and "meta" in res and "versions" not in res["meta"]:      # an older single-runtime result
        res["meta"]["versions"] = {"sglang": res["meta"].get("sglang")}
    text = report(res)
    print(text)
    if args.write_docs:
        write_docs(args.write_docs, text, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
