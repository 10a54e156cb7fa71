"""``kvfs ls --tree NAMESPACE``: a KV namespace's blocks as prefix trees.

Each block file's header names its parent; the blocks form a forest whose roots are the
first blocks of prompts. Runs of blocks with a single child are shown as one node
(``a1b2c3..d4e5f6  blocks 40  tokens 16-640``) so a 1,000-block chain stays one line.
Tier, hits and last access come from the daemon's xattrs on a mount (``-`` elsewhere).
Pure Python (no torch).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from kvfs.blockformat import HEADER_READ, parse_block_header
from kvfs.kv.layout import BLOCK_SUFFIX, NAMESPACE_FILE

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BlockEntry:
    hash: str
    parent: str
    tokens: int
    size: int
    tier: str | None
    hits: int | None
    atime: float
    children: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {"hash": self.hash, "parent": self.parent, "tokens": self.tokens, "size": self.size,
                "tier": self.tier, "hits": self.hits, "atime": self.atime}


def _xattr(path: str, name: str) -> str | None:
    try:
        return os.getxattr(path, name).decode("utf-8", "replace")
    except OSError:
        return None


def _entry(path: str) -> BlockEntry | None:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_READ)
        st = os.stat(path)
    except OSError as e:
        log.debug("%s: unreadable (%s)", path, e)
        return None
    parsed = parse_block_header(head)
    if parsed is None:
        return None
    hits = _xattr(path, "user.kvfs.hits")
    atime = _xattr(path, "user.kvfs.atime")
    try:
        at = float(atime) if atime is not None else st.st_atime
    except ValueError:
        at = st.st_atime
    return BlockEntry(parsed["hash"], parsed["parent"], parsed["tokens"], st.st_size,
                      _xattr(path, "user.kvfs.tier"), int(hits) if hits and hits.isdigit() else None, at)


def scan_namespace(namespace_path: str) -> tuple[dict[str, BlockEntry], list[str]]:
    """All kvfs blocks under ``namespace_path`` by hash, and the paths that are not blocks."""
    if not os.path.isdir(namespace_path):
        raise FileNotFoundError(f"no such namespace directory: {namespace_path}")
    blocks: dict[str, BlockEntry] = {}
    other: list[str] = []
    for dirpath, dirnames, filenames in os.walk(namespace_path):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name == NAMESPACE_FILE and dirpath == namespace_path:
                continue
            if not name.endswith(BLOCK_SUFFIX) or name.startswith("."):
                other.append(path)
                continue
            e = _entry(path)
            if e is None:
                other.append(path)
            else:
                blocks[e.hash] = e
    return blocks, other


def build_forest(blocks: dict[str, BlockEntry]) -> list[BlockEntry]:
    """Link children to parents; roots are first blocks and orphans (parent not cached)."""
    roots = []
    for e in blocks.values():
        e.children = []
    for e in sorted(blocks.values(), key=lambda b: (b.tokens, b.hash)):
        parent = blocks.get(e.parent) if e.parent else None
        (parent.children if parent is not None else roots).append(e)
    return roots


def _segments(root: BlockEntry) -> dict:
    """Compress single-child runs: {"blocks": [...], "children": [segments]} (iterative)."""
    def run(start: BlockEntry) -> tuple[dict, list[BlockEntry]]:
        seg_blocks = [start]
        while len(seg_blocks[-1].children) == 1:
            seg_blocks.append(seg_blocks[-1].children[0])
        return {"blocks": seg_blocks, "children": []}, seg_blocks[-1].children

    top, kids = run(root)
    stack = [(top, kids)]
    while stack:
        seg, kids = stack.pop()
        for k in kids:
            child, grandkids = run(k)
            seg["children"].append(child)
            stack.append((child, grandkids))
    return top


def _age(ts: float) -> str:
    dt = max(0.0, time.time() - ts)
    if dt < 120:
        return f"{dt:.0f}s"
    if dt < 7200:
        return f"{dt / 60:.0f}m"
    if dt < 172800:
        return f"{dt / 3600:.0f}h"
    return f"{dt / 86400:.0f}d"


def _label(seg: dict, orphan: bool) -> str:
    bl = seg["blocks"]
    first, last = bl[0], bl[-1]
    tiers: dict[str, int] = {}
    for b in bl:
        tiers[b.tier or "-"] = tiers.get(b.tier or "-", 0) + 1
    tier = ",".join(f"{t}" if len(tiers) == 1 else f"{t}:{n}" for t, n in sorted(tiers.items()))
    hits = [b.hits for b in bl if b.hits is not None]
    hits_s = str(sum(hits)) if hits else "-"
    span = first.hash[:12] if len(bl) == 1 else f"{first.hash[:12]}..{last.hash[:12]}"
    toks = f"tokens {last.tokens}" if len(bl) == 1 else f"tokens {first.tokens}-{last.tokens}"
    age = _age(max(b.atime for b in bl))
    mark = " [yellow](orphan: parent not cached)[/]" if orphan else ""
    return (f"[bold]{span}[/]  blocks {len(bl)}  {toks}  tier {tier}  hits {hits_s}  "
            f"age {age}{mark}")


def tree_document(namespace_path: str) -> dict:
    """The namespace as a JSON-able forest of compressed segments."""
    blocks, other = scan_namespace(namespace_path)
    roots = build_forest(blocks)

    def as_json(seg: dict) -> dict:
        return {"blocks": [b.as_dict() for b in seg["blocks"]], "children": [as_json(c) for c in seg["children"]]}

    meta = None
    try:
        with open(os.path.join(namespace_path, NAMESPACE_FILE), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        pass
    return {"namespace": os.path.basename(os.path.normpath(namespace_path)), "metadata": meta,
            "blocks": len(blocks), "bytes": sum(b.size for b in blocks.values()),
            "roots": [dict(as_json(_segments(r)), orphan=bool(r.parent)) for r in roots],
            "other_files": len(other)}


def print_tree(namespace_path: str, as_json: bool) -> None:
    """Print the prefix forest of a namespace directory (rich tree, or JSON with ``as_json``)."""
    if as_json:
        print(json.dumps(tree_document(namespace_path), indent=2))
        return
    from rich.console import Console
    from rich.tree import Tree

    blocks, other = scan_namespace(namespace_path)
    roots = build_forest(blocks)
    name = os.path.basename(os.path.normpath(namespace_path))
    total = sum(b.size for b in blocks.values())
    top = Tree(f"[bold blue]{name}[/]  {len(blocks)} blocks, {total / 2**20:.1f} MiB, {len(roots)} roots"
               + (f", {len(other)} other files" if other else ""))
    for r in roots:
        seg = _segments(r)
        stack = [(top, seg, bool(r.parent))]
        while stack:
            node, s, orphan = stack.pop()
            child = node.add(_label(s, orphan))
            for c in reversed(s["children"]):
                stack.append((child, c, False))
    Console().print(top)
