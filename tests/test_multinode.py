"""Multi-node tensor parallel, two "nodes" on 127.0.0.1: node 0 runs the engine (in this process),
node 1 is a separate launch of ``python -m sparrow.executor.remote_worker``; they meet through
torch.distributed's env:// rendezvous and the executor's tcp socket, as two machines would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sparrow import LLM, SamplingParams
from sparrow.executor.multiproc import WorkerDiedError
from sparrow.worker.distributed import get_open_port

ENGINE_ARGS = dict(max_model_len=256, dtype="float32", num_kv_blocks=64)
PROMPTS = [{"prompt_token_ids": [(5 * i + n) % 3000 for i in range(n)]} for n in (2, 19, 70)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture
def rendezvous(monkeypatch) -> dict[str, str]:
    """Node 0's environment for a two-node run on this machine."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(get_open_port()),
           "SPARROW_EXECUTOR_PORT": str(get_open_port()), "SPARROW_NNODES": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SPARROW_NODE_RANK", raising=False)
    monkeypatch.delenv("NODE_RANK", raising=False)
    return env


def _two_node_run(model_dir: str, node1_cmd: list[str], node1_env: dict[str, str], **engine_args) -> list[list[int]]:
    """Start node 1's launcher, then the engine on node 0; returns node 0's greedy tokens."""
    # Node 1 first: its launcher waits for node 0's engine, as a cluster scheduler would start them.
    node1 = subprocess.Popen([sys.executable, "-m", "sparrow.executor.remote_worker", "--join-timeout", "120",
                              *node1_cmd], env=node1_env)
    try:
        llm = LLM(model_dir, multiprocess=False, tensor_parallel_size=2, **ENGINE_ARGS, **engine_args)
        try:
            hosts = llm.llm_engine.collective_rpc("process_info")
            assert [info["rank"] for info in hosts] == [0, 1]
            assert hosts[1]["pid"] != hosts[0]["pid"]
            tokens = greedy(llm)
        finally:
            llm.shutdown()
        # Node 0's shutdown reaches node 1's ranks; its launcher then exits cleanly.
        assert node1.wait(timeout=30) == 0
        return tokens
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.fixture(scope="module")
def reference(qwen3_dir) -> list[list[int]]:
    """The tokens on one device (module scope: built before any test's node environment is set)."""
    reference_llm = LLM(qwen3_dir, multiprocess=False, **ENGINE_ARGS)
    try:
        return greedy(reference_llm)
    finally:
        reference_llm.shutdown()


def test_two_nodes_give_the_tokens_of_one_device(qwen3_dir, reference, rendezvous):
    # Configured by environment variables, as torchrun and job schedulers do.
    node1_env = {k: v for k, v in os.environ.items() if k != "SPARROW_NNODES"}
    node1_env["SPARROW_NODE_RANK"] = "1"
    assert _two_node_run(qwen3_dir, [], node1_env) == reference


def test_two_nodes_configured_by_arguments(qwen3_dir, reference, monkeypatch):
    """The same run with no environment: engine arguments on node 0, launcher options on node 1."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "SPARROW_EXECUTOR_PORT", "SPARROW_NNODES", "NNODES",
                 "SPARROW_NODE_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    port = get_open_port()
    node1_cmd = ["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", "1"]
    tokens = _two_node_run(qwen3_dir, node1_cmd, dict(os.environ), nnodes=2, master_addr="127.0.0.1",
                           master_port=port)
    assert tokens == reference


def test_node0_names_the_missing_nodes_when_none_joins(qwen3_dir, rendezvous, monkeypatch):
    monkeypatch.setenv("SPARROW_WORKER_START_TIMEOUT_S", "3")
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"ranks \[(0, )?1\] did not start.*remote_worker"):
        LLM(qwen3_dir, multiprocess=False, tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - started < 60


def test_topology_settings_are_validated():
    from sparrow.executor.topology import NodeTopology

    topology = NodeTopology.from_env({"SPARROW_NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                                      "MASTER_PORT": "29500"})
    assert topology.resolved_executor_port == 29501
    assert list(topology.node_ranks(4)) == [2, 3]
    assert NodeTopology.from_env({"MASTER_PORT": "1"}, nnodes=2, master_addr="h").master_addr == "h"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        NodeTopology.from_env({"SPARROW_NNODES": "2", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match="SPARROW_NODE_RANK"):
        NodeTopology.from_env({"SPARROW_NNODES": "2", "SPARROW_NODE_RANK": "2", "MASTER_ADDR": "a",
                               "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        NodeTopology(nnodes=2).ranks_per_node(3)
