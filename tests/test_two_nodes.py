"""Every strategy across machines: two torchrun "nodes" on this machine keep the parity contract.

Two ``torchrun`` invocations, ``--nnodes 2 --node-rank 0`` and ``--node-rank 1``, two
processes each, meet at a loopback address (static rendezvous: ``--master-addr
127.0.0.1 --master-port PORT``, node 0 hosts the store): world 4, exactly the commands
one would type on two machines with the first one's address. One pair runs every
strategy one after another (tests/two_nodes_driver.py); each run's ``metrics.json``
losses must equal ``--strategy single``'s within test_train.py's tolerance, and its
bytes per step the record's prediction. The static rendezvous gives node 0 ranks 0
and 1 (checked), so HYBRID_SHARD's 2 x 2 layout shards inside each node and
all-reduces across the two, as on real machines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import two_nodes_driver as driver

from minifsdp.strategies import STRATEGIES
from minifsdp.train import train

LOSS_RTOL = 1e-5    # test_train.py's: fp32, reductions in another order
TIMEOUT_S = 300     # the pair takes ~30 s on 2 busy cores; a stuck rank ends the test here
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_nodes_driver.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc): torchrun's workers run in sessions of their own."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _stop(procs: list[subprocess.Popen]) -> None:
    """End both nodes: SIGTERM to each agent (torchrun then ends its workers), SIGKILL to whatever is left."""
    workers = [c for p in procs for c in _children(p.pid)]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in workers:  # a worker its agent could not end (the agent was killed): still ours if it runs DRIVER
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if DRIVER.encode() in f.read():
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _run_two_nodes(out: str, port: int) -> tuple[list[int], list[str]]:
    """Start node 0 and node 1 (2 processes each) on ``port``; their exit codes and outputs."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs, logs = [], []
    for node in (0, 1):
        log = open(os.path.join(out, f"node{node}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), DRIVER, out],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline, failed_at = time.monotonic() + TIMEOUT_S, None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"the two torchrun nodes did not finish in {TIMEOUT_S} s:\n" + _tails(logs))
            if failed_at is None and any(p.poll() for p in procs):
                failed_at = time.monotonic()  # one node failed: the other may wait for it, give it 10 s to say why
            if failed_at is not None and time.monotonic() - failed_at > 10:
                break
            time.sleep(0.2)
    finally:
        _stop(procs)
    return [p.returncode for p in procs], [_read(log) for log in logs]


def _read(log) -> str:
    log.seek(0)
    text = log.read()
    log.close()
    return text


def _explain(node: int, code: int, output: str) -> str:
    """A failed node's workers' tracebacks (torchrun prefixes their lines ``[rankN]:``), then its own summary."""
    workers = "\n".join(line for line in output.splitlines() if line.startswith("[rank"))
    return f"--- node {node} (exit {code}), its workers:\n{workers[:6000]}\n--- torchrun:\n{output[-1500:]}"


def _tails(logs) -> str:
    return "\n".join(f"--- node {i}:\n{_read(log)[-3000:]}" for i, log in enumerate(logs))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """One torchrun pair runs every strategy; rank 0 of node 0 writes each run's metrics."""
    out = str(tmp_path_factory.mktemp("two_nodes"))
    for attempt in (0, 1):
        codes, outputs = _run_two_nodes(out, _free_port())
        in_use = any("EADDRINUSE" in o or "address already in use" in o.lower() for o in outputs)
        if codes == [0, 0] or not in_use or attempt:
            break  # the port was taken between choosing it and binding it: choose another, once
    assert codes == [0, 0], "\n".join(_explain(i, c, o) for i, (c, o) in enumerate(zip(codes, outputs)))
    return out


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    """``--strategy single``'s losses for each model and sequence length the runs use."""
    out = tmp_path_factory.mktemp("single")
    losses = {}
    for name in driver.RUNS:
        cfg = driver.config(name, str(out))
        key = (cfg.model, cfg.seq_len)
        if key not in losses:
            single = driver.config(name, str(out / f"{cfg.model}-{cfg.seq_len}"))
            single.strategy, single.world_size = "single", 1
            losses[key] = train(single)["losses"]
    return losses


def test_the_two_nodes_were_two(two_nodes):
    ranks = json.load(open(os.path.join(two_nodes, "ranks.json")))
    # the static rendezvous numbers node 0's processes first: ranks 0, 1 on node 0, ranks 2, 3 on node 1
    assert [(r["RANK"], r["GROUP_RANK"], r["LOCAL_RANK"]) for r in ranks] == \
        [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"} and {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}


@pytest.mark.parametrize("name", list(driver.RUNS))
def test_strategy_across_two_nodes(two_nodes, single_losses, name):
    cfg = driver.config(name, two_nodes)
    metrics = json.load(open(os.path.join(cfg.out, "metrics.json")))
    assert metrics["strategy"] == cfg.strategy and metrics["world_size"] == driver.WORLD_SIZE
    reference = single_losses[(cfg.model, cfg.seq_len)]
    assert len(metrics["losses"]) == cfg.steps
    for a, b in zip(metrics["losses"], reference):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (name, metrics["losses"], reference)
    assert metrics["losses"][-1] < metrics["losses"][0]  # it trains
    record = STRATEGIES[cfg.strategy]
    expected = record.expected_bytes(cfg, record.layout(cfg))["by_op"]
    assert metrics["bytes_per_step"][0] == expected, name
