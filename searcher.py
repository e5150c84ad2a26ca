"""
The SEARCHERS of TBA: processes that hold a stale copy of the policy, generate and score responses, and send
trajectories to the trainer; and the trainer's handle on them. A task script starts them, then builds its task:

    with spawn_searchers(cfg) as searchers:      # processes (torch.multiprocessing, spawn), stopped at the end
        tba.train(cfg, make_task(cfg), searchers)

A searcher process (`searcher_process`, then `searcher_loop`) repeats, never waiting for the trainer:
    weights in   copy the newest published weights if their version changed (and the reference's, TBA')
    prompts      its next prompts: its shard of the training set, reshuffled every pass
    generate     S responses per prompt with its stale copy (`HFGenerator`; vLLM: ops/vllm_backend.py)
    score        the task's reward, and log pi_ref of each response
    send         a Batch of Trajectories (prompt, response, reward, policy version) on its own queue
The trainer holds a `SearcherHandle` (the interface below): start, poll (what arrived: tba.merge makes a round
of it), publish (policy or reference), close. `Searchers`, the one a reader reads, runs processes on this machine, a queue
each, weights shared through ops/weights.SharedWeights. Off the reader's path: torchrun (ops/distributed.py, the
same `searcher_loop` over the network), vLLM (ops/vllm_backend.py), --sync (`SyncSearch`), restarts.

Departures from the official code:
  1. Searchers never block on a barrier at sync time; the trainer merges whatever has arrived, and waits
     only when nothing new enough has (tba.merge).
  2. A searcher that raises exits non-zero with its traceback on stderr; the trainer notices within one
     step and stops the run (the official MPI code hangs), or restarts it (--on-searcher-failure restart).
  3. Searchers shuffle their shard of the prompts every pass; the official searchers walk it in dataset order.
  4. Every searcher process is seeded (seed + 1000 (rank + 1), offset on a restart); the official ones are not.

Run it through a run_*.py script; this module has no entry point of its own.
"""

import contextlib
import importlib
import math
import os
import queue
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.multiprocessing as mp  # (multiprocessing, with tensors shared rather than pickled)
from tqdm import tqdm

from buffer import Trajectory
from config import SearcherDied
from ops.backends import load_searcher
from ops.devices import torchrun_rank
from ops.distributed import DistSearchers
from ops.memory import peak_memory
from ops.models import PromptTokens, TokenLogprobs, autocast, completions, cut_at_eos, score_logprobs, stop_ids
from ops.processes import drain, get_until_stopped, start_process, start_resource_tracker, stop_processes
from ops.weights import SharedWeights, allocate_shared


class SearcherHandle(Protocol):
    """What the trainer (tba.py) knows of its searchers, whatever runs them: `Searchers` (processes on this
    machine), `SyncSearch` (--sync: the trainer's own process), ops/distributed.DistSearchers (torchrun)."""
    restarts: int  # searchers restarted so far (a metric)

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        """Give the searchers their job (config, task, seed) and the weights of `step` to start from."""

    def poll(self):
        """(trajectories, reports): every Trajectory sent since the last poll, and each batch's report (dict). Returns at
        once, empty if nothing came (a merge that waits sleeps between polls: ops/bookkeeping.wait_for_searchers)."""

    def publish(self, kind, model, version):
        """The searchers' "policy" (a sync) or "ref" (TBA's reference reset) becomes these weights, of trainer step
        `version`; returns the seconds it took (what a searcher's link.pull(kind, ...) then copies in)."""

    def close(self):
        """Stop every searcher (also what leaving the `with` block does)."""

    # and for operations (ops/bookkeeping.py): pause(paused) during an evaluation, check_alive() (a dead or silent
    # searcher), state_dict() and load_state_dict(state) for checkpoints (a resumed run loads it before start)


def spawn_searchers(cfg):
    """The searchers of this run, started now (their slow imports then overlap the trainer's): processes on this
    machine (`Searchers`), or a variant with the same interface (--sync: `SyncSearch`; torchrun:
    ops/distributed.py). Use it as a context manager: its end stops them, on every path."""
    if cfg.sync:  # the on-policy baseline: the trainer generates each batch itself (`SyncSearch`, below)
        return contextlib.closing(SyncSearch(cfg))
    if torchrun_rank() is not None:  # under torchrun: the job's other ranks (ops/distributed.py)
        return DistSearchers(cfg)
    return contextlib.closing(Searchers(cfg))  # (leaving the `with` block calls its close)


