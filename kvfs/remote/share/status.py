"""``kvfs remote status``: what a shared (format 2) volume says about its nodes, read-only.

Everything comes from the volume itself (superblock, node slots, claim rows, publication
logs, each region's format-1 superblock and allocation table), read through a connection of
the command's own; nothing is written, and no daemon has to stop. Optionally the ``.kvfs/stats``
of a local mount adds that node's view lag (how far its tailer is behind each node's log).

A node's state, as seen now:

* ``fenced``: its claim on a region was superseded by another node's takeover and it holds
  no region any more (a live process in that state writes nothing);
* ``dead``: its heartbeat is older than ``lease + grace`` (by the wall-clock time the node
  wrote with its last heartbeat, or, with ``sample``, its counter did not move while watched);
* ``alive``: otherwise; ``read-only`` is added when it holds no region.
"""
from __future__ import annotations

import json
import logging
import os
import time

import trio

from kvfs.errors import ConfigError
from kvfs.remote import volume_format as L
from kvfs.remote.share import format as F
from kvfs.remote.share.member import read_claims, read_slots, read_units
from kvfs.remote.volume import Volume

log = logging.getLogger(__name__)


async def volume_status(vol: Volume, *, lease: float = 10.0, grace: float | None = None, sample: float = 0.0,
                        now: float | None = None, name: str = "") -> dict:
    """The status of the shared volume ``vol`` (already open; ``name``: how to call it);
    ConfigError when it is not one."""
    name = name or vol.describe
    grace = lease / 2 if grace is None else grace
    unit = max(4096, vol.block_size)
    raw = await vol.read(0, unit)
    ver = F.version_of(raw)
    if ver != F.VERSION:
        what = {None: "blank (not formatted)", 1: "a single-node (format 1) kvfs volume"}.get(
            ver, "not a kvfs volume")
        raise ConfigError(f"{name} is {what}: it has no node slots, regions or logs to show"
                          + (" (kvfs stat on its mount shows its remote tier)" if ver == 1 else ""))
    try:
        sb2 = F.Superblock2.unpack(raw)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    slots = await read_slots(vol, sb2)
    rows = await read_claims(vol, sb2)
    moved: set[int] | None = None
    if sample > 0:
        await trio.sleep(sample)
        again = await read_slots(vol, sb2)
        moved = {i for i, (a, b) in enumerate(zip(slots, again))
                 if a is not None and b is not None and (a.heartbeat, a.nonce) != (b.heartbeat, b.nonce)}
        slots = again
    now = time.time() if now is None else now
    owners = F.owners(rows, sb2.regions)
    nodes = []
    for i, s in enumerate(slots):
        if s is not None and s.free:
            continue
        nodes.append(await _node(vol, sb2, i, s, rows[i], owners, moved, now, lease + grace))
    regions = [await _region(vol, sb2, r, owners, rows, slots) for r in range(sb2.regions)]
    return {"volume": name, "volume_uuid": sb2.volume_uuid.hex(), "format": sb2.version,
            "unit": sb2.unit, "max_nodes": sb2.max_nodes, "regions_total": sb2.regions,
            "region_bytes": sb2.region_bytes, "log_entries": sb2.log_entries,
            "lease": lease, "grace": grace, "sampled": sample, "claim_rows_verify": owners is not None,
            "nodes": nodes, "regions": regions}


async def _node(vol: Volume, sb2: F.Superblock2, i: int, s: F.NodeSlot | None, row: dict | None,
                owners: dict | None, moved: set | None, now: float, dead_after: float) -> dict:
    if s is None:
        return {"slot": i, "state": "unreadable", "why": "slot does not verify (torn or damaged)"}
    if owners is None:          # a claim row does not verify (torn): show what this row claims
        held = sorted(row or {})
    else:
        held = sorted(r for r, ss in owners.items() if i in ss)
    lost = sorted(r for r in (row or {}) if owners is not None and i not in owners.get(r, []))
    age = max(0.0, now - s.updated) if s.updated else None
    if lost and not held:
        state = "fenced"
    elif moved is not None:
        state = "alive" if i in moved else ("dead" if age is None or age > dead_after else "alive?")
    else:
        state = "dead" if age is None or age > dead_after else "alive"
    if state.startswith("alive") and not held:
        state += " read-only"
    head, oldest = await _log_ends(vol, sb2, i)
    return {"slot": i, "node_id": s.node_id, "hostnqn": s.hostnqn, "epoch": s.epoch, "heartbeat": s.heartbeat,
            "heartbeat_age": None if age is None else round(age, 3), "state": state, "regions": held,
            "lost_regions": lost,
            "log": {"head": head, "oldest": oldest, "entries": head - oldest,
                    "capacity": sb2.log_entries, "wrapped": head - 1 > sb2.log_entries}}


