"""Suites end to end through vLLM (CPU, SmolLM2-135M-Instruct):

    e2e           "e2e": time to first token through the Serve application
    e2e_miss      "e2e-miss": a miss's cost, engines with and without CMXConnector paired
                  (e2e_engine: one engine in a process of its own; e2e_pairs: the pairing)
    vllm_serve    "e2e-serve": vLLM's OpenAI servers driven by ``vllm bench serve``
                  (vllm_client runs it, vllm_results reads it, serve_sweep raises its
                  rates until a run breaks the p99 target, serve_report judges it)
"""
