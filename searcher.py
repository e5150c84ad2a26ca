"""
The SEARCHERS of TBA: processes that hold a stale copy of the policy, generate and score responses, and send
trajectories to the trainer; and the trainer's end of them. A task script starts them, then builds its task:

    with spawn_searchers(cfg) as searchers:      # processes (torch.multiprocessing, spawn), stopped at the end
        tba.train(cfg, make_task(cfg), searchers)

The trainer talks to one `Searchers` object: start, poll (what arrived: tba.merge makes a round of it), publish,
pause, check_alive. Weights travel through ops/weights.SharedWeights (a copy of the state dict on each searcher
device, shared through torch.multiprocessing, and a version counter), batches on one queue per searcher. The
same interface serves --sync (`SyncSearch`, in the trainer's process) and torchrun (ops/distributed.py); the
searcher loop (`searcher_main`: weights in, prompts, generate, score, batch out) reaches the trainer through a
`link`, which serves both kinds of machine.

Departures from the official code:
  1. Searchers never block on a barrier at sync time; the trainer merges whatever has arrived, and waits
     only when nothing new enough has (tba.merge).
  2. A searcher that raises exits non-zero with its traceback on stderr; the trainer notices within one
     step and stops the run (the official MPI code hangs), or restarts it (--on-searcher-failure restart).
  3. Searchers shuffle their shard of the prompts every pass; the official searchers walk it in dataset order.
  4. Every searcher process is seeded (seed + 1000 (rank + 1), offset on a restart); the official ones are not.

Run it through a run_*.py script; this module has no entry point of its own.
"""

import importlib
import math
import os
import queue
import random
import time

from tqdm import tqdm

from buffer import Trajectory
from config import SearcherDied, signals_ignored
from ops.devices import torchrun_rank
from ops.weights import SharedWeights, shared_device


# -----------------------------------------------------------------------------
# The trainer's end: processes, shared weights, queues

def spawn_searchers(cfg):
    """The searchers of this run, started now (their slow imports then overlap the trainer's): processes on this
    machine (`Searchers`), with --sync the trainer's own process (`SyncSearch`), or under torchrun the job's
    other ranks (ops/distributed.py). Use it as a context manager: its end stops them, on every path."""
    if cfg.sync:
        return SyncSearch(cfg)
    if torchrun_rank() is not None:
        from ops.distributed import DistSearchers
        return DistSearchers(cfg)
    return Searchers(cfg)


