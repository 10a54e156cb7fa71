"""Render the sample Grafana dashboard (mount/grafana-kvfs.json) from a real run, without Grafana.

    python benchmarks/metrics_dashboard.py [--seconds 40] [--png docs/metrics_dashboard.png]

Mounts kvfs with ``--metrics 127.0.0.1:0`` (a small RAM tier, so blocks flow down to NVMe),
runs a workload in three namespaces (writes, O_DIRECT re-reads of a hot set, existence checks
of missing blocks, a ``kvfs_admit`` namespace that is written once and never read) while it
scrapes ``/metrics`` every 0.5 s, then draws each dashboard panel with matplotlib, computing the
panel's PromQL in Python over the scrapes (rates over 2 s windows; quantiles interpolated in
the histogram buckets as Prometheus does). No Grafana is installable here; the panels, titles
and units are the dashboard's own.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
KVFS = [sys.executable, "-m", "kvfs.cli"]
WINDOW = 2.0          # seconds: the rate window of this short run
MiB = 1 << 20


def scrape(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _read_direct(path: Path, buf: mmap.mmap) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except FileNotFoundError:
        return
    try:
        os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)


def workload(root: Path, stop: threading.Event) -> None:
    """Three namespaces. Blocks of the two model namespaces are read again right after they
    are written (a shared prefix reused: admitted to NVMe) and at random later (hot and cold
    reads, NVMe hits, promotions); ``kvfs_admit`` blocks are never read (dropped from RAM by
    ``admit_after = 2``). Each step also checks a block that does not exist."""
    rnd = random.Random(7)
    buf = mmap.mmap(-1, MiB)
    written: list[Path] = []
    n = 0
    while not stop.is_set():
        ns = rnd.choice(["llama-3-8b", "llama-3-8b", "qwen-2-7b", "kvfs_admit"])
        d = root / ns / f"{n % 16:02x}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"b{n}.kv"
        with open(p.with_suffix(".tmp"), "wb") as f:
            f.write(rnd.randbytes(MiB))
        os.replace(p.with_suffix(".tmp"), p)
        if ns != "kvfs_admit":
            _read_direct(p, buf)
            written.append(p)
            hot = written[-8:]
            for q in rnd.sample(hot, min(2, len(hot))) + rnd.sample(written, min(2, len(written))):
                _read_direct(q, buf)
        os.path.exists(root / ns / "ff" / f"missing{n}.kv")
        n += 1
        time.sleep(0.02)
    buf.close()


def rate(series, key, i) -> float:
    """Per-second increase of counter ``key`` over WINDOW ending at scrape ``i``."""
    t, cur = series[i]
    j = i
    while j > 0 and t - series[j][0] < WINDOW:
        j -= 1
    t0, old = series[j]
    return (cur.get(key, 0) - old.get(key, 0)) / (t - t0) if t > t0 else 0.0


def quantile(q: float, series, name: str, i: int) -> float | None:
    """histogram_quantile(q, rate(name_bucket[WINDOW])) with Prometheus' linear interpolation."""
    bks = sorted(((float(dict(lb)["le"]), (n, lb)) for (n, lb) in series[i][1] if n == f"{name}_bucket"),
                 key=lambda x: x[0])
    rates = [(le, rate(series, key, i)) for le, key in bks]
    total = rates[-1][1] if rates else 0
    if total <= 0:
        return None
    want, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in rates:
        if n >= want:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (want - prev_n) / (n - prev_n) if n > prev_n else le
        prev_le, prev_n = le, n
    return prev_le


def labels_of(series, name: str, label: str) -> list[str]:
    found = {dict(lb)[label] for (n, lb) in series[-1][1] if n == name and label in dict(lb)}
    return sorted(found)


def key(name: str, **labels):
    return (name, tuple(sorted(labels.items())))


