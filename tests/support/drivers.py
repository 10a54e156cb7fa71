"""How the runtimes' own controllers drive a storage tier, shared by the tests and
benchmarks/runtime_adapters.py: vLLM's tiering manager's calls on a secondary tier
(:class:`VllmDriver`) and LMCache's controllers' calls on an L2 adapter
(:class:`LmcacheController`). ``wait(predicate, timeout, what)`` polls until the predicate is
truthy (the tests pass ``support.mount.wait_for``; the benchmark a tighter poll)."""
from __future__ import annotations

import itertools
import mmap
import select

import numpy as np
import torch

from support.released import L1Object, released_defs


# -- vLLM --------------------------------------------------------------------------------
def vllm_spec(v, *, model="org/Model-8B", chunk_bytes=1 << 20, tp_size=1, rank=0, dtype="bfloat16",
              agnostic=False):
    """The offloading spec a secondary tier gets: vLLM's normalized ``OffloadingConfig``
    (one KV cache group, 16-token blocks, one block per chunk)."""
    cfg = v.config
    conf = cfg.OffloadingConfig(
        groups=(cfg.OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",),
                                          group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False, extra_config={}, engine_id="e0",
        model=cfg.OffloadingModelConfig(name=model, dtype=dtype), cache=cfg.OffloadingCacheConfig(16, 1),
        parallel=cfg.OffloadingParallelConfig(rank=rank, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
                                              dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=agnostic))

    class Spec(v.base.OffloadingSpec):
        """The spec's normalized config (the scheduler and worker halves are not used here)."""

        def get_manager(self):
            raise NotImplementedError

        def get_worker(self, kv_caches):
            raise NotImplementedError
    return Spec(conf)


def vllm_tier(v, tier_config: dict, *, chunks: int, chunk_bytes: int, wait, **spec_kw) -> "VllmDriver":
    """A tier made by vLLM's released factory over a fresh CPU primary tier: an anonymous
    mapping, page-aligned like vLLM's own (``SharedOffloadRegion``: O_DIRECT needs it)."""
    primary = np.frombuffer(mmap.mmap(-1, chunks * chunk_bytes), dtype=np.uint8).reshape(chunks, chunk_bytes)
    tier = v.tier_factory.SecondaryTierFactory.create_secondary_tier(
        dict(tier_config), memoryview(primary), vllm_spec(v, chunk_bytes=chunk_bytes, **spec_kw))
    return VllmDriver(v, tier, primary, wait)


class VllmDriver:
    """vLLM's tiering manager's calls on one secondary tier, over a CPU primary tier (the
    released scheduler's prefix scan ``_maximal_prefix_lookup`` included)."""

    _ids = itertools.count(1)

    def __init__(self, v, tier, primary: np.ndarray, wait):
        self.v, self.tier, self.primary, self.wait = v, tier, primary, wait
        ns = {"LookupResult": v.base.LookupResult}
        released_defs(v.root / "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                      ["_maximal_prefix_lookup"], ns, cls="OffloadingConnectorScheduler")
        self._scan = ns["_maximal_prefix_lookup"]
        self.manager = tier                       # what the released scan calls lookup() on
        self._events_tracker = self               # and records its hits with
        self.done: dict[int, object] = {}

    def record_lookup(self, *args) -> None:
        pass

    def step(self, ctx) -> None:
        self.tier.on_schedule_end(self.v.base.ScheduleEndContext(new_req_ids=[ctx.req_id], preempted_req_ids=[]))

    def hits(self, keys, req_id=None) -> int:
        """Leading chunks of ``keys`` the tier has: one request, stepped until resolved."""
        ctx = self.v.base.ReqContext(req_id=req_id or f"r{next(self._ids)}")
        self.tier.on_new_request(ctx)
        out: list = []

        def step() -> bool:
            n = self._scan(self, keys, ctx, None, None, 0)
            if n is None:
                self.step(ctx)
                return False
            out.append(n)
            return True
        self.wait(step, 60, "the tier's lookup thread")
        self.tier.on_request_finished(ctx)
        return out[0]

    def submit(self, keys, slots, promotion: bool) -> int:
        job = self.v.tiering.TransferJob(
            job_id=next(self._ids), keys=list(keys), chunk_ids=np.array(slots, dtype=np.int32),
            is_promotion=promotion, req_context=self.v.base.ReqContext(req_id=f"j{next(self._ids)}"))
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        return job.job_id

    def finish(self, job_ids) -> list:
        """Poll ``get_finished_jobs`` until all ``job_ids`` are reported; their results."""
        want = set(job_ids)

        def finished():
            for r in self.tier.get_finished_jobs():
                self.done[r.job_id] = r
            return want <= set(self.done)
        self.wait(finished, 600, f"jobs {sorted(want)[:3]}...")
        return [self.done.pop(j) for j in job_ids]

    def store(self, keys, slots):
        return self.finish([self.submit(keys, slots, False)])[0]

    def load(self, keys, slots):
        return self.finish([self.submit(keys, slots, True)])[0]

    def fill(self, slots, seed: int) -> list[bytes]:
        g = torch.Generator().manual_seed(seed)
        for s in slots:
            self.primary[s] = torch.randint(0, 256, (self.primary.shape[1],), dtype=torch.uint8, generator=g).numpy()
        return [self.primary[s].tobytes() for s in slots]

    def read(self, slots) -> list[bytes]:
        return [self.primary[s].tobytes() for s in slots]


# -- LMCache ------------------------------------------------------------------------------
class LmcacheController:
    """LMCache's controller calls on one L2 adapter (store controller, prefetch controller),
    with L1 objects in one CPU arena."""

    def __init__(self, lm, adapter, wait, arena_bytes: int = 64 << 20):
        self.lm, self.a, self.wait = lm, adapter, wait
        self.arena = torch.zeros(arena_bytes, dtype=torch.uint8)
        self.stored: dict = {}

    def objs(self, n: int, size: int, first: int = 0) -> list[L1Object]:
        return [L1Object(self.arena, (first + i) * size, size) for i in range(n)]

    def _wait(self, fd: int, poll, timeout: float = 60):
        got: list = []

        def ready():
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                self.lm.notifier.consume_fd(fd)
            v = poll()
            if v is not None:
                got.append(v)
            return bool(got)
        self.wait(ready, timeout, "an L2 task")
        return got[0]

    def store_many(self, batches) -> list:
        """Submit one store task per ``(keys, objs)`` batch, then wait for all of them."""
        tids = [self.a.submit_store_task(k, o) for k, o in batches]

        def done():
            self.stored.update(self.a.pop_completed_store_tasks())
            return True if all(t in self.stored for t in tids) else None
        self._wait(self.a.get_store_event_fd(), done, 600)
        return [self.stored.pop(t) for t in tids]

    def store(self, keys, objs):
        return self.store_many([(keys, objs)])[0]

    def lookup(self, keys):
        tid = self.a.submit_lookup_and_lock_task(keys, {})
        return self._wait(self.a.get_lookup_and_lock_event_fd(), lambda: self.a.query_lookup_and_lock_result(tid))

    def load(self, keys, objs):
        tid = self.a.submit_load_task(keys, objs)
        return self._wait(self.a.get_load_event_fd(), lambda: self.a.query_load_result(tid), 600)

    def prefetch(self, keys, objs) -> int:
        """lookup_and_lock, load the locked prefix, unlock: how many objects loaded."""
        n = self.lookup(keys).count_leading_ones()
        if not n:
            return 0
        got = self.load(keys[:n], objs[:n])
        self.a.submit_unlock(keys[:n])
        return got.count_leading_ones()

    def fill(self, objs, seed: int) -> list[bytes]:
        g = torch.Generator().manual_seed(seed)
        for o in objs:
            o.raw_data.copy_(torch.randint(0, 256, (o.get_size(),), dtype=torch.uint8, generator=g))
        return [o.raw_data.numpy().tobytes() for o in objs]