class Searchers:
    """The searcher processes, one queue each, and the shared weights. A context manager: leaving it stops them."""

    def __init__(self, cfg):
        import multiprocessing.resource_tracker as tracker
        import torch.multiprocessing as mp
        with signals_ignored():  # (the tracker of the processes' semaphores outlives a closed terminal, and stays quiet)
            tracker.ensure_running()
        self.cfg, self.ctx = cfg, mp.get_context("spawn")  # CUDA-safe; each child imports what it needs
        self.stop_event, self.pause_event = self.ctx.Event(), self.ctx.Event()  # end the run; hold it (evaluation)
        self.weights = {"policy": SharedWeights(self.ctx), "ref": SharedWeights(self.ctx)}  # (ops/weights.py)
        n = cfg.num_searchers
        self.procs, self.queues, self.jobs, self.last_heard = [None] * n, [None] * n, [None] * n, [0.0] * n
        self.restarts, self.job, self.publish_s, self.stats, self.reports = 0, None, 0.0, [{}] * n, []  # (stats: the last
        # report of each searcher, reports: every report since the last merge)
        for rank in range(n):
            self._spawn(rank)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        self.close()

    def _spawn(self, rank):
        """(Re)start searcher `rank` with fresh queues: a process killed mid-write can leave its queue corrupt."""
        self.queues[rank] = self.ctx.Queue(maxsize=self.cfg.queue_size)
        self.jobs[rank] = self.ctx.Queue(maxsize=1)
        self.procs[rank] = self.ctx.Process(
            target=searcher_process, name=f"searcher-{rank}", daemon=True,
            args=(rank, self.jobs[rank], self.queues[rank], self.stop_event, self.pause_event, self.weights, os.getpid()))
        with signals_ignored():  # (a searcher starts with stop signals ignored: they are the trainer's to handle)
            self.procs[rank].start()
        self.last_heard[rank] = time.time()

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        """Allocate the shared weights (a copy per searcher device, in their dtype) and send every searcher its job."""
        from models import dtype_of
        from ops.memory import check_shared_memory
        self.cfg, self.seed_offset, self.job = cfg, step, {"cfg": cfg, "task": task}
        self.devices = [shared_device(cfg, d) for d in cfg.searcher_devices]
        check_shared_memory(cfg, params=sum(t.numel() for t in policy.state_dict().values()))  # (now that it is known)
        self.weights["policy"].allocate(policy, step, self.devices, dtype_of(cfg.searcher_dtype))
        if "ref_logp" in cfg.needs:  # (the searchers score the reference only for objectives that read it)
            self.weights["ref"].allocate(ref, ref_version, self.devices, dtype_of(cfg.searcher_dtype))
        for rank in range(cfg.num_searchers):
            self._send_job(rank)

    def _send_job(self, rank):
        seed = self.cfg.seed + self.seed_offset + 1000 * (rank + 1) + 100_000 * self.restarts
        weights = {kind: shared.tensors.get(self.devices[rank]) for kind, shared in self.weights.items()}
        self.jobs[rank].put({**self.job, "seed": seed, "weights": weights})
        self.last_heard[rank] = time.time()

    def poll(self):
        """Every trajectory the searchers sent since the last poll, in order per searcher (waits 10 ms if none came)."""
        items = []
        for rank, q in enumerate(self.queues):
            while True:
                try:
                    batch = q.get_nowait()
                except queue.Empty:
                    break
                items += batch
                self.last_heard[rank], self.stats[rank] = time.time(), batch.stats
                self.reports.append(batch.stats)
        if not items:
            time.sleep(0.01)
        return items

    def publish(self, policy, version):
        t0 = time.time()
        self.weights["policy"].publish(policy, version)
        self.publish_s = time.time() - t0

    def pause(self, paused):
        """Hold the searchers after their current batch (an evaluation: the run's clocks stop), or let them go on."""
        (self.pause_event.set if paused else self.pause_event.clear)()
        self.last_heard = [time.time()] * len(self.procs)  # (a held searcher is not a silent one)

    def publish_ref(self, ref, version):
        self.weights["ref"].publish(ref, version)  # (no copy when the objective reads no reference: start)

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

    def state_dict(self):
        return {"restarts": self.restarts}  # searchers restart fresh on resume (see ops/checkpoint.py)

    def load_state_dict(self, state):
        self.restarts = state["restarts"]

    def close(self):
        """Stop every searcher: ask, wait up to 5 s, then kill; a signal meanwhile does not interrupt it. Safe twice."""
        with signals_ignored():
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


# -----------------------------------------------------------------------------
# A searcher process

def searcher_process(rank, jobs, out_queue, stop_event, pause_event, weights, parent_pid):
    """A searcher process: import the slow libraries while the trainer starts up, wait for the job, run it. It starts
    with stop signals ignored (they are the trainer's): it ends when told to or when the trainer is gone."""
    try:
        importlib.import_module("transformers.models.auto.modeling_auto")  # (the slow import, done while waiting)
        while not stop_event.is_set() and os.getppid() == parent_pid:
            try:
                job = jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            shared = {kind: (weights[kind], job["weights"][kind]) for kind in weights}  # (counter, this device's copy)
            link = QueueLink(shared, out_queue, stop_event, pause_event, parent_pid)
            searcher_main(rank, job["cfg"], job["task"], job["seed"], link)
            return
    finally:
        out_queue.cancel_join_thread()  # never block exit on data nobody will read


