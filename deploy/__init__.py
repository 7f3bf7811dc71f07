"""The Ray Serve application: an OpenAI-compatible LLM whose vLLM replicas share prefixes
cluster-wide through the context memory (``CMXConnector``).

    config         ServeOptions: the model, the vLLM engine, the deployment (frozen dataclasses)
    model          the served model's directory, tokenizer and chat template, KV layout and
                   namespace (weights fingerprint)
    devices        what a replica's node gives its engine: CUDA devices, Ray's GPUs
    vllm_engine    vLLM's AsyncLLM in a replica: its settings by the node's devices (CPU or
                   CUDA), its kv_transfer_config (CMXConnector, vLLM's ExampleConnector, or none)
    service        a replica's link to the context memory: started or joined, slots checked
    server         LLMServer: the replica (prefetch on arrival, vLLM, a stream of deltas)
    messages       GenerateRequest / Delta / Summary between the ingress and the replicas
    ingress        OpenAIIngress: /v1/completions, /v1/chat/completions, /v1/models
    openai_types   request bodies of the OpenAI API, bounded
    openai_bodies  response bodies, stream chunks and errors of the OpenAI API
    errors         OpenAI-style 4xx errors at the HTTP edge, bounded body reads
    tenants        who a request is from (its API key) and its namespace salt (with cache_salt)
    apikeys        the API key file: each key's SHA-256 and its tenant, mode 0600
    auth           the key check where a prompt enters, a FastAPI dependency of the ingress
    routing        the prefix-aware ranking of replicas, a plain function
    router         PrefixAwareRouter: Serve's RequestRouter filled with that ranking
    app            the bound application; build_app for Serve config files
    serve_llm      the same engine and connector under Ray Serve LLM (ray.serve.llm)
    serve_llm_server  CMXLLMServer: Ray Serve LLM's replica, its engine's shared memory reaped
    local          the application on an embedded two-node cluster (demo, benchmark)
    launch         `cmx serve`: the application in the background on the local Ray cluster
    workload       the demo's shared-prefix workload
    demo, render   `cmx demo`, the main job, and its tables
    cli            the `demo` and `serve` commands; keys_cli: `cmx keys add | list`

Files: serve_config.yaml (Serve), serve_llm_config.yaml (Ray Serve LLM's app, two replicas on
two cores), kuberay/ (RayServices on CPU hosts and on GPU hosts, Redis for GCS fault tolerance),
cluster.yaml (`ray up`); each says at its top which image it runs.
"""
