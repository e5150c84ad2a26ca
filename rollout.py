"""
Where the trainer's trajectories come from: searcher processes (TBA) or in-process generation (--sync).

The trainer loop (tba.py) talks to one rollout object through this interface:

    rollout.start(cfg, task, policy, ref, tokenizer, step)   hand the searchers their work
    rollout.merge(buffer, step)      drain what arrived into the buffer as one round; returns the new items
                                     (the first merge waits for --initial-completions trajectories)
    rollout.sample(buffer)           the training batch: Q groups of K trajectories of one query each
    rollout.publish(policy, version) make the trainer's weights the searchers' policy
    rollout.publish_ref(ref, version)  ... and their reference, after a TBA' reset
    rollout.check_alive()            raise SearcherDied if a searcher died or went silent (or restart it)
    rollout.period                   merge and publish every this many steps (k; 1 for --sync)
    rollout.received, .restarts      counters for the metrics
    rollout.state_dict(), load_state_dict(state), close()

`AsyncRollout` runs `num_searchers` processes (searcher.py), one queue each, and shares the weights with
them through shared memory (`SharedWeights`). It starts them as soon as it is created, before the trainer
has imported torch or loaded a model: importing torch and transformers takes a process about 5 s here,
and this way the searchers' start-up overlaps with the trainer's instead of following it. Each searcher
then waits for its job (config, task, weights), sent by `start`.
Under torchrun, `distributed.DistRollout` has the same interface, its searchers being the other ranks;
`merge_round` (draining the searchers into the buffer) is shared by both.
`SyncRollout` is the on-policy baseline: each step it generates a fresh batch with the trainer's own
policy, then the trainer trains on exactly that batch.

This module imports torch only inside functions, so creating an AsyncRollout costs milliseconds.
"""

import multiprocessing
import os
import queue
import signal
import time

from tqdm import tqdm

from config import RunError, torchrun_rank


class SearcherDied(RunError):
    pass


class StopRequested(Exception):
    """A stop signal arrived while the trainer waited for searchers (tba.train checkpoints and stops)."""


class SharedWeights:
    """A state dict in shared memory and a version counter: the trainer publishes, searchers pull.

    The counter and its lock exist from the start and travel to each searcher as it is spawned; the tensors
    are allocated by `allocate` once the trainer has its model, and travel with the searchers' job."""

    def __init__(self, ctx):
        self.version = ctx.Value("q", -1)  # the trainer step whose weights the tensors hold
        self.lock = ctx.Lock()
        self.tensors = None

    def allocate(self, model, version):
        self.tensors = {n: t.detach().to("cpu", copy=True).share_memory_() for n, t in model.state_dict().items()}
        self.version.value = version

    def publish(self, model, version):
        with self.lock:
            for n, t in model.state_dict().items():
                self.tensors[n].copy_(t.detach())
            self.version.value = version

    def pull(self, target, have_version):
        """Copy into `target` (a model) if newer than have_version; return the version it now holds."""
        if self.version.value == have_version:
            return have_version
        with self.lock:
            target.load_state_dict(self.tensors)
            return self.version.value


# -----------------------------------------------------------------------------
# Asynchronous: searcher processes

