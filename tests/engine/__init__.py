"""vLLM on CPU with the real model and the context memory as its KV connector.

A package, so its Ray cluster and engines are torn down when its last test ends, before the
integration tests start a cluster of their own.
"""