def panel_lines(pid: int, series) -> list[tuple[str, list[float | None]]]:
    """The lines of dashboard panel ``pid`` (its PromQL, evaluated over the scrapes)."""
    idx = range(len(series))
    tiers = labels_of(series, "kvfs_tier_used_bytes", "tier")
    nss = labels_of(series, "kvfs_namespace_bytes", "namespace")
    g = lambda k: [series[i][1].get(k) for i in idx]                  # noqa: E731
    r = lambda k: [rate(series, k, i) for i in idx]                   # noqa: E731

    def ratio(hits, misses):
        out = []
        for i in idx:
            h, m = rate(series, hits, i), rate(series, misses, i)
            out.append(h / (h + m) if h + m else None)
        return out
    if pid == 1:
        return [(f"{t} used", g(key("kvfs_tier_used_bytes", tier=t))) for t in tiers] + \
               [(f"{t} capacity", g(key("kvfs_tier_capacity_bytes", tier=t))) for t in tiers]
    if pid == 2:
        return [(t, ratio(key("kvfs_tier_hits_total", tier=t), key("kvfs_tier_misses_total", tier=t))) for t in tiers]
    if pid == 3:
        return [(f"{t} in", r(key("kvfs_tier_written_bytes_total", tier=t))) for t in tiers] + \
               [(f"{t} out", r(key("kvfs_tier_read_bytes_total", tier=t))) for t in tiers]
    if pid == 4:
        return [(f"{t} demoted", r(key("kvfs_tier_demotions_total", tier=t))) for t in tiers] + \
               [(f"{t} evicted", r(key("kvfs_tier_evictions_total", tier=t))) for t in tiers] + \
               [("not admitted to nvme", r(key("kvfs_tier_admission_dropped_total", tier="nvme")))]
    if pid == 5:
        hist = [("FUSE read p50", 0.5, "kvfs_fuse_read_duration_seconds"),
                ("FUSE read p99", 0.99, "kvfs_fuse_read_duration_seconds"),
                ("FUSE write p99", 0.99, "kvfs_fuse_write_duration_seconds"),
                ("lookup p99", 0.99, "kvfs_lookup_duration_seconds"),
                ("seal p99", 0.99, "kvfs_seal_duration_seconds")]
        return [(lbl, [quantile(q, series, n, i) for i in idx]) for lbl, q, n in hist]
    if pid == 6:
        return [(n, g(key("kvfs_namespace_bytes", namespace=n))) for n in nss if n != "/"]
    if pid == 7:
        return [(n, ratio(key("kvfs_namespace_hits_total", namespace=n), key("kvfs_namespace_misses_total", namespace=n)))
                for n in nss if n != "/"]
    if pid == 8:
        return [("files being written", g(key("kvfs_writer_backlog_files"))),
                ("promotions queued", g(key("kvfs_promotion_queue_length")))] + \
               [(f"{t} MiB above low watermark", [v / MiB if v is not None else None
                                                  for v in g(key("kvfs_demotion_backlog_bytes", tier=t))])
                for t in tiers]
    if pid == 9:
        return [(f"{t} checksum failures/s", r(key("kvfs_tier_checksum_failures_total", tier=t))) for t in tiers] + \
               [(f"{t} errors/s", r(key("kvfs_tier_errors_total", tier=t))) for t in tiers] + \
               [(f"{t} deadline exceeded/s", r(key("kvfs_tier_read_deadline_exceeded_total", tier=t))) for t in tiers]
    return []


def render(dash: dict, series, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, PercentFormatter
    t0 = series[0][0]
    ts = [t - t0 for t, _ in series]
    panels = dash["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // 8
    fig = plt.figure(figsize=(14, 3.1 * rows), dpi=100)
    fig.patch.set_facecolor("#181b1f")
    spec = fig.add_gridspec(rows, 24)
    fmt = {"bytes": EngFormatter(unit="B", places=0), "Bps": EngFormatter(unit="B/s", places=0),
           "s": EngFormatter(unit="s", places=0), "ops": EngFormatter(unit="/s", places=1),
           "percentunit": PercentFormatter(1.0)}
    for p in panels:
        gp = p["gridPos"]
        ax = fig.add_subplot(spec[gp["y"] // 8, gp["x"]:gp["x"] + gp["w"]])
        ax.set_facecolor("#111217")
        ax.set_title(p["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        for side in ax.spines.values():
            side.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        for label, ys in panel_lines(p["id"], series):
            pts = [(t, y) for t, y in zip(ts, ys) if y is not None]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], linewidth=1.2, label=label)
        unit = p["fieldConfig"]["defaults"]["unit"]
        if unit in fmt:
            ax.yaxis.set_major_formatter(fmt[unit])
        if unit == "percentunit":
            ax.set_ylim(0, 1.05)
        if ax.lines:
            ax.legend(fontsize=6.5, loc="upper left", facecolor="#181b1f", labelcolor="#d8d9da",
                      edgecolor="#2c3235", ncol=2)
    fig.suptitle(f"kvfs dashboard (mount/grafana-kvfs.json) over a {ts[-1]:.0f} s run, x = seconds",
                 color="#d8d9da", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, facecolor=fig.get_facecolor())
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "metrics_dashboard.png")
    a = ap.parse_args()
    dash = json.loads((REPO / "mount" / "grafana-kvfs.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-dash-"))
    mnt = tmp / "mnt"
    mnt.mkdir()
    cfg = tmp / "kvfs.toml"
    cfg.write_text("[admit_after]\nnvme = 2\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([*KVFS, "mount", str(mnt), "--nvme", str(tmp / "nvme"), "--ram", "48MiB",
                    "--nvme-size", "160MiB", "--metrics", "127.0.0.1:0", "--config", str(cfg)],
                   check=True, env=env)
    stop = threading.Event()
    try:
        addr = json.loads((mnt / ".kvfs" / "stats").read_bytes())["metrics"]
        worker = threading.Thread(target=workload, args=(mnt, stop))
        worker.start()
        series = []
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            series.append((time.monotonic(), scrape(addr)))
            time.sleep(0.5)
        stop.set()
        worker.join()
    finally:
        stop.set()
        subprocess.run([*KVFS, "umount", str(mnt)], env=env)
    render(dash, series, a.png)
    print(f"wrote {a.png} ({len(series)} scrapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