class AsyncRollout:
    """The searcher processes, one queue each, and the shared weights. Always `close()` it."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ctx = multiprocessing.get_context("spawn")  # CUDA-safe; each child imports what it needs
        self.stop_event = self.ctx.Event()
        self.policy_weights, self.ref_weights = SharedWeights(self.ctx), SharedWeights(self.ctx)
        n = cfg.num_searchers
        self.procs, self.queues, self.jobs, self.last_heard = [None] * n, [None] * n, [None] * n, [0.0] * n
        self.received, self.restarts, self.stop, self.job = 0, 0, None, None
        self.period = cfg.sync_every  # merge and publish every k steps
        for rank in range(n):
            self._spawn(rank)

    def _spawn(self, rank):
        """(Re)start searcher `rank` with fresh queues: a process killed mid-write can leave its queue corrupt."""
        self.queues[rank] = self.ctx.Queue(maxsize=self.cfg.queue_size)
        self.jobs[rank] = self.ctx.Queue(maxsize=1)
        self.procs[rank] = self.ctx.Process(
            target=searcher_process, name=f"searcher-{rank}", daemon=True,
            args=(rank, self.jobs[rank], self.queues[rank], self.stop_event, self.policy_weights, self.ref_weights,
                  os.getpid()))
        self.procs[rank].start()
        self.last_heard[rank] = time.time()

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        """Allocate the shared weights and send every searcher its job."""
        self.cfg, self.seed_offset = cfg, step
        self.policy_weights.allocate(policy, step)
        self.ref_weights.allocate(ref, ref_version)
        self.job = {"cfg": cfg, "task": task, "policy": self.policy_weights.tensors, "ref": self.ref_weights.tensors}
        for rank in range(cfg.num_searchers):
            self._send_job(rank)

    def _send_job(self, rank):
        seed = self.cfg.seed + self.seed_offset + 1000 * (rank + 1) + 100_000 * self.restarts
        self.jobs[rank].put({**self.job, "seed": seed})
        self.last_heard[rank] = time.time()

    def check_alive(self):
        """A dead or silent searcher is restarted (with the current weights) or ends the run, per
        --on-searcher-failure."""
        for rank, p in enumerate(self.procs):
            silent = time.time() - self.last_heard[rank]
            if p.exitcode is None and silent < self.cfg.searcher_timeout:
                continue
            if p.exitcode is None:
                msg = f"{p.name} (pid {p.pid}) sent nothing for {silent:.0f} s (--searcher-timeout {self.cfg.searcher_timeout})"
                p.kill()
            else:
                msg = f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}; its traceback, if any, is above"
            if self.cfg.on_searcher_failure == "abort":
                raise SearcherDied(msg)
            if self.restarts >= self.cfg.max_searcher_restarts:
                raise SearcherDied(f"{msg}; restart limit --max-searcher-restarts {self.cfg.max_searcher_restarts} reached")
            self.restarts += 1
            tqdm.write(f"{msg}; restarting it ({self.restarts}/{self.cfg.max_searcher_restarts})")
            self.queues[rank].cancel_join_thread()
            self._spawn(rank)
            self._send_job(rank)

    def merge(self, buffer, step):
        return merge_round(self, buffer, step)

    def poll(self, rank):
        """The next batch searcher `rank` sent, or None (waits at most 10 ms)."""
        try:
            return self.queues[rank].get(timeout=0.01)
        except queue.Empty:
            return None

    def sample(self, buffer):
        cfg = self.cfg
        return buffer.sample(cfg.num_queries, cfg.responses_per_query, cfg.m, cfg.prioritization, cfg.reward_temp)

    def publish(self, policy, version):
        self.policy_weights.publish(policy, version)

    def publish_ref(self, ref, version):
        self.ref_weights.publish(ref, version)

    def state_dict(self):
        return {"restarts": self.restarts}  # searchers restart fresh on resume (see checkpoint.py)

    def load_state_dict(self, state):
        self.restarts = state["restarts"]

    def close(self):
        """Stop every searcher: ask, wait up to 5 s, then kill. Safe to call twice."""
        self.stop_event.set()
        deadline = time.time() + 5.0
        for p in self.procs:
            p.join(timeout=max(deadline - time.time(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in self.queues + self.jobs:
            q.cancel_join_thread()  # never block the trainer's exit on data nobody will read
            q.close()


def searcher_process(rank, jobs, out_queue, stop_event, policy_weights, ref_weights, parent_pid):
    """A searcher process: import the slow libraries while the trainer starts up, wait for the job, run it.
    Stop signals are the trainer's to handle: a searcher ends when told to or when the trainer is gone."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    try:
        import transformers.modeling_utils  # noqa: F401  (the bulk of the ~5 s import, done while waiting)
        while not stop_event.is_set() and os.getppid() == parent_pid:
            try:
                job = jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            from searcher import searcher_main
            policy_weights.tensors, ref_weights.tensors = job["policy"], job["ref"]
            link = QueueLink(policy_weights, ref_weights, out_queue, stop_event, parent_pid)
            searcher_main(rank, job["cfg"], job["task"], job["seed"], link)
            return
    finally:
        out_queue.cancel_join_thread()  # never block exit on data nobody will read


