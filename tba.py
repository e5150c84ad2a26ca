"""
TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025, arXiv 2503.18929): the TRAINER.

`train(cfg, task)` starts the searcher processes (rollout.py, searcher.py), then loops, never waiting
for generation:
    merge   every k = sync_every steps, drain what the searchers sent into the replay buffer as one round
            (buffer.py); the first merge waits for `initial_completions` trajectories
    reset   TBA': every `ref_reset_every` steps the reference becomes the current policy
    sample  Q = batch_size / K queries x K responses from the buffer
    loss    sequence log-probs under the policy (with grad) -> the objective, by default the VarGrad
            trajectory-balance loss (loss.py, Eq. 4-5)
    step    AdamW with grad clipping; warmup-stable-decay learning rate; linear beta schedule
    log     one line, and one JSON record per step in metrics.jsonl
    sync    every k steps, publish the weights to the searchers
With `--sync`, the same loss and batch run fully on-policy in one process (generate, then train): the
baseline that the asynchronous system is compared against.

The reference. Searchers attach log pi_ref(y|x) to every trajectory together with the version of the
reference that computed it; the trainer recomputes it for any trajectory whose reference has since been
reset (and, in --sync mode, for every trajectory, in one batched forward), so a stale reference log-prob
is never used.

Departures from the paper / official code:
  1. One trainer process (the official code supports several trainer GPUs with DeepSpeed).
  2. Searchers never block at a sync (see searcher.py and buffer.py).
  3. Gradient accumulation is over whole queries (`micro_batch_queries`), so each query's log_Z sees all
     K of its responses, exactly as in the full-batch loss.
  4. Checkpoints with resume, a searcher failure policy and a non-finite guard (the official code has none).

Run: python run_gsm8k.py (this module is the library the run_*.py scripts call).
"""

import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from buffer import ReplayBuffer
from checkpoint import CheckpointError, checkpoints_newest_first, load_checkpoint, respect_umask, save_checkpoint
from config import LAUNCHED, ConfigError, RunError, Stopped
from loss import OBJECTIVE_INPUTS, beta_schedule, make_batch, objective_loss, response_logprobs, tb_log_Z, wsd_schedule
from metrics import Meter, format_line, write_metrics
from rollout import SearcherDied, StopRequested, make_rollout
from searcher import Policy, dtype_of, load_model, score_logprobs


class NonFiniteError(RunError):
    pass


# -----------------------------------------------------------------------------
# The loop

def train(cfg, task, rollout=None):
    """Run TBA (or the --sync baseline) on `task`; returns the eval metrics before and after training."""
    rollout = rollout or make_rollout(cfg)  # an AsyncRollout starts its searcher processes right away
    try:
        run = setup(cfg, task, rollout)
        with StopOnSignal() as stop:
            rollout.stop = stop
            for step in tqdm(range(run.start, cfg.steps), desc="train", disable=None, initial=run.start, total=cfg.steps):
                if stop.requested:  # Ctrl-C, SIGTERM or SIGHUP: a checkpoint at this step boundary, then stop
                    raise StopRequested
                m, t_step = {"step": step}, time.time()
                run.rollout.check_alive()
                if step > run.start and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save(run, step)
                if step == run.start or (cfg.eval_every and step % cfg.eval_every == 0):  # (the first overlaps
                    m.update(evaluate(run, step))  # with the searchers' start-up and initial fill)
                t_merge = time.time()
                if step % run.rollout.period == 0 or step == run.start:  # merge
                    merge(run, step)
                if cfg.ref_reset_every and step > 0 and step % cfg.ref_reset_every == 0:  # TBA': reset the reference
                    reset_reference(run, step)
                t_train = time.time()
                groups = run.rollout.sample(run.buffer)  # sample
                m.update(train_step(run, groups, step))  # loss, step
                m.update({"time/merge": t_train - t_merge, "time/train": time.time() - t_train})
                log(run, m, groups, step, t_step)  # log
                if (step + 1) % run.rollout.period == 0:  # sync
                    publish(run, step + 1)
        save(run, cfg.steps)
    except SearcherDied:
        save(run, step)  # the failing step had not started: the state is consistent
        raise
    except StopRequested:  # at a step boundary, or while waiting for searchers: consistent too
        path = save(run, step)
        raise Stopped(stop.requested, f"checkpoint {path}; continue with --resume {cfg.run_dir}") from None
    finally:
        rollout.close()
    return finish(run)


# -----------------------------------------------------------------------------
# Setup and teardown

@dataclass
class Run:
    """Everything the loop's steps share."""
    cfg: object
    task: object
    policy: object
    ref: object
    tokenizer: object
    opt: object
    buffer: ReplayBuffer
    prompt_ids: list
    state: dict  # what a checkpoint keeps besides weights, optimiser and buffer
    start: int = 0
    rollout: object = None
    metrics_path: str = ""
    meter: object = None
    lr_at: object = None  # step -> learning-rate multiplier


