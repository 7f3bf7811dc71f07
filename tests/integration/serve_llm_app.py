"""The Serve application on a two-node cluster of its own, in a process of its own, for
``test_serve_llm``.

The session's cluster runs a service whose slots are sized for the tests' tiny layout; the real
model's blocks need slots of their own, and one Ray cluster per process is all Ray allows. So
the test starts this script, which runs ``cmx.deploy.local.local_app`` (two nodes, the service,
one vLLM replica per node) and speaks JSON lines on stdin/stdout:

    -> {"ready": {"base_url": ..., "replicas": [...], "info": {...},
                  "serve_llm_url": ...}}                                once up
    <- {"lookup": {"salt": "...", "ids": [...]}}  -> {"tokens": N}        cached prefix length
    stdin closed                                                          everything stops
"""

from __future__ import annotations

import json
import sys
from typing import Any

from cmx.deploy.config import EngineOptions, ServeOptions
from cmx.deploy.local import LocalApp, local_app

# 32-token blocks (1.4 MiB in float32), a short context: prompts of a few hundred tokens.
# float32: greedy tokens compared with and without the cache do not hinge on bfloat16's
# rounding of a prompt computed in one pass against its tail over a cached prefix.
OPTIONS = ServeOptions(
    engine=EngineOptions(block_size=32, max_model_len=2048, max_num_seqs=8, gate=False,
                         dtype="float32"),
    replicas=2, app_name="cmx-llm-test", route_prefix="/cmx-llm",
    route_lookup_timeout_s=5.0)  # busy test machines: a late directory is no preference


def _answer(app: LocalApp, command: dict[str, Any]) -> dict[str, Any]:
    if "lookup" in command:
        args = command["lookup"]
        return {"tokens": app.namespace(args["salt"]).lookup(args["ids"]).num_tokens}
    raise ValueError(f"unknown command {sorted(command)}")


def serve_llm(app: LocalApp) -> str:
    """``ray.serve.llm``'s own OpenAI app beside it, one replica with the same connector and
    model (so the same namespace); its base URL."""
    from ray import serve

    from cmx.deploy.serve_llm import build_app

    options = OPTIONS.replace(replicas=1, service=app.options.service,
                              max_replicas_per_node=None)
    serve.run(build_app(options.to_args()), name="serve-llm", route_prefix="/serve-llm")
    return app.base_url.rsplit("/", 1)[0] + "/serve-llm"


def main() -> None:
    with local_app(OPTIONS, step=lambda s: print(json.dumps({"step": s}), flush=True)) as app:
        ready = {"base_url": app.base_url, "replicas": app.replicas, "info": app.info,
                 "serve_llm_url": serve_llm(app)}
        print(json.dumps({"ready": ready}), flush=True)
        for line in sys.stdin:
            try:
                reply = _answer(app, json.loads(line))
            except Exception as exc:  # noqa: BLE001 - told to the test, which fails on it
                reply = {"error": repr(exc)}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