class QueueLink:
    """A searcher process's connection to the trainer on one machine (what searcher.searcher_main calls
    `link`): the shared weights, its own queue, the stop event. distributed.StoreLink is the same over
    torch.distributed."""

    def __init__(self, policy_weights, ref_weights, out_queue, stop_event, parent_pid):
        self.weights = {"policy": policy_weights, "ref": ref_weights}
        self.out_queue, self.stop_event, self.parent_pid = out_queue, stop_event, parent_pid

    def alive(self):
        """False once the trainer said stop or is gone."""
        return not self.stop_event.is_set() and os.getppid() == self.parent_pid

    def pull(self, kind, model, have_version):
        """Copy the newest "policy" or "ref" weights into `model` if newer than have_version; returns its version."""
        return self.weights[kind].pull(model, have_version)

    def put(self, batch):
        """Send a batch, waiting while the queue is full; False if the run stopped meanwhile."""
        while self.alive():
            try:
                self.out_queue.put(batch, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False


def merge_round(rollout, buffer, step):
    """Drain every searcher into the buffer as one round (the first merge waits for the initial fill).
    Shared by AsyncRollout and distributed.DistRollout, which differ in `poll(rank)` (a batch or None)."""
    cfg = rollout.cfg
    need = cfg.initial_completions if rollout.received == 0 else 0
    items = []
    bar = tqdm(total=need, desc="initial fill", leave=False, disable=None if need else True)
    while True:
        got = 0
        for rank in range(cfg.num_searchers):
            batch = rollout.poll(rank)
            if batch is None:
                continue
            rollout.last_heard[rank] = time.time()
            items.extend(batch)
            got += len(batch)
        bar.update(got)
        if not got:
            if len(items) >= need:
                break
            if rollout.stop is not None and rollout.stop.requested:
                raise StopRequested
            rollout.check_alive()
    bar.close()
    rollout.received += len(items)
    # items from weights older than the previous sync stay out of the most-on-policy round (buffer.py)
    buffer.add(items, round_min_version=max(step - cfg.sync_every, 0))
    return items


# -----------------------------------------------------------------------------
# Synchronous: the on-policy baseline, in the trainer's process

class SyncRollout:
    """On-policy baseline: every step generates fresh responses with the current weights, then trains on them."""

    def __init__(self, cfg):
        self.received, self.restarts = 0, 0
        self.period = 1  # on-policy: fresh data every step, whatever --sync-every says

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        from searcher import HFGenerator, PromptSampler, Searcher
        self.cfg = cfg
        # reference (and, for ratio objectives, behaviour) log-probs are left to the trainer's batched forward
        self.searcher = Searcher(cfg, task, HFGenerator(policy, tokenizer, cfg.max_new_tokens), tokenizer,
                                 task.make_scorer(cfg.device), cfg.seed)
        self.prompts = PromptSampler(len(task.prompts), 0, 1, cfg.num_queries, cfg.seed)

    def merge(self, buffer, step):
        items = self.searcher.search(next(self.prompts), step, ref_version=-1)
        self.received += len(items)
        buffer.add(items)
        return items

    def sample(self, buffer):
        return buffer.latest_groups(self.cfg.responses_per_query)

    def check_alive(self):
        pass

    def publish(self, policy, version):
        pass  # the in-process searcher generates with the trainer's own policy

    def publish_ref(self, ref, version):
        pass  # ... and the trainer scores the reference itself

    def state_dict(self):
        from searcher import json_rng_state
        return {"prompts": self.prompts.state_dict(), "searcher_rng": json_rng_state(self.searcher.rng.getstate()),
                "received": self.received}

    def load_state_dict(self, state):
        from searcher import tuple_rng_state
        self.prompts.load_state_dict(state["prompts"])
        self.searcher.rng.setstate(tuple_rng_state(state["searcher_rng"]))
        self.received = state["received"]

    def close(self):
        pass


def make_rollout(cfg):
    """The rollout for this config; an AsyncRollout starts its searcher processes right away. Under torchrun
    this process is rank 0 and its searchers are the other ranks (distributed.py)."""
    if cfg.sync:
        return SyncRollout(cfg)
    if torchrun_rank() is not None:
        from distributed import DistRollout
        return DistRollout(cfg)
    return AsyncRollout(cfg)