def setup(cfg, task, rollout):
    """Models, optimiser, buffer and metrics file; the state of a resumed run; the searchers' job."""
    torch.set_num_threads(cfg.trainer_threads)
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_checked(cfg, "model")
    ref, _ = load_checked(cfg, "ref_model" if cfg.ref_model else "model")
    ref.requires_grad_(False)  # both stay in eval mode: no dropout, log-probs are a function of the weights
    task = drop_long_prompts(task, tokenizer, cfg.max_prompt_tokens)
    run = Run(cfg, task, policy, ref, tokenizer, torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay),
              ReplayBuffer(cfg.capacity_per_query, cfg.seed), tokenizer(task.prompts)["input_ids"],
              {"ref_version": 0, "searcher_version": 0, "fresh_reward": math.nan, "skipped": 0, "before": None})
    run.lr_at = wsd_schedule(run.opt, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.lr_floor, cfg.lr_decay)
    if cfg.resume:
        run.state = restore(run)
        run.start = run.state.pop("step")
    run.rollout = rollout
    rollout.start(cfg, task, policy, ref, tokenizer, run.start, run.state["ref_version"])
    if "rollout" in run.state:
        rollout.load_state_dict(run.state.pop("rollout"))
    run.metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    if not cfg.resume:
        open(run.metrics_path, "w").close()  # a resumed run appends to its metrics
    run.meter = Meter()
    return run


