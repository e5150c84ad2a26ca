"""
Everything a training run does besides TBA, behind the one object the trainer loop calls (tba.train):

    with run.books as books:          Ctrl-C, SIGTERM and SIGHUP ask for a stop at the next step boundary; a
                                      dead searcher or a stop leaves a checkpoint of the last consistent state
        books.begin_step(step)        stop if asked; searchers alive?; a checkpoint every --checkpoint-every
                                      steps; the task's evaluation every --eval-every steps
        books.wait_for_searchers(have, need, reports)   between the polls of a merge that waits: a stop
                                      signal or a dead searcher ends the wait; the initial fill's progress bar
        books.merged(items, reports, step, v)   counts what a merge brought (fresh reward, searcher version,
                                      rounds, the wait, what the searchers reported with their batches)
        books.log(record, groups, step)   the non-finite guard, the buffer/staleness/perf metrics, one line
                                      on the terminal every --log-every steps, one record in metrics.jsonl
                                      (and TensorBoard or W&B, --report-to)
        books.save(step)              a checkpoint (ops/checkpoint.py)
    books.restore()                   a resumed run's state, from its newest readable checkpoint: returns
                                      (step, reference version); the searchers get theirs
    step_metrics(...)                 a trainer step's metrics (tba.train_step returns them): loss, log Z, KL,
                                      gradient, off-policy drift, reward, schedules
    books.finish()                    the final evaluation, final/ and result.json, the closing line

The metric names are listed in docs/operations.md. Operations, not the algorithm: nothing here changes what
the trainer learns.
"""

import dataclasses
import json
import math
import os
import shutil
import signal
import time

import numpy as np
import torch
from tqdm import tqdm

from buffer import InconsistentBuffer, ReplayBuffer
from config import LAUNCHED, STOP_SIGNALS, ConfigError, RunError, SearcherDied, Stopped, save_config
from loss import offpolicy_metrics, tb_log_Z
from ops.evaluation import EvalPolicy
from ops.models import autocast, source_dtype
from ops.lora import save_model
from ops.memory import peak_memory
from ops.checkpoint import (CheckpointError, checkpoints_newest_first, load_checkpoint, respect_umask, save_checkpoint,
                            write_error, write_text_atomic)
from ops.metrics import Meter, Tracker, format_line


class NonFiniteError(RunError):
    pass


class StopRequested(BaseException):
    """A stop signal arrived: the trainer checkpoints at the next step boundary (or while it waits) and stops."""


@dataclasses.dataclass
class Counters:
    """What the metrics count across steps (kept in checkpoints)."""
    searcher_version: int = 0  # the newest policy version a merge brought
    fresh_reward: float = math.nan  # mean reward of what the last merge brought
    fresh_count: int = 0  # how many trajectories it brought
    round: int = 0  # the buffer's latest round ...
    round_step: int = 0  # ... and the step whose merge formed it
    skipped: int = 0  # steps skipped for a non-finite loss or gradient
    nonfinite_run: int = 0  # ... in a row, up to now


