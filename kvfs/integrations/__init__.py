"""Native runtime adapters: inference runtimes store KV pages on a kvfs mount through the
extension points they ship, using kvfs's one-call lookup and lease fast path.

* :mod:`kvfs.integrations.pages` -- the runtime-neutral core: a directory of raw page files
  on a kvfs mount, one ``.kvfs/lookup`` call per batch of existence checks, one
  ``.kvfs/lease`` call per batch of reads (backing files read beside FUSE, xxh3-verified),
  writes through the mount, every kvfs failure turned into a miss, counters.
  ``hold`` pins what one lease request found until it is released (lookup-and-lock).
* :mod:`kvfs.integrations.sglang` -- SGLang HiCache storage backend (``dynamic`` backend).
* :mod:`kvfs.integrations.vllm` -- vLLM offloading connector secondary tier
  (``TieringOffloadingSpec``), in its ``fs`` tier's file layout.
* :mod:`kvfs.integrations.lmcache` -- LMCache L2 adapter (``plugin`` type), in its ``fs``
  adapter's file layout; lookup_and_lock is one lease.

Each runtime module imports its runtime; this package imports nothing heavy.
"""
