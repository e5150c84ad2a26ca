"""
Many machines: the trainer and the searchers as the ranks of one torchrun job, over torch.distributed.

    torchrun --standalone --nproc-per-node 3 run_gsm8k.py [flags]     # one node: 1 trainer + 2 searchers

Every rank runs the same script. Rank 0 trains exactly as without torchrun, except that searcher.spawn_searchers
gives it a `DistSearchers` (searcher.Searchers' interface: tba.train does not change); ranks 1..N-1 run
`searcher_rank_main` (ops/launch.py), the same searcher loop (searcher.searcher_loop) with a `StoreLink` where a
searcher process has a multiprocessing queue and shared memory. Without torchrun nothing here runs.

The transport, all public torch.distributed API, nothing pickled:
  store         one TCPStore per job, made as torchrun's env:// rendezvous makes it (hosted by rank 0, or by
                torchrun's agent); it is also where the gloo process group meets.
  job           rank 0 sets the key "job": the config and the task as JSON, once it has its models.
  trajectories  a searcher pushes each batch as JSON (per Trajectory the record buffer.json keeps) to its own
                store queue "traj/<rank>" (queue_push), waiting while that holds --queue-size batches
                (queue_len); at each merge the trainer drains the queues (`DistSearchers.poll`, queue_pop).
  weights       the state dict packed into one byte tensor (`pack`) on the trainer's thread, then sent to
                every searcher with gloo point-to-point (isend) by a background thread, so the trainer never
                waits for a transfer. Each transfer is first announced on the store queue "weights/<rank>"
                (kind, version, size, layout digest); a searcher's own thread polls that queue, posts the
                matching irecv, and keeps the newest weights received; the searcher loads them between batches.
  stop          at the end rank 0 sets "stop" and waits for every searcher to add 1 to "stopped"; a
                searcher's thread does so within 50 ms, and the searcher exits 0 after its batch, without
                another store call (rank 0 may already be gone, and with it the store).

Why announce on the store rather than send a header over gloo first: a gloo receive cannot be polled, and a
gloo wait that times out breaks the process group, so a searcher waiting for a header between two publishes
would need a timeout both safe and short. Announced, a searcher enters a gloo wait only when bytes are on their
way; such a wait that outlasts --searcher-timeout means a failure: the run ends.

Failures. torchrun watches every rank of its node: when one dies it sends SIGTERM to the others (SIGKILL
30 s later). Rank 0 turns SIGTERM into a checkpoint and an exit, as without torchrun (ops/bookkeeping.py), so
the job exits non-zero within seconds. `torchrun --max-restarts N` then starts the whole job again, and
`--auto-resume` makes it continue from that checkpoint. A searcher that sends nothing for --searcher-timeout
seconds (on another node, say) ends the run with a message naming its rank and host, and so does a weight
transfer that fails. A searcher that loses the trainer (its store calls fail) exits 1.

Departures from the single-machine path (searcher.Searchers):
  1. One searcher is never restarted alone: torchrun restarts the whole job, which resumes from its latest
     checkpoint (--auto-resume); --on-searcher-failure restart is refused under torchrun.
  2. A policy publish made while the previous transfer is still being sent waits, and is sent by the first poll
     after that transfer ends (the trainer polls at every merge, and while it waits for the searchers there); a
     newer publish meanwhile replaces it, so searchers may skip a version (the staleness metrics show it), but
     the newest weights always reach them. A reference publish (TBA') waits for the transfer instead, since a
     skipped reference would stay wrong until the next reset.
  3. --num-searchers is the number of ranks after the first; under --searcher-device auto a searcher rank
     uses its LOCAL_RANK's GPU (cpu without CUDA).
  4. Every node must be able to read --model (a hub id, or a path on a shared filesystem); the tiny preset's
     warm start is built in rank 0's --cache-dir.

Run it through a run_*.py script under torchrun; -m bench.transport times the transport (docs/scaling.md).
"""

import dataclasses
import datetime
import importlib
import json
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist

from buffer import Trajectory
from config import ConfigError, RunError, SearcherDied, Stopped
from ops.devices import local_device, torchrun_rank
from ops.weights import WeightSender, digest, layout, one_line, unpack

POLL_S = 0.05  # how often a searcher's receiving thread looks for announced weights and for "stop"
JOIN_TIMEOUT_S = 600  # every rank must reach the store and the process group within this (imports can take minutes)


class TrainerGone(RunError):
    """A searcher rank lost the trainer (its store calls fail) or never got what it waits for."""


# -----------------------------------------------------------------------------
# The job: torchrun's environment, the store, the process group

