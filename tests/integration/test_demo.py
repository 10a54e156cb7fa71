"""`make run`'s demo on a real mount: block files demote and read back; LLM prefix reuse agrees."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.mount import _env

pytestmark = [pytest.mark.mount, pytest.mark.torch]


def test_demo_runs_on_a_mount(kvfs_mount):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    m = kvfs_mount(ram="8MiB", nvme_size="256MiB")
    res = subprocess.run(
        [sys.executable, "-m", "kvfs.demo", str(m.path), "--blocks", "12", "--block-size", "1MiB",
         "--random-model", "--prompt-tokens", "192"],
        capture_output=True, text=True, timeout=600, env=_env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr + m.log_tail()
    out = res.stdout
    assert "re-read 12 blocks: 12 intact, 0 bad" in out
    assert " on nvme" in out                       # 12 MiB written into an 8 MiB RAM tier
    assert "192 reused from kvfs" in out           # 192 shared tokens = 12 whole blocks
    assert "logits agree" in out
    ns = os.listdir(m.path / "kv")
    assert len(ns) == 1
    blocks = [f for _, _, files in os.walk(m.path / "kv" / ns[0]) for f in files if f.endswith(".kv")]
    assert len(blocks) == (192 + 24) // 16 + 1     # prompt 1's 13 blocks + prompt 2's own 14th
