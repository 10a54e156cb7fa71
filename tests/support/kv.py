"""KV-layer test helpers: the layout of the tests and a child process that saves and exits."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import kvfs  # noqa: E402


LAYOUT = kvfs.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_tokens=16)


_EXIT_CHILD = r"""
import atexit, sys, threading
import torch
import kvfs
from kvfs.kv.writer import SaveJob

root, n_prompts, exit_timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
release_at_exit = sys.argv[4] == "1"
layout = kvfs.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_tokens=16)
cache = kvfs.KVCache(root, model="test/model", layout=layout, save_timeout=None,
                     max_pending_saves=n_prompts + 1, exit_timeout=exit_timeout)
# Hold the writer thread on a gate, so every save below is still queued when the
# interpreter starts to exit. atexit runs last-registered first: the gate opens (or not)
# before kvfs's own exit handler flushes the writer.
gate = threading.Event()
cache._writer.submit(SaveJob(hashes=[], parents=[], first=0, token_ids=[], payload=None,
                             ready=gate.wait), None)
if release_at_exit:
    atexit.register(gate.set)
for i in range(n_prompts):
    g = torch.Generator().manual_seed(i)
    toks = torch.randint(0, 50000, (64,), generator=g).tolist()
    kv = torch.randn(layout.block_shape(64), generator=g).to(layout.torch_dtype)
    cache.save(toks, kv)
print("unwritten", cache._writer.unwritten(), flush=True)
# no flush(), no close(): a normal exit
"""


def _run_exit_child(root, n_prompts: int, exit_timeout: float, release: bool):
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(root), str(n_prompts), str(exit_timeout),
                           "1" if release else "0"], capture_output=True, text=True, env=env, timeout=300)


def assert_exit_child_saves_read_back(root, n_prompts: int) -> None:
    """Another process's view of ``root`` after :func:`_run_exit_child` saved ``n_prompts``
    prompts: every prompt is found whole and loads back equal."""
    with kvfs.KVCache(root, model="test/model", layout=LAYOUT) as other:
        for i in range(n_prompts):
            g = torch.Generator().manual_seed(i)
            toks = torch.randint(0, 50000, (64,), generator=g).tolist()
            kv = torch.randn(LAYOUT.block_shape(64), generator=g).to(LAYOUT.torch_dtype)
            assert other.lookup(toks) == 64, f"prompt {i} lost at exit"
            assert torch.equal(other.load(toks), kv)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