def configure(cfg):
    """Under torchrun: one searcher per rank after the first; refuse what a torchrun job cannot do."""
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise ConfigError("torchrun started 1 process; rank 0 trains and ranks 1.. search: start at least 2 (--nproc-per-node)")
    if cfg.sync:
        raise ConfigError("--sync trains in one process, without searchers: run it without torchrun")
    if cfg.on_searcher_failure == "restart":
        raise ConfigError("--on-searcher-failure restart: under torchrun a failed searcher ends the job; "
                          "restart the whole job with torchrun --max-restarts N and --auto-resume")
    cfg.num_searchers = world - 1


def connect(timeout_s=JOIN_TIMEOUT_S):
    """The job's TCPStore, made as torchrun's env:// rendezvous makes it, and the gloo process group on it.
    Every rank must arrive within timeout_s (also the store's default timeout; every gloo wait here passes
    its own)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent_hosts_it, timeout=timeout, wait_for_workers=False,
                              multi_tenant=True)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except dist.DistError as e:
        raise RunError(f"rank {rank}: the job's {world} ranks did not all meet within {timeout_s:g} s "
                       f"({one_line(e)})") from None
    store.set(f"host/{rank}", f"{socket.gethostname()}, pid {os.getpid()}")
    return store


# -----------------------------------------------------------------------------
# Messages: the job and the trajectories as JSON

def encode_job(cfg, task, step, restarts):
    """What a searcher rank needs, as JSON: the config, the task (its class and dataclass fields), the step
    it starts at and the job's restart count (both seed it)."""
    return json.dumps({"cfg": dataclasses.asdict(cfg), "task_class": [type(task).__module__, type(task).__qualname__],
                       "task": {f.name: getattr(task, f.name) for f in dataclasses.fields(task)},
                       "step": step, "restarts": restarts})


def decode_job(text, config_cls):
    """(cfg, task, step, restarts) from encode_job's text; the task's class is imported by name."""
    job = json.loads(text)
    module, name = job["task_class"]
    task = getattr(importlib.import_module(module), name)(**job["task"])
    return config_cls(**job["cfg"]), task, job["step"], job["restarts"]


TRAJECTORY_FIELDS = [f.name for f in dataclasses.fields(Trajectory)]


def encode_batch(batch):
    """A searcher's batch as JSON text: per Trajectory the record buffer.json keeps (Python's JSON writes
    NaN for a log-prob left to the trainer, and floats round-trip exactly), and the searcher's report."""
    return json.dumps({"items": [{f: getattr(t, f) for f in TRAJECTORY_FIELDS} for t in batch.trajectories],  # (asdict:
                       "report": batch.report})  # deep copies)


def decode_batch(text):
    """(the Trajectories, the searcher's report) of encode_batch's text."""
    batch = json.loads(text)
    return [Trajectory(**{**r, "response_ids": tuple(r["response_ids"])}) for r in batch["items"]], batch["report"]


# -----------------------------------------------------------------------------
# Rank 0: the searchers the trainer talks to

