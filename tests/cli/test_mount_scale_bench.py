"""benchmarks/metadata_scale.py end to end on a tiny workload (untimed): the files it puts in
the state directory are all there through the mount, and every figure is reported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.mount import REPO, _env

pytestmark = pytest.mark.mount


def test_metadata_scale_bench_reports_every_count(tmp_path):
    out = tmp_path / "scale.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "metadata_scale.py"), "--counts", "40,160",
                          "--dirs", "8", "--sample", "10", "--dir", str(tmp_path / "scratch"), "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["files"] for r in rows] == [40, 160] and [r["dirs"] for r in rows] == [8, 8]
    for r in rows:
        assert r["mount_s"] > 0 and r["rss_mounted"] > 0 and r["rss_after"] > 0
        assert r["cold_us"] > 0 and r["warm_us"] > 0 and r["miss_us"] > 0
        assert r["loaded_s"] >= r["mount_s"] - 1 and r["anon_after"] > 0 and len(r["cold_ratio"]) == 3
    assert rows[0]["cold_ratio"] == [1.0, 1.0, 1.0]
    for r in rows:                  # the kill -9 row: the RAM-only files and the unsealed one went
        assert r["crash_mount_s"] > 0 and r["rss_crash"] > 0 and r["crash_loaded_s"] > 0
        assert r["crash_dropped"] == 200 + 1 and 0 < r["crash_decoded"] <= 3 * r["crash_dropped"]
    assert "after kill -9" in res.stdout
    assert "lookup latency at 160 / at 40 files" in res.stdout
    assert not any(p.is_mount() for p in (tmp_path / "scratch").rglob("mnt"))
