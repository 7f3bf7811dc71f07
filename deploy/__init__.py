"""The Ray Serve application: an OpenAI-compatible LLM whose replicas share prefixes cluster-wide.

    config        ServeOptions: the model, the engine, the deployment (frozen dataclasses)
    model         the model (seeded random Llama, or a Hugging Face directory), its KV layout
                  and namespace (weights fingerprint)
    tokenizer     a byte tokenizer for the random model; Hugging Face's for real ones
    engine        one replica's request: prefetch, gate, load, chunked prefill, store, decode
    prefill       chunked prefill on a fixed grid (exact reuse), adopting a load when it lands
    kvcache       the memory's KV tensor <-> transformers' DynamicCache
    memory        what the engine needs of the context memory; the real one over the client
    sampling      greedy, temperature and top-p with a per-request seed
    messages      GenerateRequest / GenerateResult between the ingress and the replicas
    server        LLMServer: the replica (Serve deployment around Engine)
    ingress       OpenAIIngress: /v1/completions, /v1/chat/completions, /v1/models
    openai_types  request and response bodies of the OpenAI API (and the "cmx" extension)
    routing       the prefix-aware ranking of replicas, a plain function
    router        PrefixAwareRouter: Serve's RequestRouter filled with that ranking
    app           the bound application; build_app for Serve config files
    local         the application on an embedded two-node cluster (demo, benchmark)
    launch        `cmx serve`: the application in the background on the local Ray cluster
    workload      the demo's shared-prefix workload
    demo, render  `cmx demo`, the main job, and its tables
    cli           the `demo` and `serve` commands

Files: serve_config.yaml (Serve), kuberay/ (RayService, Redis for GCS fault tolerance),
cluster.yaml (`ray up`).
"""