class DistSearchers:
    """searcher.Searchers' interface, its searchers being ranks 1..N-1 of the torchrun job. A context manager:
    leaving it stops them (without waiting for them when the run is failing or stopped)."""

    def __init__(self, cfg, store=None):
        """Join the job. `store`: a store to use instead, without a process group (tests of the trajectory path)."""
        self.cfg = cfg
        self.store = store or connect()
        self.ranks = list(range(1, cfg.num_searchers + 1))  # searcher i is rank i + 1
        self.sender = WeightSender(self.store.clone(), self.ranks, cfg.searcher_timeout)
        self.failed, self.closed, self.send_ref = False, False, False
        self.pending, self.publishes, self.skipped = None, 0, 0  # a policy publish not sent yet; counts
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # a job restart restarts every searcher
        self.last_heard = [time.time()] * cfg.num_searchers

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        self.close(failing=kind is not None)

    def start(self, cfg, task, policy, ref, tokenizer, step, ref_version=0):
        """Send the searchers their job, then the weights they start from."""
        from ops.models import dtype_of
        self.cfg, self.sender.dtype = cfg, dtype_of(cfg.searcher_dtype)  # (what the searchers' models hold)
        self.store.set("job", encode_job(cfg, task, step, self.restarts))
        self.send_ref = "ref_logp" in cfg.needs  # only then do searchers score the reference
        self.sender.send([("policy", step, policy)] + ([("ref", ref_version, ref)] if self.send_ref else []), wait=True)
        self.last_heard = [time.time()] * cfg.num_searchers

    def poll(self):
        """(trajectories, reports): every trajectory the searcher ranks pushed since the last poll, and each batch's
        report (waits 10 ms when there is none)."""
        self.send_pending()  # (a publish made during a transfer goes once that transfer has ended)
        items, reports = [], []
        for i, rank in enumerate(self.ranks):
            while True:
                try:
                    batch, report = decode_batch(self.store.queue_pop(f"traj/{rank}", block=False))
                except dist.QueueEmptyError:
                    break
                items += batch
                reports.append({**report, "rank": i})
                self.last_heard[i] = time.time()
        if not items:
            time.sleep(0.01)
        return items, reports

    def publish(self, kind, model, version):
        if kind == "ref":
            return self.publish_ref(model, version)
        t0 = time.time()
        self.publishes += 1
        self.skipped += self.pending is not None  # (an unsent publish, replaced by this newer one)
        self.pending = ("policy", version, model)
        self.send_pending()
        return time.time() - t0  # (packing: the transfer runs on a background thread)

    def send_pending(self):
        """Send the newest policy publish not sent yet, unless a transfer is still in flight. The trainer trains
        only between a merge and the next publish, so at a poll the policy holds exactly the pending version."""
        if self.pending is not None and self.sender.send([self.pending]):
            self.pending = None

    def publish_ref(self, ref, version):
        """publish("ref", ...): the reference, to searchers that score it (returns the seconds it took)."""
        t0 = time.time()
        if self.send_ref:  # (after the transfer in flight, with the pending policy publish if there is one)
            self.sender.send(([self.pending] if self.pending else []) + [("ref", version, ref)], wait=True)
            self.pending = None
        return time.time() - t0

    def pause(self, paused):
        pass  # searcher ranks are not held during an evaluation (they go on generating: time the bench on one machine)

    def check_alive(self):
        """A failed weight transfer, or a searcher silent for --searcher-timeout, ends the run naming its rank."""
        if self.sender.error:
            self._fail(self.sender.error)
        for i, heard in enumerate(self.last_heard):
            silent = time.time() - heard
            if silent >= self.cfg.searcher_timeout:
                self._fail(f"searcher rank {i + 1} ({self.where(i + 1)}) sent nothing for {silent:.0f} s "
                           f"(--searcher-timeout {self.cfg.searcher_timeout:g})")

    def _fail(self, message):
        self.failed = True
        raise SearcherDied(message)

    def where(self, rank):
        """'host, pid N' of a rank, as it reported itself when it joined."""
        key = f"host/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "host unknown"

    def state_dict(self):
        return {"restarts": self.restarts}  # what Searchers keeps, so either can resume the other's run

    def load_state_dict(self, state):
        pass  # the count is torchrun's (TORCHELASTIC_RESTART_COUNT)

    def close(self, failing=False):
        """Let a transfer in flight finish, tell the searchers to stop and, unless the run is failing (or stopped),
        wait (up to --searcher-timeout) until each has acknowledged it; their threads do within 50 ms. Safe to
        call twice."""
        if self.closed:
            return
        self.closed = True
        self.sender.join(10.0)
        if self.skipped:
            print(f"weights: {self.skipped} of {self.publishes} publishes replaced by a newer one before they could "
                  f"be sent (the previous transfer was still in flight)")
        failing = failing or self.failed or self.sender.error
        try:
            self.store.set("stop", "1")
            deadline = time.time() + (0 if failing else self.cfg.searcher_timeout)
            while self.store.add("stopped", 0) < len(self.ranks) and time.time() < deadline:
                time.sleep(0.1)
            missing = len(self.ranks) - self.store.add("stopped", 0)
            if missing and not failing:
                print(f"warning: {missing} searcher rank(s) did not acknowledge the stop within "
                      f"--searcher-timeout {self.cfg.searcher_timeout:g} s; torchrun will end them")
        except dist.DistError:
            pass  # the store went with torchrun's agent, which is ending the job: the searchers go with it
        if not self.sender.busy() and dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Ranks 1..N-1: the searchers

