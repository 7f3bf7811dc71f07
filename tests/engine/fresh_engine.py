"""A fresh vLLM engine in a process of its own (multiprocessing on: its scheduler and worker in
two more), joined to a running service; prints what it made of one prompt as JSON.

    python fresh_engine.py RAY_ADDRESS SERVICE_JSON PROMPT_JSON
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    address, service, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    from vllm_support import engine_kwargs, set_engine_env, transfer_config

    set_engine_env()
    from vllm import LLM, SamplingParams

    from cmx.config import ServiceConfig

    config = transfer_config(ServiceConfig(**service), ray_address=address, gate=False)
    llm = LLM(**engine_kwargs(), kv_transfer_config=config)
    out = llm.generate([prompt["text"]], SamplingParams(max_tokens=prompt["max_tokens"],
                                                        temperature=0), use_tqdm=False)[0]
    print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                  "cached": out.num_cached_tokens,
                                  "report": out.kv_transfer_params}), flush=True)


if __name__ == "__main__":
    main()
