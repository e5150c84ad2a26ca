"""
TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025, arXiv 2503.18929).

The TRAINER process and the process plumbing. `train(cfg, task)` does, in order:
    1. spawn `num_searchers` SEARCHER processes (searcher.py), each with a stale copy of the policy;
    2. wait for `initial_completions` trajectories and merge them into the replay buffer (buffer.py);
    3. loop, never waiting for generation:
         merge  (every sync_every steps) drain the searchers' queue into the buffer as one round
         sample Q = batch_size / K queries x K responses from the buffer
         loss   sequence log-probs under the policy (with grad) -> VarGrad TB loss (loss.py, Eq. 4-5)
         step   AdamW with grad clipping; warmup-stable-decay learning rate; linear beta schedule
         log    one line and one JSONL record per step
         sync   (every sync_every steps) publish the weights to the searchers
       and, for TBA', reset the reference policy to the current policy every `ref_reset_every` steps.
With `--sync`, the same loss and batch run fully on-policy in one process (generate, then train): the
baseline that the asynchronous system is compared against.

The reference. Searchers attach log pi_ref(y|x) to every trajectory together with the version of the
reference that computed it; the trainer recomputes it for any trajectory whose reference has since been
reset, so a stale reference log-prob is never used.

Processes. Spawn start method; every child sets its own thread count; every queue read has a timeout;
the trainer checks its searchers each step and, if one died, stops the run (non-zero exit, naming the
searcher) or restarts it (`--on-searcher-failure`); Ctrl-C stops cleanly at the next step boundary with a
checkpoint (checkpoint.py), and any error stops and joins every child. Non-finite steps are skipped.

Departures from the paper / official code:
  1. One trainer process (the official code supports several trainer GPUs with DeepSpeed).
  2. Searchers never block at a sync (see searcher.py and buffer.py).
  3. Gradient accumulation is over whole queries (`micro_batch_queries`), so each query's log_Z sees all
     K of its responses, exactly as in the full-batch loss.
  4. Checkpoints with resume, a searcher failure policy and a non-finite guard (the official code has none).

Run: python run_gsm8k.py (this module is the library it calls).
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import queue
import signal
import time
import typing
from dataclasses import dataclass, field

import numpy as np
import torch

from tqdm import tqdm

from buffer import ReplayBuffer
from loss import OBJECTIVES, beta_schedule, make_batch, objective_loss, sequence_logprobs, tb_log_Z, wsd_lr_multiplier


def knob(default, doc):
    """A config field with its one-line documentation (shown by --help)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class Config:
    """Every knob of a TBA run; run_gsm8k.py adds the task's own. Each field is a --flag of the same name."""
    # run
    run_dir: str = knob("runs/gsm8k", "directory for config.json, metrics.jsonl and the final model")
    seed: int = knob(0, "random seed for every process (each searcher offsets it by its rank)")
    steps: int = knob(700, "trainer optimiser steps")
    sync: bool = knob(False, "synchronous on-policy baseline: generate then train in one process, no searchers "
                             "(fresh data every step: --sync-every and --m do not apply)")
    dry_run: bool = knob(False, "print the resolved config and the process-to-device plan, then exit (loads nothing)")
    # models
    model: str = knob("", "policy initialisation: HF hub name or local directory")
    ref_model: str = knob("", "reference policy (empty: same as --model)")
    trust_remote_code: bool = knob(False, "allow custom model code from the hub")
    dtype: str = knob("auto", "model dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16")
    device: str = knob("auto", "trainer device: auto (cuda:0 if CUDA is available, else cpu) | cpu | cuda:N")
    searcher_device: str = knob("auto", "searcher devices: auto (one GPU each after the trainer's, shared round-robin "
                                        "if too few; cpu without CUDA), one device, or a comma list with one per searcher")
    trainer_threads: int = knob(1, "torch threads in the trainer process")
    searcher_threads: int = knob(1, "torch threads in each searcher process")
    # search
    num_searchers: int = knob(1, "searcher processes")
    backend: str = knob("auto", "searcher generation backend: auto (vllm if installed and on GPU, else hf) | hf | vllm")
    vllm_gpu_memory_utilization: float = knob(0.5, "fraction of a searcher GPU that vLLM may take")
    prompts_per_search: int = knob(4, "prompts per searcher generation batch")
    samples_per_prompt: int = knob(24, "S: responses generated per prompt")
    temperature: float = knob(0.7, "sampling temperature")
    temperature_max: typing.Optional[float] = knob(None, "if set, each batch samples at uniform[temperature, this]")
    max_new_tokens: int = knob(512, "longest response, in tokens")
    # trainer
    objective: str = knob("tb", f"training objective: {' | '.join(OBJECTIVES)}")
    batch_size: int = knob(140, "trajectories per step: Q queries x K responses")
    responses_per_query: int = knob(20, "K: responses per query in a training batch (<= S)")
    micro_batch_queries: int = knob(7, "queries per forward/backward (gradient accumulation over queries)")
    micro_batch: int = knob(64, "rows per no-grad scoring forward (reference log-probs)")
    lr: float = knob(1e-5, "peak learning rate (AdamW)")
    weight_decay: float = knob(0.0, "AdamW weight decay")
    warmup_steps: int = knob(50, "learning-rate warmup steps")
    stable_steps: int = knob(350, "learning-rate stable steps after warmup")
    decay_steps: int = knob(600, "learning-rate linear decay steps after stable")
    lr_floor: float = knob(0.0, "final learning rate as a fraction of the peak")
    grad_clip: float = knob(1.0, "gradient-norm clipping threshold")
    beta_start: float = knob(0.014, "KL coefficient beta at step 0")
    beta_end: float = knob(0.004, "KL coefficient beta after the decay")
    beta_decay_steps: int = knob(500, "steps over which beta decays linearly to beta_end")
    beta_stop_step: typing.Optional[int] = knob(None, "if set, beta jumps to beta_end at this step")
    ref_reset_every: int = knob(0, "TBA': reset the reference to the policy every this many steps (0: never)")
    loss_temperature: typing.Optional[float] = knob(None, "logit temperature for log-probs in the loss (None: --temperature)")
    # buffer and sync
    sync_every: int = knob(2, "k: merge searcher data and publish weights every k trainer steps")
    initial_completions: int = knob(500, "trajectories to collect before the first trainer step")
    m: float = knob(0.95, "probability that a query's K responses come from the latest round (most-on-policy)")
    prioritization: str = knob("softmax", "off-policy draws: softmax (of reward / reward_temp) | uniform")
    reward_temp: float = knob(1.0, "temperature of softmax prioritization")
    capacity_per_query: int = knob(1000, "newest trajectories kept per query")
    queue_size: int = knob(64, "searcher batches the queue holds before searchers wait")
    # surviving long runs
    checkpoint_every: int = knob(0, "save a checkpoint every this many steps (always at the end, on Ctrl-C, on abort)")
    resume: str = knob("", "continue the run saved in this run directory, from its latest checkpoint")
    on_searcher_failure: str = knob("abort", "when a searcher dies: abort (exit non-zero) | restart (up to the limit)")
    max_searcher_restarts: int = knob(3, "restarts allowed over the run with --on-searcher-failure restart")
    max_nonfinite_steps: int = knob(5, "abort after this many steps in a row with a non-finite loss or gradient")
    max_prompt_tokens: int = knob(0, "skip (and count) prompts longer than this many tokens (0: no limit)")
    # evaluation and logging
    eval_every: int = knob(100, "greedy eval on held-out problems every this many steps (0: start and end only)")
    eval_size: int = knob(0, "held-out problems per eval (0: all)")
    eval_batch_size: int = knob(64, "prompts per eval generation batch")
    log_every: int = knob(1, "print a metrics line every this many steps (metrics.jsonl gets every step)")

    @property
    def num_queries(self):
        return self.batch_size // self.responses_per_query

    @property
    def searcher_devices(self):
        devices = self.searcher_device.split(",")
        return devices * self.num_searchers if len(devices) == 1 else devices


