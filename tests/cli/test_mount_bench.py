"""``kvfs bench`` end to end on a tiny workload: every benchmark runs and reports a ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.mount import _env, run_kvfs
from kvfs.cli import bench_report

pytestmark = pytest.mark.mount
REPO = Path(__file__).resolve().parents[2]


def test_bench_runs_everything_and_writes_docs(tmp_path):
    res = run_kvfs("bench", "--dir", tmp_path / "scratch", "--size", "16MiB", "--runs", "1",
                   "--lookup-files", "200", "--small-objects", "300", "--json", timeout=900)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rows = {r["name"]: r for r in out["throughput"]}
    assert set(rows) == {"write", "read_cold", "read_warm", "read_nvme"}
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        assert r["kvfs_gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["kvfs_gbps"] / r["baseline_gbps"], rel=0.02)
        assert isinstance(r["meets_target"], bool)
    assert rows["read_cold"]["tier_before"] == "ram"
    assert rows["read_nvme"]["tier_during"] == ["nvme"]      # really read from the NVMe tier
    assert rows["read_nvme"]["baseline"] == "O_DIRECT plain file"
    lk = out["lookup"]
    assert lk["files"] == 200 and lk["kvfs"]["cold_us"] > 0 and lk["tmpfs"]["miss_us"] > 0
    (rm,) = out["remount"]
    assert "error" not in rm, rm
    assert rm["objects"] == 300 and rm["mount_s"] > 0 and rm["rss_remounted"]["VmRSS"] > 0
    # scratch mounts are gone
    assert not any(p.is_mount() for p in (tmp_path / "scratch").rglob("mnt"))

    md = tmp_path / "benchmarks.md"
    md.write_text("# kvfs benchmarks\n\n## Remote tier\n\nkept as is\n")
    bench_report.write_docs(out, md)
    first = md.read_text()
    bench_report.write_docs(out, md)
    text = md.read_text()
    assert text == first, "rewriting replaces the section instead of appending another"
    assert text.count(bench_report.BEGIN) == 1 and "## Remote tier\n\nkept as is" in text
    assert "read_nvme" in text and "O_DIRECT plain file" in text


def _runtime_patterns_module():
    import importlib.util
    import sys
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "benchmarks" / "runtime_patterns.py"
    spec = importlib.util.spec_from_file_location("rp_for_test", src)
    rp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rp
    spec.loader.exec_module(rp)
    return rp


def test_runtime_patterns_quick_run_reports_ratios(tmp_path):
    """``kvfs bench --only runtime --quick``: every pattern runs on kvfs, kvfs on pyfuse3, the
    floor fs, a plain directory and tmpfs ((j), the NVMe-tier read, on the targets with a disk),
    each gets its ratios, the passthrough counters are recorded; the docs section is replaced,
    not appended."""
    rp = _runtime_patterns_module()
    res = run_kvfs("bench", "--only", "runtime", "--quick", "--rounds", "1", "--dir",
                   tmp_path / "scratch", "--json", timeout=900)
    assert res.returncode == 0, res.stderr
    rt = json.loads(res.stdout)["runtime"]
    assert rt["targets"] == list(rp.TARGETS)
    rows = {r["key"]: r for r in rt["metrics"]}
    assert len(rows) >= 18, sorted(rows)      # (h) needs torch, the rest runs everywhere
    assert {"e_mmap_fresh", "j_nvme_read"} <= set(rows)
    for key, r in rows.items():
        ran = rp.DISK_TARGETS if key.startswith("j_") else rp.TARGETS
        for t in ran:
            assert r[t]["median"] > 0, (key, t)
        for t in set(rp.TARGETS) - set(ran):
            assert t not in r, (key, t)
        for rk, a, b in rp.RATIOS:
            if a in ran and b in ran:
                assert r[rk]["median"] == pytest.approx(r[a]["median"] / r[b]["median"], rel=1e-6), (key, rk)
            else:
                assert r[rk] is None, (key, rk)
    assert rt["o_direct"]["kvfs"] is True               # vLLM's probe passes on the mount
    pt = rt["passthrough"]
    assert pt["kvfs_pyfuse3"]["name"] == "pyfuse3"
    assert pt["kvfs_pyfuse3"]["by_pattern"]["nvme_read"]["data_reads"] > 0    # the daemon read them
    if pt["kvfs"]["passthrough"] == "on":               # kvfs's transport, Linux 6.9+, root
        nvme = rt["sizes"]["nvme"]
        assert pt["kvfs"]["by_pattern"]["nvme_read"] == {"opens": nvme, "data_reads": 0}
        assert pt["kvfs"]["by_pattern"]["read_mmap"] == {"opens": rt["sizes"]["reads"], "data_reads": 0}
        assert pt["kvfs"]["total"]["data_reads"] == 0
    assert not any(p.is_mount() for p in (tmp_path / "scratch").rglob("*") if p.is_dir())

    md = tmp_path / "benchmarks.md"
    md.write_text("# kvfs benchmarks\n\n## Remote tier\n\nkept as is\n")
    png = rp.write_docs(rt, md)
    first = md.read_text()
    rp.write_docs(rt, md)
    assert md.read_text() == first and first.count(rp.BEGIN) == 1 and "kept as is" in first
    assert "(f) vLLM store" in first and "(e-mmap) open+mmap" in first and "(j) open+readinto" in first
    assert "| kvfs on pyfuse3 |" in first and "| kvfs / kvfs on pyfuse3 |" in first
    assert "kvfs: READs at the daemon" in first and "(j) NVMe-tier read" in first
    if png is not None:
        assert png.stat().st_size > 0


def test_runtime_patterns_targets_subset(tmp_path):
    """``--targets`` runs a subset of the targets; the table and ratios keep to them."""
    out = tmp_path / "rt.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "runtime_patterns.py"), "--quick",
                          "--rounds", "1", "--dir", str(tmp_path / "scratch"), "--targets", "kvfs,plain",
                          "--only", "read_mmap,nvme_read", "--json", str(out)],
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    rt = json.loads(out.read_text())
    assert rt["targets"] == ["kvfs", "plain"] and set(rt["passthrough"]) == {"kvfs"}
    rows = {r["key"]: r for r in rt["metrics"]}
    assert set(rows) == {"e_mmap_fresh", "j_nvme_read"}
    for r in rows.values():
        assert {t for t in ("kvfs", "kvfs_pyfuse3", "floor", "floor_kl", "plain", "tmpfs") if t in r} \
            == {"kvfs", "plain"}
        assert r["vs_plain"]["median"] > 0 and r["vs_pyfuse3"] is None and r["vs_floor"] is None
    assert "| kvfs | plain dir | kvfs / plain |" in res.stdout
    assert not any(p.is_mount() for p in (tmp_path / "scratch").rglob("*") if p.is_dir())
