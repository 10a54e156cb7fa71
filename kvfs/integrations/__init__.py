"""Native runtime adapters: inference runtimes store KV pages on a kvfs mount through the
extension points they ship, using kvfs's one-call lookup and lease fast path.

* :mod:`kvfs.integrations.pages` -- the runtime-neutral core: a directory of raw page files
  on a kvfs mount, one ``.kvfs/lookup`` call per batch of existence checks, one
  ``.kvfs/lease`` call per batch of reads (backing files read beside FUSE, xxh3-verified),
  writes through the mount, every kvfs failure turned into a miss, counters.
* :mod:`kvfs.integrations.sglang` -- SGLang HiCache storage backend (``dynamic`` backend).

Each runtime module imports its runtime; this package imports nothing heavy.
"""
