"""Time to first token of make run's chat turn 2, with the prefix reused from kvfs and recomputed.

    python benchmarks/chat_reuse.py ROOT [--runs 3] [--doc-tokens 2000] [--model-cache DIR]

ROOT: a directory on a kvfs mount (e.g. ``mnt/kv`` after ``make run``). One process, one model
load: turn 1 (prompt + a 32-token greedy answer) is computed and saved once; then, alternately,
``--runs`` times each: turn 2 with reuse (lookup + load of the cached prefix + the new tokens,
nothing saved) and turn 2 recomputed in one pass. Prints medians and ranges.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from kvfs import chatdemo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--model-cache", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    from kvfs.kv.hf import layout_for
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok, model = chatdemo.load_model(chatdemo.find_gguf(), converted=args.model_cache)
    fp, fp_s = chatdemo.fingerprint(model)
    layout = layout_for(model.config, block_tokens=32)
    engine = chatdemo.Engine(model, tok, chunk=512, max_new_tokens=32, progress=False)
    ids1 = chatdemo.turn1_ids(tok, chatdemo.document(args.doc_tokens, tok))
    reuse, full, parts = [], [], []
    with chatdemo.open_cache(args.root, layout, fp, f"bench-{os.urandom(4).hex()}") as cache:
        r1 = chatdemo.reuse_turn(engine, cache, ids1)
        cache.flush()
        ids2 = chatdemo.next_turn_ids(tok, ids1, r1["answer"], chatdemo.QUESTION_2)
        engine.max_new = 1
        for _ in range(args.runs):
            r = chatdemo.reuse_turn(engine, cache, ids2, save=False)
            reuse.append(r["ttft"])
            parts.append((r["load"], r["compute"], r["reused"], r["sources"]))
            t0 = time.perf_counter()
            logits, _, _ = engine.prefill(ids2, None, 0, chunk=len(ids2))
            int(logits.argmax())
            full.append(time.perf_counter() - t0)
    med = statistics.median
    print(f"fingerprint {fp_s * 1e3:.0f} ms; turn 2: {len(ids2)} tokens, {parts[0][2]} reused; "
          f"time to first token with reuse {med(reuse):.2f} s ({min(reuse):.2f}-{max(reuse):.2f}; "
          f"load {med(p[0] for p in parts) * 1e3:.0f} ms + compute {med(p[1] for p in parts):.2f} s), "
          f"recomputed in one pass {med(full):.2f} s ({min(full):.2f}-{max(full):.2f}): "
          f"{med(full) / med(reuse):.1f}x; sources {parts[-1][3]}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
