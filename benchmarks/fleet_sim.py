"""Simulation of a fleet of kvfs nodes sharing one remote volume (docs/scale-out.md).

    python benchmarks/fleet_sim.py [--nodes 8,16,32,64,128,256] [--per-node 300]
                                   [--json out.json] [--plot docs/fleet_sim.png] [--quick]

A model, not a measurement: it answers how much a fleet would gain from reading each
other's prefixes on the shared volume, and what the sharing costs the volume, before any of
it is built. Every parameter is a command-line option; the defaults are the ones in the docs.

Workload: ``--per-node`` requests per node at ``--rate`` requests/s per node (a fleet grows
with its traffic), all drawing from the same pools:
* ``--prompts`` system prompts of 8..64 blocks each, chosen by a Zipf law (``--zipf``);
* sessions of several turns: a request continues an open session with probability
  ``--continue`` (the session picked uniformly among the ``--open`` most recent), else opens a
  new one; each turn adds 4..16 new blocks after the session's history;
* a request looks up its blocks as a prefix (stop at the first miss: a KV prefix is only usable
  up to its first hole), then every block of the request is cached on the node that ran it.

Routing: ``random`` (load balancing that does not know where prefixes live: the common
default) or ``sticky`` (a session stays on one node; system prompts still land anywhere).

Each node: an LRU of ``--local`` blocks (RAM + local NVMe), whose victims are demoted into the
node's own region of the volume (an LRU of ``--region`` blocks; its victims are freed).
Without sharing, a node finds only its own blocks. With sharing, a block demoted by any node
is visible to the others once published: the demotion's flush (``--flush-ms``) plus the wait
for the next poll of its log (uniform in 0..``--poll-ms``). ``publish = demote`` shares blocks
only when they leave local memory; ``write`` also writes every new block through to the volume.

Traffic: volume bytes written (demotions, write-throughs) and read (hits on the volume, own
or others'), log entries (one per publication and per free, ``--entry`` bytes each, read by
every other node), and head polls (every node reads every other node's slot, one LBA of
``--slot`` bytes, every ``--poll-ms``).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

BLOCK = 2 << 20          # bytes per KV block (a 16-token block of an 8B model, bf16)


@dataclass
class Params:
    nodes: int = 8
    per_node: int = 300       # requests per node (the run has per_node * nodes)
    prompts: int = 2000
    zipf: float = 1.1
    cont: float = 0.6
    open_sessions: int = 2000
    local: int = 2000
    region: int = 8000
    rate: float = 20.0        # requests per second per node
    poll_ms: float = 500.0
    flush_ms: float = 2.0
    entry: int = 128
    slot: int = 512
    routing: str = "random"
    sharing: bool = False
    publish: str = "demote"
    seed: int = 1


@dataclass
class Result:
    params: dict
    hit_rate: float = 0.0               # blocks found / blocks looked up, fleet-wide
    node_hit_rates: list = field(default_factory=list)
    hits_local: int = 0
    hits_own_volume: int = 0
    hits_shared: int = 0
    lookups: int = 0
    volume_written: int = 0             # bytes
    volume_read: int = 0
    log_bytes_read: float = 0.0         # by tailers, whole run
    poll_bytes_per_s: float = 0.0       # head polls, fleet-wide
    visibility_ms: list = field(default_factory=list)   # creation -> visible elsewhere (p50, p90)
    duration_s: float = 0.0


class Node:
    def __init__(self, p: Params):
        self.local: OrderedDict[int, None] = OrderedDict()
        self.region: OrderedDict[int, None] = OrderedDict()
        self.cap_local, self.cap_region = p.local, p.region
        self.found = 0
        self.looked = 0


class Fleet:
    """One run of the model; ``run()`` returns its Result."""

    def __init__(self, p: Params):
        self.p = p
        self.rng = random.Random(p.seed)
        # poll lags drawn apart, so the workload is the same request for request in every mode
        self.lag_rng = random.Random(p.seed + 1)
        self.nodes = [Node(p) for _ in range(p.nodes)]
        weights = [1.0 / (i + 1) ** p.zipf for i in range(p.prompts)]
        self.prompt_cum = _cumulative(weights)
        self.prompt_len = [self.rng.randint(8, 64) for _ in range(p.prompts)]
        self.next_id = p.prompts * 64          # ids below are system-prompt blocks
        self.sessions: list[tuple[int, list[int], int]] = []   # (prompt, history, home node)
        # shared view: block -> {owner: visible from}; a block may sit in several regions
        self.published: dict[int, dict[int, float]] = {}
        self.created: dict[int, float] = {}
        self.vis: list[float] = []
        self.res = Result(params=asdict(p))
        self.log_entries = 0

    def run(self) -> Result:
        p = self.p
        fleet_rate = p.rate * p.nodes
        t = 0.0
        for _ in range(p.per_node * p.nodes):
            t += self.rng.expovariate(fleet_rate)
            prompt, history, home = self._pick_session()
            node_i = home if p.routing == "sticky" and home >= 0 else self.rng.randrange(p.nodes)
            blocks = [prompt * 64 + i for i in range(self.prompt_len[prompt])] + history
            found = self._lookup(node_i, blocks, t)
            new = [self._new_block() for _ in range(self.rng.randint(4, 16))]
            history.extend(new)
            self._remember(prompt, history, node_i)
            computed = blocks[found:] + new
            for b in computed:
                self.created[b] = t               # visibility is measured from here, once
            for b in blocks + new:
                self._cache(node_i, b, t)
            if p.sharing and p.publish == "write":
                for b in computed:
                    self._to_volume(node_i, b, t)
        self._finish(t)
        return self.res

    def _pick_session(self) -> tuple[int, list[int], int]:
        if self.sessions and self.rng.random() < self.p.cont:
            prompt, history, home = self.sessions[self.rng.randrange(len(self.sessions))]
            return prompt, list(history), home
        return _bisect(self.prompt_cum, self.rng.random()), [], -1

    def _remember(self, prompt: int, history: list[int], node_i: int) -> None:
        self.sessions.append((prompt, history, node_i))
        if len(self.sessions) > self.p.open_sessions:
            self.sessions.pop(self.rng.randrange(len(self.sessions)))

    def _new_block(self) -> int:
        self.next_id += 1
        return self.next_id

    def _lookup(self, node_i: int, blocks: list[int], t: float) -> int:
        """How many leading blocks the node finds (local, own region, or shared)."""
        node = self.nodes[node_i]
        found = 0
        for b in blocks:
            if b in node.local:
                self.res.hits_local += 1
            elif b in node.region:
                self.res.hits_own_volume += 1
                self.res.volume_read += BLOCK
            elif self.p.sharing and self._visible(b, node_i, t):
                self.res.hits_shared += 1
                self.res.volume_read += BLOCK
            else:
                break
            found += 1
        node.found += found
        node.looked += len(blocks)
        self.res.lookups += len(blocks)
        return found

    def _visible(self, b: int, node_i: int, t: float) -> bool:
        owners = self.published.get(b)
        return owners is not None and any(o != node_i and vis <= t for o, vis in owners.items())

    def _cache(self, node_i: int, b: int, t: float) -> None:
        node = self.nodes[node_i]
        if b in node.local:
            node.local.move_to_end(b)
            return
        node.local[b] = None
        if len(node.local) > node.cap_local:
            victim, _ = node.local.popitem(last=False)
            self._demote(node_i, victim, t)

    def _demote(self, node_i: int, b: int, t: float) -> None:
        self._to_volume(node_i, b, t)          # no second write when it is there already

    def _to_volume(self, node_i: int, b: int, t: float) -> None:
        """Write ``b`` into the node's region (and publish it when sharing); the region's LRU
        victim is freed (and its free published)."""
        region = self.nodes[node_i].region
        if b in region:
            region.move_to_end(b)
            return
        region[b] = None
        self.res.volume_written += BLOCK
        if self.p.sharing:
            self._publish(node_i, b, t)
        if len(region) > self.nodes[node_i].cap_region:
            gone, _ = region.popitem(last=False)
            owners = self.published.get(gone)
            if owners is not None and owners.pop(node_i, None) is not None:
                self.log_entries += 1            # the free entry
                if not owners:
                    del self.published[gone]

    def _publish(self, node_i: int, b: int, t: float) -> None:
        owners = self.published.setdefault(b, {})
        lag = self.p.flush_ms / 1e3 + self.lag_rng.uniform(0, self.p.poll_ms / 1e3)
        owners[node_i] = t + lag
        self.log_entries += 1
        born = self.created.pop(b, None)        # the first publication since it was computed
        if born is not None:
            self.vis.append((t + lag - born) * 1e3)

    def _finish(self, t: float) -> None:
        p, r = self.p, self.res
        r.duration_s = t
        found = r.hits_local + r.hits_own_volume + r.hits_shared
        r.hit_rate = found / r.lookups if r.lookups else 0.0
        r.node_hit_rates = [n.found / n.looked if n.looked else 0.0 for n in self.nodes]
        if p.sharing:
            r.log_bytes_read = self.log_entries * p.entry * (p.nodes - 1)
            r.poll_bytes_per_s = p.nodes * (p.nodes - 1) * p.slot / (p.poll_ms / 1e3)
        if self.vis:
            v = sorted(self.vis)
            r.visibility_ms = [v[len(v) // 2], v[int(len(v) * 0.9)]]


def _cumulative(weights: list[float]) -> list[float]:
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        out.append(acc)
    return out


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def sweep(base: Params, node_counts: list[int], progress=print) -> list[dict]:
    """Every node count × routing × {no sharing, share on demote, share on write}."""
    out = []
    for n in node_counts:
        for routing in ("random", "sticky"):
            for sharing, publish in ((False, "demote"), (True, "demote"), (True, "write")):
                p = Params(**{**asdict(base), "nodes": n, "routing": routing, "sharing": sharing,
                              "publish": publish})
                r = Fleet(p).run()
                progress(f"nodes {n:4d} {routing:6s} sharing={'off' if not sharing else publish:6s} "
                         f"hit rate {r.hit_rate:6.1%} (shared {r.hits_shared / max(1, r.lookups):5.1%}) "
                         f"volume w {r.volume_written / 2**30:7.1f} GiB r {r.volume_read / 2**30:7.1f} GiB "
                         f"polls {r.poll_bytes_per_s / 2**20:7.1f} MiB/s")
                out.append(asdict(r))
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {(False, "demote"): ("no sharing", "-"), (True, "demote"): ("share on demote", "--"),
              (True, "write"): ("share on write", ":")}
    for routing, color in (("random", "tab:blue"), ("sticky", "tab:orange")):
        for key, (label, ls) in styles.items():
            rows = [r for r in results if r["params"]["routing"] == routing
                    and (r["params"]["sharing"], r["params"]["publish"]) == key]
            xs = [r["params"]["nodes"] for r in rows]
            ax1.plot(xs, [100 * statistics.median(r["node_hit_rates"]) for r in rows], ls, color=color,
                     marker="o", label=f"{routing} routing, {label}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("nodes sharing one volume")
    ax1.set_ylabel("median per-node hit rate (% of blocks)")
    ax1.set_title("Prefix reuse per node")
    ax1.legend(fontsize=7)
    rows = [r for r in results if r["params"]["routing"] == "random" and r["params"]["sharing"]
            and r["params"]["publish"] == "demote"]
    xs = [r["params"]["nodes"] for r in rows]
    ax2.plot(xs, [r["poll_bytes_per_s"] / 2**20 for r in rows], marker="o", label="head polls (MiB/s)")
    ax2.plot(xs, [r["log_bytes_read"] / r["duration_s"] / 2**20 for r in rows], marker="s",
             label="log tail reads (MiB/s)")
    ax2.plot(xs, [r["volume_read"] / r["duration_s"] / 2**20 for r in rows], marker="^",
             label="block reads from the volume (MiB/s)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("nodes (random routing, share on demote)")
    ax2.set_title("Volume traffic of sharing")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,16,32,64,128,256")
    ap.add_argument("--per-node", type=int, default=Params.per_node, help="requests per node")
    ap.add_argument("--prompts", type=int, default=Params.prompts)
    ap.add_argument("--zipf", type=float, default=Params.zipf)
    ap.add_argument("--continue", dest="cont", type=float, default=Params.cont)
    ap.add_argument("--open", dest="open_sessions", type=int, default=Params.open_sessions)
    ap.add_argument("--local", type=int, default=Params.local, help="blocks in RAM+NVMe per node")
    ap.add_argument("--region", type=int, default=Params.region, help="blocks per node on the volume")
    ap.add_argument("--rate", type=float, default=Params.rate, help="requests/s per node")
    ap.add_argument("--poll-ms", type=float, default=Params.poll_ms)
    ap.add_argument("--flush-ms", type=float, default=Params.flush_ms)
    ap.add_argument("--entry", type=int, default=Params.entry, help="bytes per log entry")
    ap.add_argument("--slot", type=int, default=Params.slot, help="bytes read per head poll per peer")
    ap.add_argument("--seed", type=int, default=Params.seed)
    ap.add_argument("--quick", action="store_true", help="8 and 64 nodes, 100 requests per node")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    counts = [int(x) for x in a.nodes.split(",")]
    base = Params(per_node=a.per_node, prompts=a.prompts, zipf=a.zipf, cont=a.cont,
                  open_sessions=a.open_sessions, local=a.local, region=a.region, rate=a.rate,
                  poll_ms=a.poll_ms, flush_ms=a.flush_ms, entry=a.entry, slot=a.slot, seed=a.seed)
    if a.quick:
        counts, base.per_node = [8, 64], 100
    results = sweep(base, counts, progress=log.info)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