def searcher_main(rank, cfg, task, seed, link):
    """The work of a searcher, whatever started it, through its `link` to the trainer (QueueLink, StoreLink): alive()
    is False once the trainer said stop or is gone (and waits while it holds the run); pull(kind, model, version)
    copies newer "policy" or "ref" weights in; put(batch) sends, waiting while the queue is full."""
    import torch
    from models import HFGenerator, dtype_of, load_model
    from ops.devices import claim_gpu
    from ops.memory import peak_memory
    torch.set_num_threads(cfg.searcher_threads)
    torch.manual_seed(seed)
    device = claim_gpu(cfg, cfg.searcher_devices[rank])  # (vLLM takes the first visible GPU: mask the others)
    policy, tokenizer = load_model(cfg.model, device, dtype_of(cfg.searcher_dtype), cfg.trust_remote_code)
    needs = cfg.needs
    ref = (load_model(cfg.ref_model or cfg.model, device, dtype_of(cfg.searcher_dtype), cfg.trust_remote_code)[0]
           if "ref_logp" in needs else None)
    if cfg.backend == "vllm":  # (vLLM is optional: imported only when chosen)
        from ops.vllm_backend import VLLMGenerator
        generator = VLLMGenerator(cfg, policy, tokenizer, seed, device)
    else:
        generator = HFGenerator(policy, tokenizer, cfg.max_new_tokens)
    searcher = Searcher(cfg, task, generator, tokenizer, task.make_scorer(device), seed,
                        policy=policy if {"behavior_logp", "behavior_token_logp"} & set(needs) else None, ref=ref)
    version = ref_version = -1
    for batch_ids in PromptSampler(len(task.prompts), rank, cfg.num_searchers, cfg.prompts_per_search, seed):
        if not link.alive():
            break
        t0 = time.time()
        new_version = link.pull("policy", policy, version)  # newer weights, if the trainer published them
        if new_version != version and generator.model is not policy:
            generator.load_state_dict(policy.state_dict())  # the backend's own copy (vLLM's engine)
        pull_s, version = (time.time() - t0 if new_version != version else 0.0), new_version
        if ref is not None:
            ref_version = link.pull("ref", ref, ref_version)
        batch = Batch(searcher.search(batch_ids, version, ref_version), pull_s=pull_s, peak_bytes=peak_memory(device),
                      reward_metrics=searcher.log["metrics"], unscored=searcher.unscored)  # generate S each, score
        if not link.put(batch):  # send (waits while the queue is full)
            break


class Batch(list):
    """A batch of Trajectories and the searcher's report (`stats`: pull seconds, peak memory, the reward's logs)."""

    def __init__(self, items, **stats):
        super().__init__(items)
        self.stats = stats


class Searcher:
    """Turns prompt ids into scored, annotated Trajectories. Used by searcher processes and by --sync mode."""

    def __init__(self, cfg, task, generator, tokenizer, scorer, seed, policy=None, ref=None):
        """`policy` / `ref`: models to score behaviour / reference log-probs with (None: leave them to the trainer)."""
        self.cfg, self.task, self.generator, self.tokenizer, self.scorer = cfg, task, generator, tokenizer, scorer
        self.policy, self.ref = policy, ref
        self.prompt_tokens = {}  # prompt id -> token ids, filled as prompts are first used
        self.rng = random.Random(seed)

    def temperature(self):
        lo, hi = self.cfg.temperature, self.cfg.temperature_max
        return lo if hi is None else self.rng.uniform(lo, hi)

    def search(self, batch_ids, policy_version, ref_version):
        """S responses to each prompt, generated by the weights of `policy_version`, scored: a list of Trajectory
        (prompt-major). Reference log-probs are tagged with `ref_version`, the reference they came from."""
        from models import completions, encode_prompts, score_logprobs
        cfg, S = self.cfg, self.cfg.samples_per_prompt
        for q, ids in zip(batch_ids, encode_prompts(self.tokenizer, [self.task.prompts[q] for q in batch_ids])):
            self.prompt_tokens[q] = ids
        responses, behavior = self.generator.sample([self.prompt_tokens[q] for q in batch_ids], S, self.temperature(),
                                                    cfg.score_temperature)  # behaviour log-probs: no extra forward
        ids = [q for q in batch_ids for _ in range(S)]
        done = completions(self.tokenizer, responses, self.generator.stop_ids)
        self.log = {"metrics": {}, "extra": {}}  # (what the scorer logs: the batch's report carries its metrics)
        rewards = self.scorer([self.task.prompts[q] for q in ids], [c.text for c in done], [self.task.metas[q] for q in ids],
                              completion_ids=[list(c.token_ids) for c in done], step=policy_version, log=self.log)
        self.unscored = sum(math.isnan(r) for r in rewards)  # (a NaN reward: nothing scored it; the batch drops it)
        if cfg.no_eos_reward is not None:  # a response cut at max_new_tokens gets the fixed penalty reward
            rewards = [r if c.finished else cfg.no_eos_reward for r, c in zip(rewards, done)]
        prompts, pad = [self.prompt_tokens[q] for q in ids], self.tokenizer.pad_token_id
        temperature = cfg.score_temperature  # (the loss's, not the sampling temperature of this batch)
        if behavior is None:  # (vLLM at a loss temperature other than the sampling one) a forward, if needed
            behavior = [()] * len(ids) if self.policy is None else score_logprobs(
                self.policy, prompts, responses, pad, temperature, cfg.micro_batch, per_token=True)
        ref_logp = (score_logprobs(self.ref, prompts, responses, pad, temperature, cfg.micro_batch, share_prompt=cfg.share_prompt)
                    if self.ref is not None else [math.nan] * len(ids))
        ref_version = ref_version if self.ref is not None else -1
        return [Trajectory(prompt_id=q, response_ids=tuple(r), reward=float(rw), policy_version=policy_version,
                           behavior_logp=math.fsum(b) if b else math.nan, ref_logp=float(lr), ref_version=ref_version,
                           behavior_token_logp=b if "behavior_token_logp" in cfg.needs else ())  # (memory: GRPO only)
                for q, r, rw, b, lr in zip(ids, responses, rewards, behavior, ref_logp) if not math.isnan(rw)]


