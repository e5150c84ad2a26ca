"""
Times the torchrun transport of ops/distributed.py: trajectory messages per second through the job's store,
and weight transfers (packing on the trainer's thread, the background gloo send, the time until every
searcher has loaded them) for 10M and 100M parameters.

Run: torchrun --standalone --nproc-per-node 3 -m bench.transport      # 1 trainer rank + 2 searcher ranks
"""

import os
import time

import torch

from buffer import Trajectory
from ops.devices import torchrun_rank
from ops.distributed import POLL_S, DistSearchers, StoreLink, connect


class _Flat(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def main(batches=300, sizes=(10_000_000, 100_000_000)):
    """Trajectory messages per second through the store (searchers push tiny-preset-sized batches of 64
    trajectories of 40 tokens as fast as they can; rank 0 drains them), and the weights: packing on the
    trainer's thread, the background transfer, and the time until every searcher has loaded them."""
    import types
    rank, world = torchrun_rank(), int(os.environ["WORLD_SIZE"])
    cfg = types.SimpleNamespace(num_searchers=world - 1, sync_every=1, searcher_timeout=300.0, queue_size=10 ** 9)
    if rank:
        store = connect()
        link = StoreLink(store, rank, cfg)
        batch = [Trajectory(prompt_id=i, response_ids=tuple(range(40)), reward=1.0, policy_version=0) for i in range(64)]
        store.wait(["go"])
        for _ in range(batches):
            link.put(batch)
        for n in sizes:
            while link.ready.get("policy", (None,))[0] != n and link.alive():  # (a model of this size's weights)
                time.sleep(0.001)
            link.pull("policy", _Flat(n), -1)
            store.add(f"loaded/{n}", 1)
        while link.alive():
            time.sleep(POLL_S)
        link.close()
        return
    rollout = DistSearchers(cfg)
    rollout.store.set("go", "1")
    t0, got = time.time(), 0
    while got < batches * cfg.num_searchers:
        got += len(rollout.poll()) // 64
    seconds = time.time() - t0
    print(f"trajectories: {got} messages of 64 trajectories x 40 tokens from {cfg.num_searchers} searchers in "
          f"{seconds:.2f} s: {got / seconds:.0f} messages/s, {64 * got / seconds:.0f} trajectories/s", flush=True)
    for n in sizes:
        model = _Flat(n)
        t0 = time.time()
        rollout.sender.send([("policy", n, model)], wait=True)
        t_packed = time.time()
        rollout.sender.join(300)
        t_sent = time.time()
        while rollout.store.add(f"loaded/{n}", 0) < cfg.num_searchers:
            time.sleep(0.001)
        assert not rollout.sender.error, rollout.sender.error
        print(f"weights: {n / 1e6:.0f}M float32 parameters ({4 * n / 1e6:.0f} MB) to {cfg.num_searchers} searchers: "
              f"pack {t_packed - t0:.3f} s (trainer's thread), transfer {t_sent - t_packed:.3f} s (background), "
              f"loaded by all {time.time() - t0:.3f} s after the publish", flush=True)
    rollout.close()


if __name__ == "__main__":
    main()