def resolve_devices(cfg, num_gpus):
    """Fill in the 'auto' device and dtype fields in place, given how many GPUs are visible."""
    if cfg.device == "auto":
        cfg.device = "cuda:0" if num_gpus else "cpu"
    if cfg.searcher_device == "auto":
        n = 1 if cfg.sync else cfg.num_searchers
        cfg.searcher_device = ",".join(f"cuda:{(1 + i) % num_gpus}" for i in range(n)) if num_gpus else "cpu"
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if cfg.device.startswith("cuda") else "float32"
    if cfg.backend == "auto":
        on_gpu = all(d.startswith("cuda") for d in cfg.searcher_devices)
        cfg.backend = "vllm" if on_gpu and importlib.util.find_spec("vllm") is not None else "hf"
    return cfg


def device_plan(cfg):
    """One line per process: what runs where."""
    lines = [f"trainer     : {cfg.device} ({cfg.dtype}, {cfg.trainer_threads} threads)"]
    if cfg.sync:
        return lines + ["searchers   : none (--sync: the trainer generates its own on-policy batches)"]
    for rank, device in enumerate(cfg.searcher_devices):
        backend = f"vllm, gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}" if cfg.backend == "vllm" else "hf generate"
        lines.append(f"searcher-{rank:<2d} : {device} ({cfg.dtype}, {backend}, {cfg.searcher_threads} threads)")
    return lines


