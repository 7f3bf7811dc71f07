"""Suites against LMCache 0.5: "lmcache" (``peer``) and "prefetch" (``prefetch``), on a prefix
of Llama-3-8B KV in an NvmeStore (``prefix``); LMCache runs in a virtual environment of its own
(``lmcache_env``), through a script that never imports cmx (``lmcache_driver.py``)."""
