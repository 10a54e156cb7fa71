"""``kvfs bench`` end to end on a tiny workload: every benchmark runs and reports a ratio."""
from __future__ import annotations

import json

import pytest

from conftest import run_kvfs
from kvfs.cli import bench_report

pytestmark = pytest.mark.mount


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


def test_runtime_patterns_quick_run_reports_ratios(tmp_path):
    """``kvfs bench --only runtime --quick``: every pattern runs on kvfs, the floor fs, a plain
    directory and tmpfs, and each gets its ratios; the docs section is replaced, not appended."""
    res = run_kvfs("bench", "--only", "runtime", "--quick", "--rounds", "1", "--dir",
                   tmp_path / "scratch", "--json", timeout=900)
    assert res.returncode == 0, res.stderr
    rt = json.loads(res.stdout)["runtime"]
    rows = {r["key"]: r for r in rt["metrics"]}
    assert len(rows) >= 16, sorted(rows)      # (h) needs torch, the rest runs everywhere
    for key, r in rows.items():
        for t in ("kvfs", "floor", "plain", "tmpfs"):
            assert r[t]["median"] > 0, (key, t)
        assert r["vs_floor"]["median"] == pytest.approx(r["kvfs"]["median"] / r["floor"]["median"], rel=1e-6)
        assert r["vs_plain"]["median"] == pytest.approx(r["kvfs"]["median"] / r["plain"]["median"], rel=1e-6)
    assert rt["o_direct"]["kvfs"] is True               # vLLM's probe passes on the mount
    assert not any(p.is_mount() for p in (tmp_path / "scratch").rglob("*") if p.is_dir())

    import importlib.util
    import sys
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "benchmarks" / "runtime_patterns.py"
    spec = importlib.util.spec_from_file_location("rp_for_test", src)
    rp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rp
    spec.loader.exec_module(rp)
    md = tmp_path / "benchmarks.md"
    md.write_text("# kvfs benchmarks\n\n## Remote tier\n\nkept as is\n")
    rp.write_docs(rt, md)
    first = md.read_text()
    rp.write_docs(rt, md)
    assert md.read_text() == first and first.count(rp.BEGIN) == 1 and "kept as is" in first
    assert "(f) vLLM store" in first