# -----------------------------------------------------------------------------
# The trainer's handle: processes, shared weights, queues

class Searchers:
    """The searcher processes of this machine, one queue each, and the weights they share."""

    def __init__(self, cfg):
        start_resource_tracker()  # (first, with stop signals ignored: ops/processes.py)
        self.cfg, self.ctx = cfg, mp.get_context("spawn")  # CUDA-safe; each child imports what it needs
        self.stop_event, self.pause_event = self.ctx.Event(), self.ctx.Event()  # end the run; hold it (evaluation)
        self.weights = {kind: SharedWeights(self.ctx, cfg.searcher_timeout) for kind in ("policy", "ref")}  # (ops/weights.py)
        n = cfg.num_searchers
        self.procs, self.queues, self.jobs, self.last_heard, self.restarts = [None] * n, [None] * n, [None] * n, {}, 0
        for rank in range(n):
            self.spawn(rank)

    def spawn(self, rank):
        """Start searcher `rank` with fresh queues (a restart too: a process killed mid-write can leave its queue corrupt)."""
        self.queues[rank] = self.ctx.Queue(maxsize=self.cfg.queue_size)  # its batches, to the trainer
        self.jobs[rank] = self.ctx.Queue(maxsize=1)  # its job, from the trainer
        self.procs[rank] = self.ctx.Process(
            target=searcher_process, name=f"searcher-{rank}", daemon=True,
            args=(rank, self.jobs[rank], self.queues[rank], self.stop_event, self.pause_event, self.weights, os.getpid()))
        start_process(self.procs[rank])  # (with stop signals ignored: they are the trainer's to handle)

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        """Allocate the shared weights (a copy per searcher device, in their dtype) and send every searcher its job."""
        self.cfg, self.job = cfg, {"cfg": cfg, "task": task, "step": step}
        self.last_heard = dict.fromkeys(range(cfg.num_searchers), time.time())  # (silent too long: failed, check_alive)
        self.devices = allocate_shared(cfg, self.weights, policy, ref, step, ref_version)  # (ops/weights.py)
        for rank in range(cfg.num_searchers):
            self.send_job(rank)

    def send_job(self, rank):
        seed = self.cfg.seed + self.job["step"] + 1000 * (rank + 1) + 100_000 * self.restarts
        weights = {kind: shared.tensors.get(self.devices[rank]) for kind, shared in self.weights.items()}
        self.jobs[rank].put({**self.job, "seed": seed, "weights": weights})

    def poll(self):
        """(trajectories, reports): every Trajectory the searchers sent since the last poll, in order per searcher,
        and each batch's report."""
        batches = [(rank, batch) for rank, out in enumerate(self.queues) for batch in drain(out)]  # (ops/processes.py)
        self.last_heard.update((rank, time.time()) for rank, _ in batches)  # (silent for --searcher-timeout: failed)
        return [t for _, b in batches for t in b.trajectories], [{**b.report, "rank": rank} for rank, b in batches]

    def publish(self, kind, model, version):
        return self.weights[kind].publish(model, version)  # (a reference nobody reads has no copy to fill: start)

    def close(self):
        """Stop every searcher: ask, wait up to 5 s, then kill (ops/processes.py). Safe twice."""
        stop_processes(self.stop_event, self.procs, self.queues + self.jobs)

    # -- operations (ops/bookkeeping.py calls these)

    def pause(self, paused):
        """Hold the searchers after their current batch (an evaluation: the run's clocks stop), or let them go on."""
        (self.pause_event.set if paused else self.pause_event.clear)()
        self.last_heard = dict.fromkeys(range(len(self.procs)), time.time())  # (a held searcher is not a silent one)

    def check_alive(self):
        """A dead or silent searcher is restarted (with the current weights) or ends the run, per
        --on-searcher-failure."""
        for rank, p in enumerate(self.procs):
            silent = time.time() - self.last_heard[rank]
            if p.exitcode is not None or silent >= self.cfg.searcher_timeout:
                self.restart(rank, silent)

    def restart(self, rank, silent):
        """Searcher `rank` died, or was silent for `silent` seconds (then it is killed): a new process, with fresh
        queues and its job again, or SearcherDied (--on-searcher-failure abort, or no restart left)."""
        p = self.procs[rank]
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
        for q in (self.queues[rank], self.jobs[rank]):  # (a job the dead searcher never read, still in the pipe, ...)
            q.cancel_join_thread()  # ... must not hold the trainer's exit: multiprocessing joins a queue's sender thread
        self.spawn(rank)
        self.send_job(rank)
        self.last_heard[rank] = time.time()

    def state_dict(self):
        return {"restarts": self.restarts}  # searchers restart fresh on resume (see ops/checkpoint.py)

    def load_state_dict(self, state):
        self.restarts = state["restarts"]


