"""A fresh vLLM engine in a process of its own (multiprocessing on: its scheduler and worker in
two more), joined to a running service; prints what it made of each prompt as JSON, one line
each, in order.

    python fresh_engine.py RAY_ADDRESS SERVICE_JSON PROMPT_JSON [SETTINGS_JSON]

PROMPT_JSON: {"text": ..., "max_tokens": ...}, or {"requests": [{"text": ..., "salt": ...,
"cmx": {...}, "until_cached": N}], "max_tokens": ...} for several prompts, one after the
other ("cmx": the request's ``kv_transfer_params["cmx"]``; "until_cached": sent again, up to
N times, half a second apart, until some of its prompt comes from a cache: a store of an
earlier request commits behind its answer), with "engine": more ``LLM`` arguments (e.g.
{"tensor_parallel_size": 3}); SETTINGS_JSON: more ``kv_connector_extra_config`` settings
(e.g. {"load_mode": "async"}). Each result has the log-probability of each token chosen.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    address, service, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    settings = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    from vllm_support import engine_kwargs, set_engine_env, transfer_config

    set_engine_env()
    from vllm import LLM, SamplingParams

    from cmx.config import ServiceConfig

    config = transfer_config(ServiceConfig(**service), ray_address=address, gate=False,
                             **settings)
    llm = LLM(**engine_kwargs(**prompt.get("engine", {})), kv_transfer_config=config)
    for item in prompt.get("requests") or [{"text": prompt["text"]}]:
        request: Any = {"prompt": item["text"]}
        if item.get("salt"):
            request["cache_salt"] = item["salt"]
        extra = {"kv_transfer_params": {"cmx": item["cmx"]}} if "cmx" in item else None
        greedy = SamplingParams(max_tokens=prompt["max_tokens"], temperature=0, logprobs=0,
                                extra_args=extra)
        for _ in range(max(1, item.get("until_cached", 1))):
            out = llm.generate([request], greedy, use_tqdm=False)[0]
            if out.num_cached_tokens or "until_cached" not in item:
                break
            time.sleep(0.5)
        chosen = out.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(chosen.token_ids, chosen.logprobs or ())]
        print("RESULT " + json.dumps({"tokens": list(chosen.token_ids), "logprobs": logprobs,
                                      "prompt_ids": list(out.prompt_token_ids or ()),
                                      "cached": out.num_cached_tokens,
                                      "report": out.kv_transfer_params}), flush=True)


if __name__ == "__main__":  # vLLM's tensor-parallel workers start by spawning
    main()
