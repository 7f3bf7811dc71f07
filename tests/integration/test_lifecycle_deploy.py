"""Deployable: a client connected while the service is down gets misses, then finds the service
when it returns; ``start_service="wait"`` waits for someone else to start it, within a bound;
a DPU that joins after its host takes the host's agent over, and gives it back when it leaves."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from lifecycle_support import new_machine
from support import LAYOUT, client_on

from cmx.links import RAY_NAMESPACE, actor_name

WAIT = """
import json, threading, torch
from cmx import ContextMemory, KVLayout
from cmx.actors.service import ensure_service, stop_service
from cmx.errors import UnavailableError

layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
tokens = list(range(64))
kv = torch.randn(layout.shape(64), generator=torch.Generator().manual_seed(3)).to(torch.float16)
early = ContextMemory.connect(start_service=False, num_cpus=1, include_dashboard=False)
ns = early.namespace("m", layout)
out = {"ready_before": early.ready(), "found_before": ns.lookup(tokens).num_tokens}
threading.Timer(2.0, ensure_service, args=(early.config,)).start()  # the service comes up
ContextMemory.connect(start_service="wait", join_timeout_s=240)
out["ready_after"] = early.ready()
out["stored"] = ns.store(tokens, kv).wait()
out["found"] = ns.lookup(tokens).num_tokens
out["exact"] = bool(torch.equal(ns.load(tokens), kv))
stop_service()
try:
    ContextMemory.connect(start_service="wait", join_timeout_s=2)
    out["wait_error"] = None
except UnavailableError as exc:
    out["wait_error"] = type(exc).__name__
early.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_a_client_connected_while_the_service_is_down_finds_it_when_it_returns(
    tmp_path: Path,
) -> None:
    m = new_machine(tmp_path, with_token=False)
    out = m.python(WAIT, timeout_s=400, RAY_ADDRESS="")
    assert (out["ready_before"], out["found_before"]) == (False, 0)
    assert out["ready_after"] is True
    assert (out["stored"], out["found"], out["exact"]) == (4, 64, True)
    assert out["wait_error"] == "UnavailableError"
    shutil.rmtree(m.ray_tmp, ignore_errors=True)


def _placement(node_id: str) -> dict[str, Any]:
    agent = ray.get_actor(actor_name("agent", node_id), namespace=RAY_NAMESPACE)
    return dict(ray.get(agent.placement.remote(), timeout=60))


def _reconcile() -> dict[str, Any]:
    controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
    return dict(ray.get(controller.reconcile.remote(), timeout=240))


def _placed(node_id: str, on: str, within_s: float = 120.0) -> bool:
    """Reconcile until ``node_id``'s agent runs on ``on``. The move is read from the agent, not
    from a reconcile's report: the controller's own loop reconciles every two seconds and may
    make the move (and report it) before the test's call does; and Ray may list a node it was
    just told to remove as alive for a moment."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        _reconcile()
        try:
            if _placement(node_id)["placed_on"] == on:
                return True
        except Exception:  # noqa: BLE001 - the agent is restarting on its new node
            pass
        time.sleep(1.0)
    return False


@pytest.mark.timeout(600)
def test_a_dpu_that_joins_after_its_host_takes_its_agent_over(
    cluster: Any, cm: Any, config: Any
) -> None:
    # The nodes join the session's shared cluster: whatever happens, they leave it again, so a
    # failure here cannot spill into the suites after it.
    added: list[Any] = []
    try:
        _dpu_takeover(cluster, config, added)
    finally:
        for node in added:
            try:
                cluster.remove_node(node)
            except Exception:  # noqa: BLE001 - removed by the scenario already
                pass
        _reconcile()


def _dpu_takeover(cluster: Any, config: Any, added: list[Any]) -> None:
    host = cluster.add_node(num_cpus=0, labels={config.host_label: "rack3-h2"})
    added.append(host)
    cluster.wait_for_nodes()
    _reconcile()
    assert _placement(host.node_id)["dpu"] is False

    dpu = cluster.add_node(
        num_cpus=0, labels={config.dpu_label: "bluefield-3", config.host_label: "rack3-h2"})
    added.append(dpu)
    cluster.wait_for_nodes()
    assert _placed(host.node_id, dpu.node_id)
    assert _placement(host.node_id) == {"node": host.node_id, "placed_on": dpu.node_id,
                                        "dpu": True}
    toks = np.random.default_rng(5).integers(0, 50_000, 2 * LAYOUT.block_tokens, dtype=np.uint32)
    remote = client_on(host.node_id, config)
    assert ray.get(remote.store.remote("m-dpu", LAYOUT, "t", toks,
                                       LAYOUT.random_kv(len(toks), seed=5))) == 2

    added.remove(dpu)
    cluster.remove_node(dpu)  # the DPU goes: the agent comes back to its host
    assert _placed(host.node_id, host.node_id)
    assert _placement(host.node_id)["dpu"] is False
    ray.kill(remote)
    added.remove(host)
    cluster.remove_node(host)


REPLICA = """
import json, sys, torch, ray
from cmx import ContextMemory, KVLayout
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.actors.service import stop_service
from cmx.config import ServiceConfig
from cmx.deploy.config import ServeOptions
from cmx.deploy.model import ModelInfo
from cmx.deploy.service import join_service

layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
model = ModelInfo(path="", name="tiny", layout=layout, weights="w", vocab_size=100,
                  max_model_len=256)
config = ServiceConfig(block_bytes=layout.block_bytes, hbm_bytes=1 << 20, dram_bytes=1 << 20,
                       nvme_bytes=8 << 20, nvme_dir=sys.argv[1])
# A replica's process: Ray is up (Serve started it), and nothing has started the service.
ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE)
node = ray.get_runtime_context().get_node_id()
def running():
    try:
        ray.get_actor(actor_name("dram", node), namespace=RAY_NAMESPACE)
        return True
    except ValueError:
        return False
out = {"before": running()}
link = join_service(ServeOptions(service=config, service_wait_s=120), model)
out["after"] = running()
tokens = list(range(64))
kv = torch.randn(layout.shape(64), generator=torch.Generator().manual_seed(5)).to(torch.float16)
ns = link.cm.namespace(model.name, layout, "tenant", model.weights)
out["stored"] = ns.store(tokens, kv).wait()
out["found"] = ns.lookup(tokens).num_tokens
out["exact"] = bool(torch.equal(ns.load(tokens), kv))
stop_service()
ray.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_a_replica_starts_the_service_where_none_runs(tmp_path: Path) -> None:
    """A Serve replica (``serve deploy`` or a RayService) on a cluster where nothing started
    the context memory service starts it itself, with slots of the model's block, and its
    stores are found and loaded back."""
    m = new_machine(tmp_path, with_token=False)
    out = m.python(REPLICA.replace("sys.argv[1]", repr(str(tmp_path / "nvme"))),
                   timeout_s=400, RAY_ADDRESS="")
    assert (out["before"], out["after"]) == (False, True)
    assert (out["stored"], out["found"], out["exact"]) == (4, 64, True)
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