class StoreLink:
    """A searcher rank's connection to the trainer (searcher.searcher_loop's `link`): batches go to its store
    queue; a thread receives the weights."""

    def __init__(self, store, rank, cfg):
        self.store, self.rank, self.cfg = store, rank, cfg
        self.ready, self.lock = {}, threading.Lock()  # kind -> (version, layout digest, byte tensor)
        self.stopped, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._receive, args=(store.clone(),), name="weights-receiver", daemon=True)
        self.thread.start()

    def alive(self):
        """False once the trainer said stop; raises TrainerGone if the receiving thread lost it."""
        if self.error:
            raise TrainerGone(self.error)
        return not self.stopped.is_set()

    def put(self, batch):
        """Push a batch to this rank's queue, waiting while it holds --queue-size batches; False if stopped meanwhile."""
        key, text = f"traj/{self.rank}", encode_batch(batch)
        while self.alive():
            try:
                if self.store.queue_len(key) < self.cfg.queue_size:
                    self.store.queue_push(key, text)
                    return True
            except dist.DistError:
                if self.stopped.is_set():
                    return False  # the trainer said stop and went, between alive() and this call
                raise
            time.sleep(0.1)
        return False

    def pull(self, kind, model, have_version):
        """Load the newest received "policy" or "ref" weights into `model` if newer than have_version; returns
        the version it holds. The first call waits for the trainer's first transfer."""
        deadline = time.time() + self.cfg.searcher_timeout
        while kind not in self.ready and self.alive():
            if time.time() > deadline:
                raise TrainerGone(f"searcher rank {self.rank}: no {kind} weights from the trainer within "
                                  f"--searcher-timeout {self.cfg.searcher_timeout:g} s")
            time.sleep(POLL_S)
        with self.lock:
            if kind not in self.ready or self.ready[kind][0] == have_version:
                return have_version
            version, fingerprint, flat = self.ready[kind]
            entries, _ = layout(model)
            if fingerprint != digest(entries):
                raise TrainerGone(f"searcher rank {self.rank}: its model's state dict differs from the trainer's "
                                  f"(names, shapes or dtypes); every node must load the same --model")
            model.load_state_dict(unpack(flat, entries))
            return version

    def _receive(self, store):
        """The receiving thread: wait for an announced transfer (or "stop"), receive it, make it the newest."""
        landing = {}  # kind -> a byte tensor no one reads, to receive the next transfer into
        try:
            while not self.stopped.is_set():
                try:
                    header = json.loads(store.queue_pop(f"weights/{self.rank}", block=False))
                except dist.QueueEmptyError:
                    if store.check(["stop"]):  # the loop makes no store call once stopped is set: the
                        self.stopped.set()  # trainer, which waits for this, may go (taking its store)
                        store.add("stopped", 1)
                    time.sleep(POLL_S)
                    continue
                kind, flat = header["kind"], landing.pop(header["kind"], None)
                if flat is None or flat.numel() != header["nbytes"]:
                    flat = torch.empty(header["nbytes"], dtype=torch.uint8)
                dist.irecv(flat, src=0).wait(datetime.timedelta(seconds=self.cfg.searcher_timeout))
                with self.lock:
                    previous = self.ready.get(kind)
                    self.ready[kind] = (header["version"], header["layout"], flat)
                if previous is not None:
                    landing[kind] = previous[2]
        except Exception as e:  # any failure: the searcher loop raises it at its next alive()
            self.error = f"searcher rank {self.rank} lost the trainer ({one_line(e)})"

    def close(self):
        self.stopped.set()
        self.thread.join(2 * POLL_S + 1.0)
        if not self.thread.is_alive() and dist.is_initialized():  # (a thread stuck in a gloo wait: leave it)
            dist.destroy_process_group()


def searcher_rank_main(cfg, searcher_loop):
    """A searcher rank: join the job, wait for the trainer's job, run the searcher loop (searcher.searcher_loop,
    which ops/launch.py passes in) until told to stop. Returns the exit code (0: the trainer said stop)."""
    rank = torchrun_rank()
    exit_on_signals(rank)
    store = connect()
    import transformers.modeling_utils  # noqa: F401  (the slow import, done while the trainer loads its models)
    text = wait_for_job(store)
    if text is None:  # the trainer stopped before it sent a job
        store.add("stopped", 1)
        return 0
    own_device = cfg.searcher_device
    cfg, task, step, restarts = decode_job(text, type(cfg))
    cfg.searcher_device = local_device(own_device, rank)
    if cfg.backend == "vllm":
        hide_torchrun_env()
    link = StoreLink(store, rank, cfg)
    try:
        searcher_loop(rank - 1, cfg, task, cfg.seed + step + 1000 * rank + 100_000 * restarts, link)
    except dist.DistError as e:
        raise TrainerGone(f"searcher rank {rank} lost the trainer ({one_line(e)})") from None
    finally:
        link.close()
    return 0


def wait_for_job(store):
    """The job's JSON text, or None if the trainer said stop first. Waits as long as the trainer is there
    (building the tiny preset's warm start takes minutes); each poll returns at once, and one fails when
    the store is gone."""
    while not store.check(["job"]):
        if store.check(["stop"]):
            return None
        time.sleep(0.2)
    return store.get("job")


def exit_on_signals(rank):
    """torchrun ends a job by sending each rank SIGTERM (SIGINT after a Ctrl-C): a searcher just goes."""
    def stop(signum, frame):
        raise Stopped(signum, f"searcher rank {rank}")
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)


def hide_torchrun_env():
    """vLLM reads torchrun's variables and sizes its own world by them (vllm#3088): remove them before it
    starts (this rank's process group is already up). Not run on this project's machines, which have no GPU."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