class PromptSampler:
    """Endless batches of prompt ids from one searcher's shard (every prompt if fewer than searchers), reshuffled every pass."""

    def __init__(self, num_prompts, rank, world, batch_size, seed):
        self.shard = list(range(rank, num_prompts, world)) or list(range(num_prompts))
        self.batch_size = batch_size
        self.rng, self.order, self.pos = random.Random(seed), [], 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.order):
            self.order, self.pos = self.rng.sample(self.shard, len(self.shard)), 0
        batch = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": self.order, "pos": self.pos}  # (JSON: tuples become lists)

    def load_state_dict(self, state):
        set_rng_state(self.rng, state["rng"])
        self.order, self.pos = state["order"], state["pos"]


def set_rng_state(rng, state):
    """random.Random.setstate from getstate()'s (version, internal state, gauss) as JSON read it back (lists)."""
    rng.setstate((state[0], tuple(state[1]), state[2]))


class QueueLink:
    """A searcher process's connection to the trainer on one machine (searcher_main's `link`): weights, queue, events."""

    def __init__(self, weights, out_queue, stop_event, pause_event, parent_pid):
        self.weights = weights  # kind -> (SharedWeights, this searcher's copy of the tensors)
        self.out_queue, self.stop_event, self.pause_event, self.parent_pid = out_queue, stop_event, pause_event, parent_pid

    def alive(self):
        """False once the trainer said stop or is gone; waits while the trainer holds the run (an evaluation)."""
        while self.pause_event.is_set() and not self.stop_event.is_set() and os.getppid() == self.parent_pid:
            time.sleep(0.01)
        return not self.stop_event.is_set() and os.getppid() == self.parent_pid

    def pull(self, kind, model, have_version):
        """Copy the newest "policy" or "ref" weights into `model` if newer than have_version; returns its version."""
        shared, tensors = self.weights[kind]
        return shared.pull(model, tensors, have_version)

    def put(self, batch):
        """Send a batch, waiting while the queue is full; False if the run stopped meanwhile."""
        while self.alive():
            try:
                self.out_queue.put(batch, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False


# -----------------------------------------------------------------------------
# --sync: the searcher in the trainer's process

class SyncSearch:
    """The searchers' interface for the on-policy baseline (--sync, baselines.py): each merge's poll generates a
    fresh batch of Q prompts x S responses with the trainer's own policy, which becomes the buffer's latest round;
    --sync sets k = 1 and m = 1 (config.parse_config), so every step trains on exactly that batch. Nothing runs
    beside the trainer: there is nothing to hold, check or stop, and the trainer scores the reference itself."""
    restarts, publish_s, stats = 0, 0.0, []

    def __init__(self, cfg):
        self.cfg, self.reports = cfg, []

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        from models import HFGenerator
        self.version = step  # (reference and behaviour log-probs: left to the trainer, which has the models)
        self.searcher = Searcher(cfg, task, HFGenerator(policy, tokenizer, cfg.max_new_tokens), tokenizer,
                                 task.make_scorer(cfg.device), cfg.seed)
        self.prompts = PromptSampler(len(task.prompts), 0, 1, cfg.prompts_per_step, cfg.seed)

    def poll(self):
        """A fresh batch: Q prompts x S responses from the current policy."""
        from models import autocast
        with autocast(self.cfg, self.cfg.device):  # (--trainer-dtype bf16-mixed)
            batch = self.searcher.search(next(self.prompts), self.version, ref_version=-1)
        self.reports.append({"reward_metrics": self.searcher.log["metrics"], "unscored": self.searcher.unscored})
        return batch

    def publish(self, policy, version):
        self.version = version  # (the searcher generates with the trainer's own policy)

    def state_dict(self):
        return {"prompts": self.prompts.state_dict(), "searcher_rng": self.searcher.rng.getstate()}

    def load_state_dict(self, state):
        self.prompts.load_state_dict(state["prompts"])
        set_rng_state(self.searcher.rng, state["searcher_rng"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    publish_ref = pause = check_alive = lambda self, *args: None  # (nothing to send, hold or check)