async def _log_ends(vol: Volume, sb2: F.Superblock2, slot: int) -> tuple[int, int]:
    """(next sequence number, oldest sequence number still in the ring) of a node's log."""
    raw = await read_units(vol, sb2.log_off(slot), sb2.log_units, sb2.unit)
    seqs = set()
    for k in range(sb2.log_entries):
        e = F.unpack_entry(raw, k * F.ENTRY)
        if e is not None and (e.seq - 1) % sb2.log_entries == k:
            seqs.add(e.seq)
    if not seqs:
        return 1, 1
    top = first = max(seqs)
    while first - 1 in seqs:
        first -= 1
    return top + 1, first


async def _region(vol: Volume, sb2: F.Superblock2, r: int, owners: dict | None, rows: list, slots: list) -> dict:
    out: dict = {"region": r, "owner_slots": (owners or {}).get(r, []) if owners is not None else None}
    for s in out["owner_slots"] or []:
        nonce = (rows[s] or {}).get(r, (0, 0))[1]
        v = F.superseded_by(nonce)
        if v is not None:
            prev = slots[v[0]]
            out["taken_over_from"] = {"slot": v[0], "epoch": v[1],
                                      "node_id": prev.node_id if prev is not None else ""}
    off = sb2.region_off(r)
    try:
        sb = L.Superblock.unpack(await vol.read(off, sb2.unit))
    except ValueError as e:
        out["volume"] = f"damaged ({e})"
        return out
    if sb is None:
        out["volume"] = "blank"
        return out
    table = await vol.read(off + sb.table_start * sb.unit, sb.table_units * sb.unit)
    used = objects = 0
    for k in range(sb.slots):
        e = L.unpack_entry(table, k * L.ENTRY_SIZE)
        if e is not None:
            used += e[3]
            objects += 1
    cap = sb.data_units * sb.unit
    out.update(volume="formatted", capacity=cap, used=used * sb.unit, objects=objects,
               fill=round(used * sb.unit / cap, 4) if cap else 0.0)
    return out


def view_lag(status: dict, stats: dict) -> dict:
    """How far the mount whose ``.kvfs/stats`` is ``stats`` is behind each node's log."""
    share = ((stats.get("tiers") or {}).get("remote") or {}).get("share")
    if not share:
        raise ConfigError("that mount has no shared remote tier")
    if share.get("volume_uuid") != status["volume_uuid"]:
        raise ConfigError(f"that mount uses volume {share.get('volume_uuid')}, not {status['volume_uuid']}")
    peers = (share.get("tail") or {}).get("peers", {})
    lag = {}
    cap = status["log_entries"]
    for n in status["nodes"]:
        nid = n.get("node_id")
        if nid is None or nid == share.get("node_id"):
            continue
        p = peers.get(nid)
        seen = p["next_seq"] if p else 0
        behind = max(0, n["log"]["head"] - max(seen, 1))
        lag[nid] = {"next_seq": seen, "behind": behind, "wrap_risk": round(behind / cap, 4),
                    "needs_rescan": behind >= cap}
    return {"node_id": share.get("node_id"), "slot": share.get("slot"), "polls": share["tail"].get("polls"),
            "rescans": share["tail"].get("rescans"), "peers": lag}


def read_stats(mountpoint: str) -> dict:
    from kvfs import protocol
    path = os.path.join(mountpoint, protocol.CONTROL_NAME, protocol.STATS_FILE)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise ConfigError(f"{path} is not kvfs stats") from None