# -----------------------------------------------------------------------------
# A searcher process

def searcher_process(rank, jobs, out_queue, stop_event, pause_event, weights, parent_pid):
    """A searcher process: wait for its job, then run the searcher loop until the trainer says stop or is gone. It
    starts with stop signals ignored (they are the trainer's)."""
    try:
        importlib.import_module("transformers.models.auto.modeling_auto")  # (the slow import, done while waiting)
        job = get_until_stopped(jobs, stop_event, parent_pid)  # (sent once the trainer has its models: tba.setup)
        if job is not None:  # (None: the run stopped first)
            link = QueueLink(weights, job["weights"], out_queue, stop_event, pause_event, parent_pid)
            searcher_loop(rank, job["cfg"], job["task"], job["seed"], link)
    finally:
        out_queue.cancel_join_thread()  # never block exit on data nobody will read


def searcher_loop(rank, cfg, task, seed, link):
    """The work of a searcher, whatever started it (`searcher_process`; a torchrun rank: ops/distributed.py), through
    its `link` to the trainer: alive() is False once the trainer said stop (and waits while it holds the run);
    pull(kind, model, version) copies newer "policy" or "ref" weights into `model`; put(batch) sends it."""
    ref, tokenizer, generator, device = load_searcher(cfg, rank, seed, HFGenerator)  # (seeded; vLLM's: --backend vllm)
    searcher = Searcher(cfg, task, generator, tokenizer, task.make_scorer(device), seed, ref=ref)
    prompt_batches = PromptSampler(len(task.prompts), rank, cfg.num_searchers, cfg.prompts_per_search, seed)
    version = ref_version = -1
    while link.alive():
        t0 = time.time()
        new_version = link.pull("policy", generator, version)  # weights in, if the trainer published newer ones
        pull_s, version = (time.time() - t0 if new_version != version else 0.0), new_version
        if ref is not None:
            ref_version = link.pull("ref", ref, ref_version)
        batch = searcher.search(next(prompt_batches), version, ref_version)  # generate S each, score
        batch.report.update(pull_s=pull_s, peak_bytes=peak_memory(device))
        link.put(batch)  # send (waits while the queue is full)


@dataclass
class Batch:
    """What a searcher sends to the trainer."""
    trajectories: list  # [Trajectory]
    report: dict = field(default_factory=dict)  # the reward's logs, what it left unscored, pull seconds, peak memory