class Bookkeeping:
    def __init__(self, run):
        self.run, self.cfg = run, run.cfg
        save_config(run.cfg)  # the resolved config, printed and saved as run_dir/config.json
        self.before, self.publish_s, self.last_reports = None, 0.0, {}  # the first evaluation; the weights' trips
        self.counters, self.meter = Counters(), Meter()
        self.tracker = Tracker(run.cfg)  # metrics.jsonl, samples.jsonl, and TensorBoard or W&B with --report-to
        self.step, self.requested, self.t_step, self.t_merged = run.start, 0, time.time(), time.time()
        self.t_wait, self.waited, self.fill_bar = None, 0.0, None  # the merge's wait for the searchers
        self.new_round = None  # whether this step's merge formed a new round (None: no merge)
        self.reward_log, self.warned_unscored = {}, False  # what the searchers' rewards logged since the last merge

    # -- stop signals, and a checkpoint on the way out

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def _on_signal(self, signum, frame):
        if self.requested:  # a second signal: out now (a checkpoint being written is dropped; the launcher names the
            raise Stopped(signum)  # last complete one)
        self.requested = signum

    def __exit__(self, kind, error, traceback):
        try:  # (this handler stays until the stop's checkpoint is written: a second signal ends that too)
            if kind is not None:
                self.tracker.close()
            if kind is not None and issubclass(kind, SearcherDied):
                self.save(self.step)  # the failing step had not trained: the state is consistent
            elif kind is not None and issubclass(kind, StopRequested):  # at a step boundary or while waiting: too
                path = self.save(self.step)
                raise Stopped(self.requested, f"checkpoint {path}; continue with --resume {self.cfg.run_dir}") from None
        finally:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
        return False

    # -- per step

    def begin_step(self, step):
        """The step's record, after what happens between steps: a stop, a dead searcher, a checkpoint, an evaluation."""
        self.step, self.t_step = step, time.time()
        if self.requested:  # Ctrl-C, SIGTERM or SIGHUP: a checkpoint at this step boundary, then stop
            raise StopRequested
        self.run.searchers.check_alive()
        if step > self.run.start and self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            self.save(step)
        record = {"step": step}
        if step == self.run.start or (self.cfg.eval_every and step % self.cfg.eval_every == 0):
            record.update(self.evaluate(step))  # (the first overlaps with the searchers' start-up and initial fill)
        self.t_merge = self.t_merged = time.time()  # (a step without a merge: time/merge and time/wait are 0)
        self.waited, self.new_round, self.reward_log = 0.0, None, {}
        return record

    def wait_for_searchers(self, have, need, reports):
        """Called between two polls of a merge that waits for the searchers (the initial fill, or no new round yet):
        a stop signal ends the wait (a checkpoint), a dead or silent searcher ends the run. Sleeps 10 ms (polls return
        at once)."""
        time.sleep(0.01)
        if self.t_wait is None:
            self.t_wait = time.time()
        if need and self.fill_bar is None:
            self.fill_bar = tqdm(total=need, desc="initial fill", leave=False, disable=None)
        if self.fill_bar is not None:
            self.fill_bar.update(min(have, need) - self.fill_bar.n)
        if self.requested:
            raise StopRequested
        self.run.searchers.check_alive()
        unscored = 0  # completions no reward scored since the last batch that sent any (stale ones count too)
        for report in reversed(reports):
            if report.get("sent", 0):
                break
            unscored += report.get("unscored", 0)
        if unscored >= 4 * self.cfg.batch_size:  # (every reward None, again and again: nothing comes)
            raise RunError(f"no reward scored any of the last {unscored} completions (every one returned None or NaN): "
                           f"nothing to train on")

    def merged(self, items, reports, step, min_version):
        """Count what a merge brought (its trajectories and the searchers' reports), and how long it waited."""
        c, run = self.counters, self.run
        self.t_merged = time.time()
        self.waited = self.t_merged - self.t_wait if self.t_wait is not None else 0.0
        self.t_wait = None
        if self.fill_bar is not None:
            self.fill_bar.close()
            self.fill_bar = None
        c.fresh_count = len(items)
        if step == run.start:
            self.meter.restart()  # rates count from the first trained step on, after the initial fill
        else:
            self.meter.count(items)
        self.new_round = run.buffer.latest_round != c.round
        if self.new_round:
            c.round, c.round_step = run.buffer.latest_round, step
        elif step > run.start:
            tqdm.write(f"sync at step {step}: no new trajectories from the searchers from the weights of step "
                       f"{min_version} or newer: training on the round of step {c.round_step} again (--no-fresh-rounds)")
        if items:
            c.fresh_reward = float(np.mean([t.reward for t in items]))
            c.searcher_version = max(c.searcher_version, max(t.policy_version for t in items))
        self.reward_log = reward_reports(reports)
        self.last_reports.update({r.get("rank", 0): r for r in reports})  # (each searcher's last: its pull, its memory)
        if self.reward_log.get("reward/unscored") and not self.warned_unscored:
            self.warned_unscored = True
            tqdm.write(f"warning: {self.reward_log['reward/unscored']} completions that every reward scored None were "
                       f"skipped at step {step} (metrics: reward/unscored)")

    def log(self, record, groups, step):
        """Complete the step's record, guard against non-finite steps, write it, print it every log_every steps."""
        c, run = self.counters, self.run
        c.skipped += record["grad/skipped"]
        c.nonfinite_run = c.nonfinite_run + 1 if record["grad/skipped"] else 0
        if c.nonfinite_run >= self.cfg.max_nonfinite_steps:
            raise NonFiniteError(f"{c.nonfinite_run} steps in a row had a non-finite loss or gradient (step {step}); "
                                 f"stopping (--max-nonfinite-steps {self.cfg.max_nonfinite_steps})")
        train_seconds = time.time() - self.t_merged
        self.meter.busy += train_seconds
        record.update({
            "time/merge": self.t_merged - self.t_merge, "time/wait": self.waited, "time/train": train_seconds,
            "reward/fresh": c.fresh_reward, "buffer/fresh": c.fresh_count, "buffer/new_round": self.new_round, "buffer/round_age": step - c.round_step,
            "grad/skipped_total": c.skipped, "buffer/size": len(run.buffer), "buffer/prompts": run.buffer.num_prompts,
            "buffer/latest": sum(len(v) for v in run.buffer.latest.values()), "ref/version": run.ref_version,
            "searcher/version": c.searcher_version, "searcher/restarts": run.searchers.restarts,
            **staleness_stats(groups, step, run.buffer), **self.meter.rates(started=step > run.start),
            "time/step": time.time() - self.t_step, **self.meter.times(), **self.process_stats(), **self.reward_log})
        self.tracker.log(record)
        if step % self.cfg.log_every == 0 or step == self.cfg.steps - 1:
            tqdm.write(format_line(record))

    def process_stats(self):
        """The weights' trips and each process's peak memory: the last publish, the searchers' last pulls (what each
        reported with its last batch), the trainer's and the largest searcher's peak memory (GiB)."""
        stats = [s for s in self.last_reports.values() if "pull_s" in s]
        return {"time/publish": self.publish_s, "time/pull": max((s["pull_s"] for s in stats), default=math.nan),
                "memory/trainer_gb": peak_memory(self.cfg.device) / 2 ** 30,
                "memory/searcher_gb": max((s["peak_bytes"] for s in stats), default=math.nan) / 2 ** 30}

    def require_finite(self, model, message):
        if not all(torch.isfinite(p).all().item() for p in model.parameters()):
            raise NonFiniteError(message)

    # -- evaluation

    def evaluate(self, step):
        """The task's evaluation of the current policy, printed, as eval/<name> metrics (not counted as run time)."""
        run, t0 = self.run, time.time()
        n = self.cfg.eval_size or len(run.task.eval_prompts)
        run.searchers.pause(True)  # the searchers wait too: the clocks stop for the whole run, not the trainer alone
        with autocast(self.cfg, self.cfg.device):
            metrics = run.task.evaluate(EvalPolicy(self.cfg, run.policy, run.ref, run.tokenizer, step), n)
        run.searchers.pause(False)
        example = metrics.pop("example", None)
        self.tracker.samples(step, metrics.pop("samples", []))
        seconds = time.time() - t0
        self.meter.eval += seconds
        shown = " | ".join(f"{k} {headline_text(run.task, v)}" if k == run.task.headline else f"{k} {v:.4g}"
                           for k, v in metrics.items())
        tqdm.write(f"eval step {step} | {shown} | {n} held-out prompts | {seconds:.1f}s"
                   + (f" | e.g. {example.strip()[:100]!r}" if example is not None else ""))
        metrics = {f"eval/{k}": v for k, v in metrics.items()}
        self.before = self.before or metrics  # the run's first evaluation, kept across resumes
        return {**metrics, "time/eval_since_launch": time.time() - LAUNCHED - self.meter.eval}  # (evaluation excluded)

    def finish(self):
        """The final evaluation, the trained policy saved, before/after written to result.json and printed."""
        run, cfg = self.run, self.cfg
        record = self.evaluate(cfg.steps)
        self.tracker.log({"step": cfg.steps, **record})
        self.tracker.close()
        after = {k: v for k, v in record.items() if k.startswith("eval/")}
        final_dir = os.path.join(cfg.run_dir, "final")
        save_final(run, final_dir, {"headline": run.task.headline, "before": self.before, "after": after})
        print(f"saved the final policy to {final_dir}")
        key = f"eval/{run.task.headline}"
        print(f"{run.task.headline}: before {headline_text(run.task, self.before[key])} -> after "
              f"{headline_text(run.task, after[key])}")
        return self.before, after

    # -- checkpoints

    def save(self, step):
        """A checkpoint of the state before trainer step `step` (never of non-finite weights)."""
        run = self.run
        for model in (run.policy, run.ref):
            self.require_finite(model, "non-finite weights: no checkpoint written")
        try:
            run.buffer.check()
        except InconsistentBuffer as e:  # (a bug, not an input: the last complete checkpoint stays as it is)
            raise RunError(f"no checkpoint written at step {step}: {e}; the last complete one stays in "
                           f"{os.path.join(self.cfg.run_dir, 'checkpoints')}") from None
        state = {"ref_version": run.ref_version, "before": self.before, **dataclasses.asdict(self.counters),
                 "searchers": run.searchers.state_dict(), "config": dataclasses.asdict(self.cfg)}
        return save_checkpoint(self.cfg.run_dir, step, run.policy, run.ref, run.opt, run.buffer, state,
                               keep=self.cfg.keep_checkpoints)

    def restore(self):
        """Load the newest readable checkpoint of --resume into the run's models, optimiser, buffer and searchers (a
        broken newest one is named and the previous used); returns (its step, its reference's version)."""
        run, cfg = self.run, self.cfg
        for path in checkpoints_newest_first(cfg.resume):
            try:
                state = load_checkpoint(path, run.policy, run.ref, run.opt, run.buffer)
            except CheckpointError as e:
                print(f"warning: cannot resume from {e}; trying the checkpoint before it")
                continue
            if state["step"] > cfg.steps:
                raise ConfigError(f"--resume {cfg.resume}: {path} is at step {state['step']}, past --steps {cfg.steps}")
            print(f"resuming from {path} at step {state['step']}")
            self.before, self.step = state["before"], state["step"]
            self.tracker.rewind(state["step"])  # (the records of the steps after the checkpoint are made again)
            self.counters = Counters(**{f.name: state[f.name] for f in dataclasses.fields(Counters)})
            run.searchers.load_state_dict(state["searchers"])  # (before their start: what they resume with)
            return state["step"], state["ref_version"]
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint there could be read")