def validate(cfg):
    """Raise ValueError naming the flag for every inconsistent setting, before anything is spawned."""
    checks = [
        (0.0 <= cfg.m <= 1.0, "--m must be in [0, 1]"),
        (cfg.responses_per_query >= 1, "--responses-per-query must be >= 1"),
        (cfg.responses_per_query <= cfg.samples_per_prompt, "--responses-per-query (K) must be <= --samples-per-prompt (S)"),
        (cfg.batch_size % cfg.responses_per_query == 0, "--batch-size must be a multiple of --responses-per-query"),
        (cfg.batch_size >= cfg.responses_per_query, "--batch-size must be >= --responses-per-query"),
        (cfg.num_queries % cfg.micro_batch_queries == 0 or cfg.micro_batch_queries >= cfg.num_queries,
         "--micro-batch-queries must divide batch_size / responses_per_query"),
        (cfg.sync_every >= 1, "--sync-every must be >= 1"),
        (cfg.steps >= 1, "--steps must be >= 1"),
        (cfg.num_searchers >= 1 or cfg.sync, "--num-searchers must be >= 1"),
        (len(cfg.searcher_device.split(",")) in (1, cfg.num_searchers), "--searcher-device needs one device or one per searcher"),
        (cfg.objective in OBJECTIVES, f"--objective must be one of {OBJECTIVES}"),
        (cfg.prioritization in ("softmax", "uniform"), "--prioritization must be softmax or uniform"),
        (cfg.backend in ("auto", "hf", "vllm"), "--backend must be auto, hf or vllm"),
        (cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "--dtype must be auto, float32, bfloat16 or float16"),
        (not (cfg.backend == "vllm" and "cpu" in cfg.searcher_device), "--backend vllm needs GPU searchers"),
        (cfg.beta_start > 0 and cfg.beta_end > 0, "--beta-start and --beta-end must be > 0"),
        (cfg.temperature > 0, "--temperature must be > 0"),
        (cfg.ref_reset_every >= 0, "--ref-reset-every must be >= 0"),
        (cfg.initial_completions >= 1, "--initial-completions must be >= 1"),
        (bool(cfg.model), "--model is required"),
        (cfg.on_searcher_failure in ("abort", "restart"), "--on-searcher-failure must be abort or restart"),
        (cfg.checkpoint_every >= 0 and cfg.max_nonfinite_steps >= 1, "--checkpoint-every must be >= 0 and --max-nonfinite-steps >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


class ConfigError(ValueError):
    """A bad flag value; raised before anything is loaded or spawned."""


# -----------------------------------------------------------------------------
# CLI generated from the dataclass

def _flag(name):
    return "--" + name.replace("_", "-")


def build_parser(config_cls, defaults):
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        kind = hints[f.name]
        optional = typing.get_origin(kind) is typing.Union
        base = [a for a in typing.get_args(kind) if a is not type(None)][0] if optional else kind
        kwargs = dict(default=defaults.get(f.name, f.default), help=f.metadata["doc"])
        if base is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(_flag(f.name), type=_optional(base) if optional else base, metavar=base.__name__.upper(), **kwargs)
    return parser


def _optional(base):
    def parse(text):
        return None if text.lower() == "none" else base(text)
    parse.__name__ = base.__name__
    return parse


def parse_config(config_cls, presets, argv=None, default_preset=None):
    """`--preset NAME` picks a column of defaults from `presets`; every other flag overrides one field."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default=default_preset)
    known, rest = pre.parse_known_args(argv)
    parser = build_parser(config_cls, presets[known.preset])
    parser.add_argument("--preset", choices=sorted(presets), default=known.preset, help="named set of defaults")
    args = parser.parse_args(argv)
    preset = args.preset
    del args.preset
    return config_cls(**vars(args)), preset


def print_config(cfg, preset):
    record = {"preset": preset, **dataclasses.asdict(cfg)}
    width = max(len(k) for k in record)
    print("\n".join(f"{k:<{width}} = {v}" for k, v in record.items()))
    return record


def save_config(cfg, preset):
    """Print the resolved config and save it as run_dir/config.json (erroring early if run_dir is unwritable)."""
    record = print_config(cfg, preset)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(record, f, indent=2)


# -----------------------------------------------------------------------------
# Where trajectories come from: searcher processes (TBA) or in-process generation (--sync)

class SearcherDied(RuntimeError):
    pass


class AsyncRollout:
    """The searcher processes, one queue each, and the shared weights. Always `close()` it."""

    def __init__(self, cfg, task, policy, ref, seed_offset=0):
        from searcher import SharedWeights
        self.cfg, self.task, self.seed_offset = cfg, task, seed_offset
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.policy_weights = SharedWeights(policy, self.ctx)
        self.ref_weights = SharedWeights(ref, self.ctx)
        self.procs, self.queues = [None] * cfg.num_searchers, [None] * cfg.num_searchers
        self.received, self.restarts, self.stop = 0, 0, None
        self.period = cfg.sync_every  # merge and publish every k steps
        for rank in range(cfg.num_searchers):
            self._start(rank)

    def _start(self, rank):
        """(Re)start searcher `rank` with a fresh queue: a process killed mid-write can leave its queue corrupt."""
        from searcher import searcher_main
        seed = self.cfg.seed + self.seed_offset + 1000 * (rank + 1) + 100_000 * self.restarts
        self.queues[rank] = self.ctx.Queue(maxsize=self.cfg.queue_size)
        self.procs[rank] = self.ctx.Process(
            target=searcher_main, name=f"searcher-{rank}",
            args=(rank, self.cfg, self.task, self.policy_weights, self.ref_weights, self.queues[rank],
                  self.stop_event, os.getpid(), seed))
        self.procs[rank].start()

    def check_alive(self):
        """A dead searcher is restarted (with the current weights) or ends the run, per --on-searcher-failure."""
        for rank, p in enumerate(self.procs):
            if p.exitcode is None:
                continue
            if self.stop is not None and self.stop.requested:
                raise KeyboardInterrupt  # Ctrl-C reached the searchers too; not a failure
            msg = f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}; its traceback, if any, is above"
            if self.cfg.on_searcher_failure == "abort":
                raise SearcherDied(msg)
            if self.restarts >= self.cfg.max_searcher_restarts:
                raise SearcherDied(f"{msg}; restart limit --max-searcher-restarts {self.cfg.max_searcher_restarts} reached")
            self.restarts += 1
            tqdm.write(f"{msg}; restarting it ({self.restarts}/{self.cfg.max_searcher_restarts})")
            self.queues[rank].cancel_join_thread()
            self._start(rank)

    def merge(self, buffer, step):
        """Drain every queue into the buffer as one round (blocking for the initial fill at step 0)."""
        need = self.cfg.initial_completions if step == 0 and self.received == 0 else 0
        items = []
        bar = tqdm(total=need, desc="initial fill", leave=False, disable=need == 0)
        while True:
            got = 0
            for q in self.queues:
                try:
                    _, batch = q.get(timeout=0.01)
                except queue.Empty:
                    continue
                items.extend(batch)
                got += len(batch)
            bar.update(got)
            if not got:
                if len(items) >= need:
                    break
                self.check_alive()
        bar.close()
        self.received += len(items)
        # items from weights older than the previous sync stay out of the most-on-policy round (buffer.py)
        buffer.add(items, round_min_version=max(step - self.cfg.sync_every, 0))
        return items

    def sample(self, buffer):
        cfg = self.cfg
        return buffer.sample(cfg.num_queries, cfg.responses_per_query, cfg.m, cfg.prioritization, cfg.reward_temp)

    def publish(self, policy, step):
        self.policy_weights.publish(policy, step)

    def publish_ref(self, ref, ref_version):
        self.ref_weights.publish(ref, ref_version)

    def state_dict(self):
        return {"restarts": self.restarts}  # searchers restart fresh on resume (see checkpoint.py)

    def load_state_dict(self, state):
        self.restarts = state["restarts"]

    def close(self):
        self.stop_event.set()
        deadline = time.time() + 5.0
        for p in self.procs:
            p.join(timeout=max(deadline - time.time(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


class SyncRollout:
    """On-policy baseline: every step generates fresh responses with the current weights, then trains on them."""

    def __init__(self, cfg, task, policy, ref, tokenizer):
        from searcher import HFGenerator, PromptSampler, Searcher
        generator = HFGenerator(policy, tokenizer, cfg.max_new_tokens)
        self.cfg = cfg
        self.searcher = Searcher(cfg, task, generator, policy, ref, tokenizer, cfg.seed)
        self.prompts = PromptSampler(len(task.prompts), 0, 1, cfg.num_queries, cfg.seed)
        self.received, self.restarts = 0, 0
        self.period = 1  # on-policy: fresh data every step, whatever --sync-every says
        self.ref_version = 0

    def merge(self, buffer, step):
        items = self.searcher.search(next(self.prompts), step, self.ref_version)
        self.received += len(items)
        buffer.add(items)
        return items

    def sample(self, buffer):
        return buffer.latest_groups(self.cfg.responses_per_query)

    def check_alive(self):
        pass

    def publish(self, policy, step):
        pass  # the in-process searcher generates with the trainer's own policy

    def publish_ref(self, ref, ref_version):
        self.ref_version = ref_version  # ... and scores with the trainer's own reference

    def state_dict(self):
        from searcher import _json_state
        return {"prompts": self.prompts.state_dict(), "searcher_rng": _json_state(self.searcher.rng.getstate()),
                "ref_version": self.ref_version, "received": self.received}

    def load_state_dict(self, state):
        from searcher import _tuple_state
        self.prompts.load_state_dict(state["prompts"])
        self.searcher.rng.setstate(_tuple_state(state["searcher_rng"]))
        self.ref_version, self.received = state["ref_version"], state["received"]

    def close(self):
        pass


# -----------------------------------------------------------------------------
# The trainer

def train_step(cfg, policy, ref, opt, groups, prompt_ids, pad_id, beta, ref_version):
    """One optimiser step on Q groups of K trajectories. Returns the step's metrics (aggregated over micro-batches)."""
    Q, K = len(groups), len(groups[0])
    T = cfg.loss_temperature or cfg.temperature
    refresh_ref_logp(cfg, ref, [t for g in groups for t in g], prompt_ids, pad_id, T, ref_version)
    opt.zero_grad(set_to_none=True)
    total, logps = 0.0, []
    for i in range(0, Q, cfg.micro_batch_queries):
        chunk = groups[i:i + cfg.micro_batch_queries]
        q = len(chunk)
        flat = [t for g in chunk for t in g]
        batch = make_batch([prompt_ids[t.query_id] for t in flat], [t.response_ids for t in flat], pad_id)
        logp = sequence_logprobs(policy, *(b.to(cfg.device) for b in batch), T).view(q, K)  # (q, K)
        as_grid = lambda values: torch.tensor(values, dtype=torch.float32, device=cfg.device).view(q, K)
        ref_logp, reward = as_grid([t.ref_logp for t in flat]), as_grid([t.reward for t in flat])  # (q, K)
        behavior_logp = as_grid([t.behavior_logp for t in flat])  # (q, K)
        num_tokens = as_grid([len(t.response_ids) for t in flat])  # (q, K)
        loss = objective_loss(cfg.objective, logp, ref_logp, behavior_logp, reward, beta, num_tokens) * (q / Q)
        loss.backward()
        total += loss.item()
        logps.append(logp.detach().cpu())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip).item()
    finite = math.isfinite(total) and math.isfinite(grad_norm)
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    logp = torch.cat(logps)  # (Q, K)
    ref_logp = torch.tensor([[t.ref_logp for t in g] for g in groups])  # (Q, K)
    reward = torch.tensor([[t.reward for t in g] for g in groups])  # (Q, K)
    return {"loss/train": total, "loss/log_Z": tb_log_Z(logp, ref_logp, reward, beta).mean().item(),
            "loss/kl": (logp - ref_logp).mean().item(), "grad/norm": grad_norm, "grad/skipped": int(not finite),
            "reward/batch": reward.mean().item(),
            "response/tokens": float(np.mean([len(t.response_ids) for g in groups for t in g]))}


@torch.no_grad()
def refresh_ref_logp(cfg, ref, trajectories, prompt_ids, pad_id, temperature, ref_version):
    """Recompute log pi_ref for trajectories scored by an older reference; cache the result on them."""
    stale = [t for t in trajectories if t.ref_version != ref_version]
    for i in range(0, len(stale), cfg.micro_batch):
        chunk = stale[i:i + cfg.micro_batch]
        batch = make_batch([prompt_ids[t.query_id] for t in chunk], [t.response_ids for t in chunk], pad_id)
        values = sequence_logprobs(ref, *(b.to(cfg.device) for b in batch), temperature).tolist()
        for t, v in zip(chunk, values):
            t.ref_logp, t.ref_version = v, ref_version
    return len(stale)


def staleness_stats(groups, step, buffer):
    """Distribution of (step - policy_version) over the batch, and its max over latest-round items."""
    s = ReplayBuffer.staleness(groups, step)
    in_round = {id(t) for items in buffer.latest.values() for t in items}
    latest = [step - t.policy_version for g in groups for t in g if id(t) in in_round]
    return {"staleness/mean": float(s.mean()), "staleness/p50": float(np.percentile(s, 50)),
            "staleness/p90": float(np.percentile(s, 90)), "staleness/max": int(s.max()),
            "staleness/latest_max": max(latest, default=-1), "staleness/hist": np.bincount(s).tolist()}


def run_eval(cfg, policy, tokenizer, task, step, log_fn):
    from searcher import HFGenerator, evaluate
    n = cfg.eval_size or len(task.eval_prompts)
    generator = HFGenerator(policy, tokenizer, cfg.max_new_tokens)
    t0 = time.time()
    acc, sample = evaluate(generator, tokenizer, task.eval_prompts[:n], task.eval_answers[:n], task.reward, cfg.eval_batch_size)
    log_fn(f"eval step {step} | accuracy {100 * acc:.1f}% on {n} held-out problems | {time.time() - t0:.1f}s | e.g. {sample.strip()[:100]!r}")
    return acc


def format_line(m):
    return (f"step {m['step']:5d} | loss {m['loss/train']:8.3f} | log_Z {m['loss/log_Z']:7.2f} | kl {m['loss/kl']:6.2f} | "
            f"reward {m['reward/batch']:.3f} fresh {m['reward/fresh']:.3f} | beta {m['sched/beta']:.4f} | lr {m['sched/lr']:.2e} | "
            f"buffer {m['buffer/size']} | stale {m['staleness/mean']:.1f}/{m['staleness/max']} | "
            f"{m['perf/samples_per_s']:.0f} samples/s | busy {100 * m['perf/busy']:.0f}%")


class Meter:
    """Wall-clock accounting from step 1 on (after the initial fill): busy time, eval time, samples received."""

    def __init__(self):
        self.start = self.t0 = time.time()
        self.busy, self.eval, self.received0 = 0.0, 0.0, 0

    def elapsed(self):
        """Seconds since the rollout started (initial fill included), evaluation excluded."""
        return time.time() - self.start - self.eval

    def restart(self, received):
        self.t0, self.busy, self.received0 = time.time(), 0.0, received

    def rates(self, received, started):
        wall = time.time() - self.t0 - self.eval  # evaluation pauses the clock
        if not started or wall <= 0:
            return {"perf/samples_per_s": float("nan"), "perf/busy": float("nan"), "time/eval": self.eval}
        return {"perf/samples_per_s": (received - self.received0) / wall, "perf/busy": self.busy / wall,
                "time/eval": self.eval}


class Stop:
    """Ctrl-C during training asks for a clean stop at the next step boundary (a second Ctrl-C is immediate)."""

    def __enter__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


class NonFiniteError(RuntimeError):
    pass


def drop_long_prompts(task, tokenizer, max_tokens):
    """Skip prompts longer than max_tokens (counted and printed), before any searcher sees them."""
    if not max_tokens:
        return task
    keep = lambda prompts: [i for i, p in enumerate(prompts) if len(tokenizer(p)["input_ids"]) <= max_tokens]
    train_ids, eval_ids = keep(task.prompts), keep(task.eval_prompts)
    print(f"--max-prompt-tokens {max_tokens}: skipped {len(task.prompts) - len(train_ids)} of {len(task.prompts)} "
          f"training and {len(task.eval_prompts) - len(eval_ids)} of {len(task.eval_prompts)} held-out prompts")
    if not train_ids or not eval_ids:
        raise ConfigError(f"--max-prompt-tokens {max_tokens} leaves no training or no held-out prompts")
    pick = lambda xs, ids: [xs[i] for i in ids]
    return dataclasses.replace(task, prompts=pick(task.prompts, train_ids), answers=pick(task.answers, train_ids),
                               eval_prompts=pick(task.eval_prompts, eval_ids), eval_answers=pick(task.eval_answers, eval_ids))


def weights_finite(model):
    return all(torch.isfinite(p).all().item() for p in model.parameters())


def train(cfg, task):
    """Run TBA (or the --sync baseline) on `task`; returns (accuracy before, accuracy after)."""
    from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from searcher import _dtype, load_model
    validate(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    torch.set_num_threads(cfg.trainer_threads)
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_model(cfg.model, cfg.device, _dtype(cfg.dtype), cfg.trust_remote_code)
    ref, _ = load_model(cfg.ref_model or cfg.model, cfg.device, _dtype(cfg.dtype), cfg.trust_remote_code)
    ref.requires_grad_(False)  # both stay in eval mode: no dropout, log-probs are a function of the weights
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    task = drop_long_prompts(task, tokenizer, cfg.max_prompt_tokens)
    prompt_ids = [tokenizer(p)["input_ids"] for p in task.prompts]
    buffer = ReplayBuffer(cfg.capacity_per_query, cfg.seed)
    start, state = 0, {"ref_version": 0, "searcher_version": 0, "fresh_reward": float("nan"), "skipped": 0}
    if cfg.resume:
        path = latest_checkpoint(cfg.resume)
        state = load_checkpoint(path, policy, ref, opt, buffer)
        start = state.pop("step")
        print(f"resuming from {path} at step {start}")
    acc_before = run_eval(cfg, policy, tokenizer, task, start, tqdm.write)
    metrics_file = open(os.path.join(cfg.run_dir, "metrics.jsonl"), "a" if cfg.resume else "w")
    rng_state = torch.get_rng_state()  # the searcher processes below must not shift the trainer's random stream
    rollout = (SyncRollout(cfg, task, policy, ref, tokenizer) if cfg.sync else
               AsyncRollout(cfg, task, policy, ref, seed_offset=start))
    torch.set_rng_state(rng_state)
    if "rollout" in state:
        rollout.load_state_dict(state.pop("rollout"))
        rollout.publish_ref(ref, state["ref_version"])
    meter, nonfinite_run = Meter(), 0

    def checkpoint(step):
        if not (weights_finite(policy) and weights_finite(ref)):
            raise NonFiniteError("non-finite weights: no checkpoint written")
        save_checkpoint(cfg.run_dir, step, policy, ref, opt, buffer, {**state, "rollout": rollout.state_dict(),
                                                                      "config": dataclasses.asdict(cfg)})

    try:
        with Stop() as stop:
            rollout.stop = stop
            for step in tqdm(range(start, cfg.steps), desc="train", dynamic_ncols=True, initial=start, total=cfg.steps):
                if stop.requested:  # Ctrl-C: a clean stop at a step boundary, with a checkpoint
                    checkpoint(step)
                    raise KeyboardInterrupt
                t_step = time.time()
                rollout.check_alive()
                if step == start + 1:
                    meter.restart(rollout.received)
                if step > start and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoint(step)
                if step % rollout.period == 0 or step == start:  # merge
                    fresh = rollout.merge(buffer, step)
                    state["fresh_reward"] = float(np.mean([t.reward for t in fresh])) if fresh else state["fresh_reward"]
                    state["searcher_version"] = max([t.policy_version for t in fresh], default=state["searcher_version"])
                if cfg.ref_reset_every and step > 0 and step % cfg.ref_reset_every == 0:  # TBA': reset the reference
                    ref.load_state_dict(policy.state_dict())
                    state["ref_version"] = step
                    rollout.publish_ref(ref, step)
                t_busy = time.time()
                merge_s = t_busy - t_step
                groups = rollout.sample(buffer)  # sample
                beta = beta_schedule(step, cfg.beta_start, cfg.beta_end, cfg.beta_decay_steps, cfg.beta_stop_step)
                lr = cfg.lr * wsd_lr_multiplier(step, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.lr_floor)
                for group in opt.param_groups:
                    group["lr"] = lr
                m = train_step(cfg, policy, ref, opt, groups, prompt_ids, tokenizer.pad_token_id, beta, state["ref_version"])  # loss, step
                train_s = time.time() - t_busy
                meter.busy += train_s
                nonfinite_run = nonfinite_run + 1 if m["grad/skipped"] else 0
                state["skipped"] += m["grad/skipped"]
                if nonfinite_run >= cfg.max_nonfinite_steps:
                    raise NonFiniteError(f"{nonfinite_run} steps in a row had a non-finite loss or gradient (step {step}); "
                                         f"stopping (--max-nonfinite-steps {cfg.max_nonfinite_steps})")
                m.update({"step": step, "sched/beta": beta, "sched/lr": lr, "reward/fresh": state["fresh_reward"],
                          "grad/skipped_total": state["skipped"], "buffer/size": len(buffer),
                          "buffer/queries": buffer.num_queries, "buffer/latest": sum(len(v) for v in buffer.latest.values()),
                          "ref/version": state["ref_version"], "searcher/version": state["searcher_version"],
                          "searcher/restarts": rollout.restarts, **staleness_stats(groups, step, buffer),
                          **meter.rates(rollout.received, started=step > start), "time/step": time.time() - t_step,
                          "time/merge": merge_s, "time/train": train_s, "time/elapsed": meter.elapsed()})
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                    t_eval = time.time()
                    m["eval/accuracy"] = run_eval(cfg, policy, tokenizer, task, step + 1, tqdm.write)
                    meter.eval += time.time() - t_eval
                metrics_file.write(json.dumps(m) + "\n")  # log
                metrics_file.flush()
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    tqdm.write(format_line(m))
                if (step + 1) % rollout.period == 0:  # sync
                    if not weights_finite(policy):
                        raise NonFiniteError(f"non-finite weights after step {step}: not publishing them")
                    rollout.publish(policy, step + 1)
        checkpoint(cfg.steps)
    except SearcherDied:
        checkpoint(step)  # the step had not started: the state is consistent
        raise
    finally:
        rollout.close()
        metrics_file.close()
    acc_after = run_eval(cfg, policy, tokenizer, task, cfg.steps, tqdm.write)
    final_dir = os.path.join(cfg.run_dir, "final")
    policy.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    print(f"saved the final policy to {final_dir}")
    print(f"accuracy: before {100 * acc_before:.1f}% -> after {100 * acc_after:.1f}%")
    return acc_before, acc_after