class Searcher:
    """Turns prompt ids into scored, annotated Trajectories. Used by searcher processes and by --sync."""

    def __init__(self, cfg, task, generator, tokenizer, score, seed, ref=None):
        """`ref`: the reference to score log pi_ref with (None: leave it to the trainer)."""
        self.cfg, self.task, self.generator, self.tokenizer, self.score, self.ref = cfg, task, generator, tokenizer, score, ref
        self.prompt_tokens = PromptTokens(tokenizer, task.prompts)  # prompt id -> token ids, encoded on first use
        self.rng = random.Random(seed)

    def search(self, prompt_ids, policy_version, ref_version):
        """S responses to each prompt, generated by the weights of `policy_version`, scored: a Batch of Trajectory
        (prompt-major). Reference log-probs are tagged with `ref_version`, the reference they came from."""
        cfg, task, S = self.cfg, self.task, self.cfg.samples_per_prompt
        lo, hi = cfg.temperature, cfg.temperature_max  # (--temperature-max: a temperature per batch in [lo, hi])
        ids, log = [x for x in prompt_ids for _ in range(S)], {"metrics": {}, "extra": {}}  # (log: what the reward logs)
        prompts = [self.prompt_tokens[x] for x in ids]  # (x: a prompt id; its token ids, once per response)
        responses, behavior = self.generator.sample(prompts[::S], S, lo if hi is None else self.rng.uniform(lo, hi),
                                                    cfg.score_temperature)  # behaviour log-probs per token, as sampled
        done = completions(self.tokenizer, responses, self.generator.stop_ids)  # texts, ids, whether each ended
        rewards = self.score([task.prompts[x] for x in ids], [c.text for c in done], [task.metas[x] for x in ids],
                             completion_ids=[list(c.token_ids) for c in done], step=policy_version, log=log)
        if cfg.no_eos_reward is not None:  # a response cut at max_new_tokens gets the fixed penalty reward
            rewards = [r if c.finished else cfg.no_eos_reward for r, c in zip(rewards, done)]
        unscored = sum(math.isnan(r) for r in rewards)  # (a NaN reward: nothing scored it; it is not sent)
        ref_logp = [math.nan] * len(ids) if self.ref is None else score_logprobs(self.ref, prompts, responses,
            self.tokenizer.pad_token_id, cfg.score_temperature, cfg.micro_batch, share_prompt=cfg.share_prompt)
        trajectories = [Trajectory(prompt_id=x, response_ids=tuple(r), reward=float(rw), policy_version=policy_version,
                                   behavior_logp=math.fsum(b) if b else math.nan, ref_logp=float(lr),
                                   ref_version=ref_version if self.ref is not None else -1,
                                   behavior_token_logp=b if "behavior_token_logp" in cfg.needs else ())  # (GRPO only)
                        for x, r, rw, b, lr in zip(ids, responses, rewards, behavior or [()] * len(ids), ref_logp)
                        if not math.isnan(rw)]  # (behavior None: a backend without behaviour log-probs)
        return Batch(trajectories, {"reward_metrics": log["metrics"], "unscored": unscored, "sent": len(trajectories)})


class HFGenerator:
    """The searchers' generation backend by default: transformers `generate` (KV cache) on a model this process
    owns. ops/vllm_backend.VLLMGenerator has the same interface (sample, generate, load_state_dict, stop_ids)."""

    def __init__(self, model, tokenizer, max_new_tokens):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = stop_ids(model, tokenizer)  # every id that ends a response (a chat model has several)
        self.limits = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=list(self.stop_ids))  # (generate's length and stop arguments)

    def load_state_dict(self, tensors):
        self.model.load_state_dict(tensors)

    @torch.no_grad()
    def sample(self, prompt_tokens, n, temperature, score_temperature=None, greedy=False):
        """n responses per prompt (prompt-major order), each a list of ids ending in a stop id unless cut at
        max_new_tokens, sampled with full support (top_k=0, top_p=1, as TB requires of an off-policy sampler); and
        each response token's log-prob at `score_temperature` as generation computed it (no second forward: the
        behaviour log-probs; None without a score_temperature)."""
        rows = {"input_ids": [p for p in prompt_tokens for _ in range(n)]}
        inputs = self.tokenizer.pad(rows, padding_side="left", return_tensors="pt").to(self.model.device)  # (N, P)
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        recorder = TokenLogprobs(score_temperature) if score_temperature is not None else None  # (each step's log-probs)
        out = self.model.generate(**inputs, **self.limits, logits_processor=[recorder] if recorder else None, **sampling)
        new = out[:, inputs["input_ids"].shape[1]:]  # (N, T) generated ids, padded after a stop id
        responses = [cut_at_eos(row, self.stop_ids) for row in new.tolist()]
        behavior = None if recorder is None else [tuple(row[:len(r)]) for row, r in zip(recorder.finish(new), responses)]
        return responses, behavior

    def generate(self, prompt_tokens, n, temperature, greedy=False):
        """`sample`'s responses alone (an evaluation's greedy completions)."""
        return self.sample(prompt_tokens, n, temperature, greedy=greedy)[0]

    def state_dict(self):
        return self.model.state_dict()