def step_metrics(cfg, groups, logp, beta, lr, loss, grad_norm, finite, clip_frac):
    """The metrics of a trainer step (tba.train_step), over its whole batch: the loss, log Z (Eq. 5), KL, gradient,
    off-policy drift, reward, schedules. logp: (Q, K) the policy's sequence log-probs, detached."""
    grid = lambda name: torch.tensor([[getattr(t, name) for t in g] for g in groups], dtype=torch.float32)  # (Q, K)
    ref_logp, reward, mu = grid("ref_logp"), grid("reward"), grid("behavior_logp")
    log_Z = tb_log_Z(logp, ref_logp, reward, beta)  # (Q,)
    return {"loss/train": loss, "loss/log_Z": log_Z.mean().item(), "loss/log_Z_std": log_Z.std().item() if len(groups) > 1 else 0.0,
            "loss/kl": (logp - ref_logp).mean().item(), "grad/norm": grad_norm, "grad/skipped": int(not finite),
            "grad/clipped": int(bool(cfg.grad_clip) and grad_norm > cfg.grad_clip), "offpolicy/clip_frac": clip_frac,
            **offpolicy_metrics(logp, mu, cfg.clip_eps), "reward/batch": reward.mean().item(), "sched/beta": beta,
            "sched/lr": lr, "response/tokens": float(np.mean([len(t.response_ids) for g in groups for t in g]))}