def load_checked(cfg, field):
    """load_model for --model / --ref-model, a load failure being one line naming the flag."""
    path = getattr(cfg, field)
    try:
        return load_model(path, cfg.device, dtype_of(cfg.dtype), cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--{field.replace('_', '-')} {path}: cannot load it ({str(e).splitlines()[0]})") from None


def restore(run):
    """Load the newest readable checkpoint of --resume; a broken newest one is named and the previous used."""
    for path in checkpoints_newest_first(run.cfg.resume):
        try:
            state = load_checkpoint(path, run.policy, run.ref, run.opt, run.buffer)
        except CheckpointError as e:
            print(f"warning: cannot resume from {e}; trying the checkpoint before it")
            continue
        if state["step"] > run.cfg.steps:
            raise ConfigError(f"--resume {run.cfg.resume}: {path} is at step {state['step']}, past --steps {run.cfg.steps}")
        print(f"resuming from {path} at step {state['step']}")
        return state
    raise ConfigError(f"--resume {run.cfg.resume}: no checkpoint there could be read")


def finish(run):
    """The final evaluation, the trained policy saved, before/after written to result.json and printed."""
    cfg, task = run.cfg, run.task
    record = evaluate(run, cfg.steps)
    write_metrics(run, {"step": cfg.steps, **record})
    after = {k: v for k, v in record.items() if k.startswith("eval/")}
    final_dir = os.path.join(cfg.run_dir, "final")
    run.policy.save_pretrained(final_dir)
    run.tokenizer.save_pretrained(final_dir)
    respect_umask(final_dir)
    print(f"saved the final policy to {final_dir}")
    before = run.state["before"]
    with open(os.path.join(cfg.run_dir, "result.json"), "w") as f:
        json.dump({"headline": task.headline, "before": before, "after": after}, f, indent=2)
    key = f"eval/{task.headline}"
    print(f"{task.headline}: before {100 * before[key]:.1f}% -> after {100 * after[key]:.1f}%")
    return before, after


def save(run, step):
    """A checkpoint of the state before trainer step `step` (never of non-finite weights)."""
    if not (weights_finite(run.policy) and weights_finite(run.ref)):
        raise NonFiniteError("non-finite weights: no checkpoint written")
    return save_checkpoint(run.cfg.run_dir, step, run.policy, run.ref, run.opt, run.buffer,
                           {**run.state, "rollout": run.rollout.state_dict(), "config": dataclasses.asdict(run.cfg)},
                           keep=run.cfg.keep_checkpoints)


def weights_finite(model):
    return all(torch.isfinite(p).all().item() for p in model.parameters())


def drop_long_prompts(task, tokenizer, max_tokens):
    """Skip prompts longer than max_tokens (counted and printed), before any searcher sees them."""
    if not max_tokens:
        return task
    keep = lambda prompts: [i for i, ids in enumerate(tokenizer(prompts)["input_ids"]) if len(ids) <= max_tokens]
    train_ids, eval_ids = keep(task.prompts), keep(task.eval_prompts)
    print(f"--max-prompt-tokens {max_tokens}: skipped {len(task.prompts) - len(train_ids)} of {len(task.prompts)} "
          f"training and {len(task.eval_prompts) - len(eval_ids)} of {len(task.eval_prompts)} held-out prompts")
    if not train_ids or not eval_ids:
        raise ConfigError(f"--max-prompt-tokens {max_tokens} leaves no training or no held-out prompts")
    return task.select(train_ids, eval_ids)


# -----------------------------------------------------------------------------
# The steps of the loop

def merge(run, step):
    """Drain the searchers' trajectories into the buffer; remember how the freshest ones did."""
    fresh = run.rollout.merge(run.buffer, step)
    run.state["fresh_count"] = len(fresh)
    if step == run.start:
        run.meter.restart()  # rates count from the first trained step on, after the initial fill
    else:
        run.meter.count(fresh)
    if step > run.start and not fresh:
        tqdm.write(f"sync at step {step}: no new trajectories from the searchers (training on the buffer's older ones)")
    if run.buffer.latest_round != run.state.get("round", 0):  # the merge formed a new latest round
        run.state["round"], run.state["round_step"] = run.buffer.latest_round, step
    if fresh:
        run.state["fresh_reward"] = float(np.mean([t.reward for t in fresh]))
        run.state["searcher_version"] = max(run.state["searcher_version"], max(t.policy_version for t in fresh))


def reset_reference(run, step):
    """TBA': pi_ref <- pi. Searchers get the new reference; stale ref log-probs are recomputed on use."""
    run.ref.load_state_dict(run.policy.state_dict())
    run.state["ref_version"] = step
    run.rollout.publish_ref(run.ref, step)


def train_step(run, groups, step):
    """One optimiser step on Q groups of K trajectories; returns the step's metrics (over the whole batch)."""
    cfg, policy = run.cfg, run.policy
    Q, K = len(groups), len(groups[0])
    T = cfg.loss_temperature or cfg.temperature
    beta = beta_schedule(step, cfg.beta_start, cfg.beta_end, cfg.beta_decay_steps, cfg.beta_stop_step)
    lr = cfg.lr * run.lr_at(step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    if "ref_logp" in OBJECTIVE_INPUTS[cfg.objective]:  # (GRPO has no KL term: its kl and log_Z are not logged)
        refresh_ref_logp(run, [t for g in groups for t in g], T)
    total, logps = 0.0, []
    for i in range(0, Q, cfg.micro_batch_queries):
        chunk = [t for g in groups[i:i + cfg.micro_batch_queries] for t in g]
        q = len(chunk) // K
        batch = make_batch([run.prompt_ids[t.query_id] for t in chunk], [t.response_ids for t in chunk], run.tokenizer.pad_token_id)
        token_logp = response_logprobs(policy, *(b.to(cfg.device) for b in batch), T)  # (q K, R) with grad
        x = loss_inputs(chunk, token_logp, q, K, cfg.device, on_policy=cfg.sync)
        loss = objective_loss(cfg.objective, x, beta, cfg.max_new_tokens)
        (loss * q / Q).backward()
        total += loss.item() * q / Q
        logps.append(x["logp"].detach().cpu())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip or math.inf).item()  # (0: measure only)
    finite = math.isfinite(total) and math.isfinite(grad_norm)
    if finite:
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    logp = torch.cat(logps)  # (Q, K)
    ref_logp, reward = (torch.tensor([[getattr(t, a) for t in g] for g in groups]) for a in ("ref_logp", "reward"))  # (Q, K)
    log_Z = tb_log_Z(logp, ref_logp, reward, beta)  # (Q,)
    return {"loss/train": total, "loss/log_Z": log_Z.mean().item(), "loss/log_Z_std": log_Z.std().item() if Q > 1 else 0.0,
            "loss/kl": (logp - ref_logp).mean().item(), "grad/norm": grad_norm, "grad/skipped": int(not finite),
            "reward/batch": reward.mean().item(), "sched/beta": beta, "sched/lr": lr,
            "response/tokens": float(np.mean([len(t.response_ids) for g in groups for t in g]))}


def loss_inputs(chunk, token_logp, q, K, device, on_policy):
    """The objective's inputs for q groups of K trajectories (loss.objective_loss): (q, K) and (q, K, R)."""
    R = token_logp.shape[1]
    grid = lambda values: torch.tensor(values, dtype=torch.float32, device=device).view(q, K)  # (q, K)
    padded = lambda rows: torch.tensor([list(r) + [0.0] * (R - len(r)) for r in rows], device=device).view(q, K, R)
    x = {"token_logp": token_logp.view(q, K, R), "logp": token_logp.sum(dim=1).view(q, K),
         "mask": padded([[1.0] * len(t.response_ids) for t in chunk]),
         "ref_logp": grid([t.ref_logp for t in chunk]), "reward": grid([t.reward for t in chunk])}
    if on_policy:  # --sync: the policy that sampled the batch is the current one, so the ratios are 1
        x["behavior_logp"], x["behavior_token_logp"] = x["logp"].detach(), x["token_logp"].detach()
    else:
        x["behavior_logp"] = grid([t.behavior_logp for t in chunk])
        x["behavior_token_logp"] = padded([t.behavior_token_logp for t in chunk])
    return x


def refresh_ref_logp(run, trajectories, temperature):
    """Compute log pi_ref for trajectories scored by another reference (or by none); cache it on them."""
    stale = [t for t in trajectories if t.ref_version != run.state["ref_version"]]
    if stale:
        values = score_logprobs(run.ref, [run.prompt_ids[t.query_id] for t in stale], [t.response_ids for t in stale],
                                run.tokenizer.pad_token_id, temperature, run.cfg.micro_batch)
        for t, v in zip(stale, values):
            t.ref_logp, t.ref_version = v, run.state["ref_version"]


def log(run, m, groups, step, t_step):
    """Complete the step's record, guard against non-finite steps, write it, and print every log_every steps."""
    state = run.state
    state["skipped"] += m["grad/skipped"]
    state["nonfinite_run"] = state.get("nonfinite_run", 0) + 1 if m["grad/skipped"] else 0
    if state["nonfinite_run"] >= run.cfg.max_nonfinite_steps:
        raise NonFiniteError(f"{state['nonfinite_run']} steps in a row had a non-finite loss or gradient (step {step}); "
                             f"stopping (--max-nonfinite-steps {run.cfg.max_nonfinite_steps})")
    run.meter.busy += m["time/train"]
    m.update({"reward/fresh": state["fresh_reward"], "buffer/fresh": state["fresh_count"],
              "buffer/round_age": step - state["round_step"], "grad/skipped_total": state["skipped"],
              "buffer/size": len(run.buffer), "buffer/queries": run.buffer.num_queries,
              "buffer/latest": sum(len(v) for v in run.buffer.latest.values()), "ref/version": state["ref_version"],
              "searcher/version": state["searcher_version"], "searcher/restarts": run.rollout.restarts,
              **staleness_stats(groups, step, run.buffer), **run.meter.rates(started=step > run.start),
              "time/step": time.time() - t_step, **run.meter.times()})
    write_metrics(run, m)
    if step % run.cfg.log_every == 0 or step == run.cfg.steps - 1:
        tqdm.write(format_line(m))


def publish(run, version):
    if not weights_finite(run.policy):
        raise NonFiniteError(f"non-finite weights after step {version - 1}: not publishing them")
    run.rollout.publish(run.policy, version)


def evaluate(run, step):
    """The task's evaluation of the current policy, printed, as eval/<name> metrics (not counted as run time)."""
    cfg, t0 = run.cfg, time.time()
    n = cfg.eval_size or len(run.task.eval_prompts)
    metrics = run.task.evaluate(Policy(cfg, run.policy, run.ref, run.tokenizer), n)
    example = metrics.pop("example", None)
    seconds = time.time() - t0
    run.meter.eval += seconds
    shown = " | ".join(f"{k} {100 * v:.1f}%" if k == run.task.headline else f"{k} {v:.4g}" for k, v in metrics.items())
    tqdm.write(f"eval step {step} | {shown} | {n} held-out prompts | {seconds:.1f}s"
               + (f" | e.g. {example.strip()[:100]!r}" if example is not None else ""))
    metrics = {f"eval/{k}": v for k, v in metrics.items()}
    run.state["before"] = run.state["before"] or metrics  # the run's first evaluation, kept across resumes
    return {**metrics, "time/eval_since_launch": time.time() - LAUNCHED - run.meter.eval}  # (evaluation excluded)


def staleness_stats(groups, step, buffer):
    """Distribution of (step - policy_version) over the batch, and its max over latest-round items."""
    s = ReplayBuffer.staleness(groups, step)
    in_round = {id(t) for items in buffer.latest.values() for t in items}
    latest = [step - t.policy_version for g in groups for t in g if id(t) in in_round]
    return {"buffer/latest_frac": sum(id(g[0]) in in_round for g in groups) / len(groups),  # the realised m
            "staleness/mean": float(s.mean()), "staleness/p50": float(np.percentile(s, 50)),
            "staleness/p90": float(np.percentile(s, 90)), "staleness/max": int(s.max()),
            "staleness/latest_max": max(latest, default=-1), "staleness/hist": np.bincount(s).tolist()}


# -----------------------------------------------------------------------------
# Signals

class StopOnSignal:
    """Ctrl-C, SIGTERM or SIGHUP during training ask for a clean stop (with a checkpoint) at the next step
    boundary; `requested` holds the signal's number. A second signal stops at once, without a checkpoint."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.requested = 0
        self.previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise Stopped(signum, "a second signal: no checkpoint of the current step")
        self.requested = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