class PromptSampler:
    """Endless batches of prompt ids from one searcher's shard (every prompt if fewer than searchers), reshuffled every pass."""

    def __init__(self, num_prompts, rank, world, batch_size, seed):
        self.shard = list(range(rank, num_prompts, world)) or list(range(num_prompts))
        self.batch_size, self.rng, self.order, self.pos = batch_size, random.Random(seed), [], 0

    def __next__(self):
        if self.pos >= len(self.order):
            self.order, self.pos = self.rng.sample(self.shard, len(self.shard)), 0
        batch = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": self.order, "pos": self.pos}  # (JSON: tuples become lists)

    def load_state_dict(self, state):
        self.rng.setstate(rng_state(state["rng"]))
        self.order, self.pos = state["order"], state["pos"]


def rng_state(saved):
    """A `random.Random` state as a checkpoint saved it, made a state again (JSON made its tuples lists)."""
    return saved[0], tuple(saved[1]), saved[2]


@dataclass
class QueueLink:
    """A searcher process's connection to the trainer on one machine (searcher_loop's `link`): weights, queue, events."""
    weights: dict  # kind ("policy", "ref") -> ops/weights.SharedWeights
    tensors: dict  # kind -> this searcher's copy of its weights (on its device)
    out_queue: object  # this searcher's queue to the trainer
    stop_event: object  # set: the run ends
    pause_event: object  # set: the trainer holds the run (an evaluation)
    parent_pid: int  # the trainer's process

    def alive(self):
        """False once the trainer said stop or is gone; waits while the trainer holds the run (an evaluation)."""
        while self.pause_event.is_set() and not self.stop_event.is_set() and os.getppid() == self.parent_pid:
            time.sleep(0.01)
        return not self.stop_event.is_set() and os.getppid() == self.parent_pid

    def pull(self, kind, model, have_version):
        """Copy the newest "policy" or "ref" weights into `model` if newer than have_version; returns its version."""
        return self.weights[kind].pull(model, self.tensors[kind], have_version)

    def put(self, batch):
        """Send a batch, waiting while the queue is full; False if the run stopped meanwhile."""
        while self.alive():
            with contextlib.suppress(queue.Full):  # (full: try again, unless the run stopped meanwhile)
                self.out_queue.put(batch, timeout=1.0)
                return True
        return False


# -----------------------------------------------------------------------------
# A variant, off the reader's path: --sync, the searcher in the trainer's process

class SyncSearch:
    """The searchers' interface for the on-policy baseline (--sync, baselines.py): each merge's poll generates a
    fresh batch of Q prompts x S responses with the trainer's own policy, which becomes the buffer's latest round;
    --sync sets k = 1 and m = 1 (config.parse_config), so every step trains on exactly that batch. Nothing runs
    beside the trainer: there is nothing to hold, check or stop, and the trainer scores the reference itself."""
    restarts = 0

    def __init__(self, cfg):
        self.cfg, self.resumed = cfg, None  # (resumed: a checkpoint's state, applied at start)

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        self.version = step  # (reference and behaviour log-probs: left to the trainer, which has the models)
        self.searcher = Searcher(cfg, task, HFGenerator(policy, tokenizer, cfg.max_new_tokens), tokenizer,
                                 task.make_scorer(cfg.device), cfg.seed)
        self.prompts = PromptSampler(len(task.prompts), 0, 1, cfg.prompts_per_step, cfg.seed)
        if self.resumed is not None:  # (where a resumed run's prompts and temperatures had got to)
            self.prompts.load_state_dict(self.resumed["prompts"])
            self.searcher.rng.setstate(rng_state(self.resumed["searcher_rng"]))

    def poll(self):
        """A fresh batch: Q prompts x S responses from the current policy, and its report."""
        with autocast(self.cfg, self.cfg.device):  # (--trainer-dtype bf16-mixed)
            batch = self.searcher.search(next(self.prompts), self.version, ref_version=-1)
        return batch.trajectories, [batch.report]

    def publish(self, kind, model, version):
        if kind == "policy":
            self.version = version  # (the searcher generates with the trainer's own policy)
        return 0.0

    def state_dict(self):
        return {"prompts": self.prompts.state_dict(), "searcher_rng": self.searcher.rng.getstate()}

    def load_state_dict(self, state):
        self.resumed = state  # (applied at start, which makes the prompt sampler and the searcher)

    pause = check_alive = close = lambda self, *args: None  # (nothing to hold, check or stop)