def reward_reports(reports):
    """What the searchers' batches reported of their rewards: the mean of each logged metric (reward/NAME) and how
    many completions no reward scored (reward/unscored); empty when they report nothing."""
    metrics = {}
    for report in reports:
        for name, values in report.get("reward_metrics", {}).items():
            metrics.setdefault(f"reward/{name}", []).extend(values)
    unscored = sum(report.get("unscored", 0) for report in reports)
    return {**{k: float(np.mean(v)) for k, v in metrics.items()}, **({"reward/unscored": unscored} if unscored else {})}


def save_final(run, final_dir, result):
    """final/ (the trained policy, LoRA merged, in the dtype of the checkpoint it started from, and its tokenizer:
    from_pretrained loads it) and result.json, each written under a temporary name and renamed into place; a failed
    write is a WriteError, nothing half-written left."""
    tmp = f"{final_dir}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(run.policy, tmp, source_dtype(run.cfg))  # (in the dtype the run's model came in)
        run.tokenizer.save_pretrained(tmp)
        respect_umask(tmp)
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp, final_dir)
        write_text_atomic(os.path.join(run.cfg.run_dir, "result.json"), json.dumps(result, indent=2))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(final_dir, e) from None


def headline_text(task, value):
    return f"{100 * value:.1f}%" if task.percent else f"{value:.3f}"


def staleness_stats(groups, step, buffer):
    """Distribution of (step - policy_version) over the batch, and its max over latest-round items."""
    s = ReplayBuffer.staleness(groups, step)
    in_round = {id(t) for items in buffer.latest.values() for t in items}
    latest = [step - t.policy_version for g in groups for t in g if id(t) in in_round]
    return {"buffer/latest_frac": sum(id(g[0]) in in_round for g in groups) / len(groups),  # the realised m
            "staleness/mean": float(s.mean()), "staleness/p50": float(np.percentile(s, 50)),
            "staleness/p90": float(np.percentile(s, 90)), "staleness/max": int(s.max()),
            "staleness/latest_max": max(latest, default=-1), "staleness/hist": np.bincount(s).tolist()}
