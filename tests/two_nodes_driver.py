"""Every strategy's training, one after another, in one torchrun job: what tests/test_two_nodes.py starts twice.

Run by two ``torchrun`` invocations on this machine, ``--nnodes 2 --node-rank 0`` and
``--node-rank 1``, two processes each (world 4, loopback rendezvous): each strategy's
trainer loop (``minifsdp.train.run_rank``) runs on the four ranks, rank 0 writes its
``metrics.json`` to ``OUT/<name>/`` exactly as ``python -m minifsdp.train`` does under
torchrun (``train.train``'s torchrun branch: ``run_rank``, gather every rank's result,
``write_outputs``). One process group serves every run, so the job pays for torchrun,
``import torch`` and the rendezvous once instead of seven times.

``RUNS`` is the table both files read: a name, the trainer's flags (world size 4 is implied).
HYBRID_SHARD is 2 x 2 here, shard groups inside a node ({0, 1}, {2, 3}: the static rendezvous
numbers node 0's processes first) and replicas across the nodes, the layout it is made for.
Pure tensor parallel at 4 ranks needs 4 heads: gpt-mini, on short sequences to stay quick.

    python -m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port PORT tests/two_nodes_driver.py OUT
"""

from __future__ import annotations

import os
import sys
from typing import Any

COMMON: dict[str, Any] = dict(model="gpt-tiny", steps=3, batch_size=8, quiet=True, track_memory=False,
                              write_plots=False)

RUNS: dict[str, dict[str, Any]] = {
    "ddp": dict(strategy="ddp"),
    "fsdp": dict(strategy="fsdp"),
    "fsdp2": dict(strategy="fsdp2"),
    "hybrid_shard": dict(strategy="fsdp", sharding_strategy="HYBRID_SHARD"),
    "pp": dict(strategy="pp", pp=4, micro_batches=4),
    "tp": dict(strategy="tp", tp=4, model="gpt-mini", seq_len=16),
    "fsdp+tp": dict(strategy="fsdp+tp", dp=2, tp=2),
}
WORLD_SIZE = 4


def config(name: str, out: str) -> Any:
    """The trainer's config of run ``name`` writing to ``out/name`` (the test's single runs use it too)."""
    from minifsdp.train import TrainConfig

    return TrainConfig(**{**COMMON, "world_size": WORLD_SIZE, **RUNS[name]}, out=os.path.join(out, name))


def main(out: str) -> None:
    import torch.distributed as tdist

    from minifsdp import dist
    from minifsdp.tensor_parallel import destroy_model_parallel
    from minifsdp.train import run_rank, validate, write_outputs

    # A rank that fails leaves the others in a collective: a short timeout ends them too
    dist.init(timeout_s=120)
    assert dist.world_size() == WORLD_SIZE, f"started {dist.world_size()} ranks, the runs are for {WORLD_SIZE}"
    for name in RUNS:
        cfg = config(name, out)
        validate(cfg)
        result = run_rank(cfg)
        destroy_model_parallel()  # tp's mesh is one per process (FairScale's rule): the next run makes its own
        gathered: list[Any] = [None] * dist.world_size()
        tdist.all_gather_object(gathered, result)
        if dist.rank() == 0:
            write_outputs(cfg, gathered)
            print(f"[two nodes] {name}: losses {result['losses']}", flush=True)
    # What each rank was told by torchrun, for the test to check the two nodes really were two
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    envs: list[Any] = [None] * dist.world_size()
    tdist.all_gather_object(envs, env)
    if dist.rank() == 0:
        import json

        with open(os.path.join(out, "ranks.json"), "w") as f:
            json.dump(envs, f)
    dist.destroy()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: two_nodes_driver.py OUT (under torchrun, world size 4)")
    main(sys.argv[1])
