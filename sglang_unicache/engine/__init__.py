"""The engine side: the plugin inside SGLang (with ``platform/``, the only code that imports it).

In a request's order (``docs/architecture.md`` walks it):

- ``plugin.py``     entry point: version check (``compat.py``), every hook registered
- ``flags.py``, ``startup.py``, ``support.py``  ``--unicache*`` flags, startup checks, refusals
- ``hooks.py``      SGLang's calls, each adapted to one owner's method
- ``controller.py`` the parts of one scheduler, built once
- ``reuse.py``      match time: known images rewritten to the compressed spans the tree holds
- ``targets.py``, ``capture.py``  before an extend: who compresses what; the observation queries
- ``compress.py``   after prefill: plan, check, write, compact, free
- ``kvpool.py``     every slot write and free; ``rewrite.py``, ``positions.py`` a request's ids,
  lengths and positions; ``request.py`` its typed state
- ``radix_cache.py``, ``spans.py``  the radix-cache backend and its span metadata
- ``overlap.py``    the overlap scheduler's order around a compressing prefill
- ``outcomes.py``, ``stats.py``, ``metrics.py``, ``integrity.py``  what the user reads
- ``host_pool.py``  HiCache's host pool as int8/int4 rows; ``scale/`` data and tensor parallel
"""
