"""How the service meets real engines.

- ``vllm``: ``CMXConnector``, vLLM's KV connector (``kv_transfer_config``), wiring
  ``vllm_scheduler`` (which prefix to load, which blocks to store) and ``vllm_worker`` (moving
  the blocks), with ``vllm_meta`` the data between them.
- ``sglang``: a ``HiCacheStorage`` backend for SGLang's hierarchical cache.
- ``paged``: gather and scatter between an engine's paged KV layout and the service's blocks.
- ``settings``: what a connector is told, and how it reaches the service.

Nothing here is imported by ``cmx`` itself: each engine's module imports that engine.
"""
