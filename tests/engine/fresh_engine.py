"""A fresh vLLM engine in a process of its own (multiprocessing on: its scheduler and worker in
two more), joined to a running service; prints what it made of each prompt as JSON, one line
each, in order.

    python fresh_engine.py RAY_ADDRESS SERVICE_JSON PROMPT_JSON [SETTINGS_JSON]

PROMPT_JSON: {"text": ..., "max_tokens": ...}, or {"requests": [{"text": ..., "salt": ...}],
"max_tokens": ...} for several prompts, one after the other; SETTINGS_JSON: more
``kv_connector_extra_config`` settings (e.g. {"load_mode": "async"}).
"""

from __future__ import annotations

import json
import sys
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
    llm = LLM(**engine_kwargs(), kv_transfer_config=config)
    greedy = SamplingParams(max_tokens=prompt["max_tokens"], temperature=0)
    for item in prompt.get("requests") or [{"text": prompt["text"]}]:
        request: Any = {"prompt": item["text"]}
        if item.get("salt"):
            request["cache_salt"] = item["salt"]
        out = llm.generate([request], greedy, use_tqdm=False)[0]
        print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                      "prompt_ids": list(out.prompt_token_ids or ()),
                                      "cached": out.num_cached_tokens,
                                      "report": out.kv_transfer_params}), flush=True)


if __name__ == "__main__":
    main()
