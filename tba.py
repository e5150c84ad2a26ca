"""
TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025, arXiv 2503.18929): the TRAINER.

A task script starts the searcher processes (searcher.py) and hands them to `train(cfg, task, searchers)`, which
loops over trainer steps (Algorithm 1):
    merge   every k = sync_every steps, what the searchers sent becomes the buffer's latest round (buffer.py);
            a sync never trains on an old round again: the trainer waits for the searchers instead
    reset   TBA': every rho = `ref_reset_every` steps the reference becomes the current policy
    sample  Q = batch_size / K prompts x K responses from the buffer (most-on-policy with probability m)
    loss    sequence log-probs log pi(y|x) under the policy (with grad) -> the VarGrad trajectory-balance
            loss (loss.py, Eq. 4-5), or the comparison objective --objective chose (baselines.py)
    step    AdamW on the loss; warmup-stable-decay learning rate; linear beta schedule
    log     one line, and one JSON record per step in metrics.jsonl, with how off-policy the batch was
            (the drift |log pi - log mu| from the sampling policy mu, for every objective; loss.py)
    sync    every k steps, publish the weights to the searchers
What a run does besides TBA (stop signals, dead searchers, checkpoints and resume, evaluation, the non-finite
guard, metrics files) is one named call per step into ops/bookkeeping.py, so the loop reads as the paper's.

The reference. Searchers attach log pi_ref(y|x) to every trajectory together with the version of the
reference that computed it; the trainer recomputes it for any trajectory whose reference has since been
reset (and, in --sync mode, for every trajectory, in one batched forward), so a stale reference log-prob
is never used.

Departures from the paper / official code, and from the design this code was asked for:
  1. One trainer process (the official code supports several trainer GPUs with DeepSpeed), and it is the
     process the task script runs in, not a spawned one: only the searchers are spawned (searcher.py).
  2. Searchers never block at a sync; the trainer waits for them only when nothing new enough arrived (merge).
  3. Gradient accumulation is over whole prompts (`micro_batch_prompts`), so each prompt's log_Z sees all
     K of its responses, exactly as in the full-batch loss.
  4. Checkpoints with resume, a searcher failure policy and a non-finite guard (the official code has none).
  5. The replay buffer is not itself a shared queue: each searcher sends its batches on a queue of its own,
     and the trainer drains them (`merge`) into a buffer only it holds (buffer.py), so sampling never
     crosses a process boundary and the buffer stays a plain data structure.

Run: python run_gsm8k.py (a task script: spawn the searchers, build the task, `train`), or python tba.py --model M
--dataset D --reward FILE.py:NAME (your own model, data and reward: tasks/dataset.py).
"""

import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from baselines import baseline_loss
from buffer import ReplayBuffer
from config import Config
from loss import beta_schedule, make_batch, response_logprobs, tb_trust_region_loss, vargrad_tb_loss, wsd_schedule
from ops.bookkeeping import Bookkeeping, step_metrics
from ops.lora import for_searchers
from ops.models import PromptTokens, load_for_training, policy_logprobs_fast, score_logprobs
from rewards import Task
from searcher import SearcherHandle


# -----------------------------------------------------------------------------
# The loop

def train(cfg, task, searchers):
    """Run TBA (or a baseline) on `task`, generating with `searchers`; returns the eval metrics before and after."""
    run = setup(cfg, task, searchers)
    with run.books as books:  # stop signals, dead searchers, checkpoints, evaluation, metrics (ops/)
        for step in tqdm(range(run.start, cfg.steps), desc="train", disable=None, initial=run.start, total=cfg.steps):
            record = books.begin_step(step)  # stop if asked; searchers alive?; checkpoint, evaluation when due
            if step == run.start or step % cfg.sync_every == 0:  # merge: what arrived becomes the latest round
                merge(run, step)
            if cfg.ref_reset_every and step > 0 and step % cfg.ref_reset_every == 0:  # reset (TBA'): pi_ref <- pi
                reset_reference(run, step)
            groups = run.buffer.sample(cfg.prompts_per_step, cfg.responses_per_prompt, cfg.m, cfg.prioritization,
                                       cfg.reward_temp)  # sample: Q groups of K trajectories
            record.update(train_step(run, groups, step))  # loss, step
            books.log(record, groups, step)  # log
            if (step + 1) % cfg.sync_every == 0:  # sync: the searchers generate with the new weights
                publish(run, step + 1)
        books.save(cfg.steps)
    return books.finish()


@dataclass
class Run:
    """What the loop's steps share."""
    cfg: Config
    task: Task
    policy: torch.nn.Module  # pi, trained
    ref: torch.nn.Module  # pi_ref, frozen between TBA' resets
    tokenizer: object
    opt: torch.optim.Optimizer
    buffer: ReplayBuffer
    searchers: SearcherHandle  # searcher.Searchers (or a variant: --sync, torchrun)
    prompt_tokens: dict  # token ids of the task's training prompts, by prompt id (encoded on first use)
    start: int = 0  # the first step: 0, or the step of the checkpoint a run resumes from
    ref_version: int = 0  # the step whose policy the reference is (0: the initial model)
    books: Bookkeeping = None  # everything besides TBA: ops/bookkeeping.py


def setup(cfg, task, searchers):
    """Models, optimiser, buffer and bookkeeping; the state of a resumed run; the searchers' job."""
    policy, ref, tokenizer, task = load_for_training(cfg, task)  # seeded; eval mode (no dropout); long prompts skipped
    trained = [p for p in policy.parameters() if p.requires_grad]  # (with --lora-rank: the adapters)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    run = Run(cfg, task, policy, ref, tokenizer, opt, ReplayBuffer(cfg.capacity_per_prompt, cfg.seed, cfg.dedup),
              searchers, PromptTokens(tokenizer, task.prompts))
    run.books = Bookkeeping(run)  # (saves the resolved config as run_dir/config.json)
    run.start, run.ref_version = run.books.restore() if cfg.resume else (0, 0)  # (and the searchers' restart count)
    searchers.start(cfg, task, for_searchers(cfg, policy), ref, tokenizer, run.start, run.ref_version)
    return run


# -----------------------------------------------------------------------------
# The steps of the loop

def merge(run, step):
    """Algorithm 1's merge: what the searchers sent since the last sync becomes the buffer's latest round.
    Trajectories from weights older than the previous sync are stored but kept out of the round (the official
    barrier's rule: most-on-policy draws are then at most 2k - 1 steps stale), and when nothing that new has
    arrived the trainer waits for the searchers rather than train on the old round again (--no-fresh-rounds:
    never wait). The first merge also waits for --initial-completions trajectories."""
    min_version = max(step - run.cfg.sync_every, 0)  # the weights published at the previous sync, or newer
    need = run.cfg.initial_completions if step == run.start else 0
    items, reports = run.searchers.poll()  # every trajectory the searchers sent since the last merge, their reports
    while len(items) < need or (run.cfg.fresh_rounds and not any(t.policy_version >= min_version for t in items)):
        run.books.wait_for_searchers(len(items), need, reports)  # (a stop signal or a dead searcher ends the wait)
        more, more_reports = run.searchers.poll()
        items, reports = items + more, reports + more_reports
    run.buffer.add(items, round_min_version=min_version)
    run.books.merged(items, reports, step, min_version)


def reset_reference(run, step):
    """TBA': pi_ref <- pi. Searchers get the new reference; stale ref log-probs are recomputed on use."""
    run.ref.load_state_dict(run.policy.state_dict())
    run.ref_version = step
    run.searchers.publish("ref", run.ref, step)


def train_step(run, groups, step):
    """One optimiser step on Q groups of K trajectories: log pi -> loss -> backward -> step. Returns the step's
    metrics, over the whole batch."""
    cfg, Q = run.cfg, len(groups)
    beta = beta_schedule(step, cfg.beta_start, cfg.beta_end, cfg.beta_decay_steps, cfg.beta_stop_step)
    lr = cfg.lr * wsd_schedule(step, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.lr_floor, cfg.lr_decay)
    for group in run.opt.param_groups:
        group["lr"] = lr
    if "ref_logp" in cfg.needs:  # (GRPO has no KL term)
        refresh_ref_logp(run, [t for g in groups for t in g])
    loss_sum, clip_sum, logps = 0.0, 0.0, []
    for i in range(0, Q, cfg.micro_batch_prompts):  # accumulate over whole prompts: log Z sees all K responses
        chunk = groups[i:i + cfg.micro_batch_prompts]
        token_logp = policy_logprobs(run, chunk)  # (n K, R) log pi per response token, with grad (n prompts)
        logp = token_logp.sum(dim=1).view(len(chunk), -1)  # (n, K) log pi(y|x)
        if cfg.objective == "tb":  # the VarGrad TB loss, Eq. 4-5, or with the trust region of the tiny presets (loss.py)
            ref_logp, reward, mu = (per_response(chunk, name, logp.device) for name in ("ref_logp", "reward", "behavior_logp"))
            loss, clip = (tb_trust_region_loss(logp, ref_logp, reward, beta, mu, cfg.clip_eps) if cfg.tb_correction == "trust-region"
                          else (vargrad_tb_loss(logp, ref_logp, reward, beta), math.nan))
        else:  # a comparison objective, --objective (baselines.py)
            loss, clip = baseline_loss(cfg, chunk, token_logp, beta)
        (loss * len(chunk) / Q).backward()
        loss_sum, clip_sum = loss_sum + loss.item() * len(chunk) / Q, clip_sum + clip * len(chunk) / Q
        logps.append(logp.detach().cpu())
    grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), cfg.grad_clip or math.inf).item()  # (0: measure)
    finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if finite:  # a non-finite step is skipped, and counted (ops/bookkeeping.py stops the run after a few)
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return step_metrics(cfg, groups, torch.cat(logps), beta, lr, loss_sum, grad_norm, finite, clip_sum)


def policy_logprobs(run, groups):
    """log pi of every response token of the groups' trajectories, with grad: (N, R), 0 at padding (loss.py). With
    --share-prompt, --gradient-checkpointing or bf16-mixed, ops/models.py computes the same numbers its way."""
    flat, cfg, pad = [t for g in groups for t in g], run.cfg, run.tokenizer.pad_token_id
    prompts, responses = [run.prompt_tokens[t.prompt_id] for t in flat], [t.response_ids for t in flat]
    if cfg.share_prompt or cfg.gradient_checkpointing or cfg.trainer_dtype == "bf16-mixed":
        return policy_logprobs_fast(cfg, run.policy, prompts, responses, pad, len(groups[0]))
    batch = make_batch(prompts, responses, pad)  # (N, T) each
    return response_logprobs(run.policy, *(b.to(cfg.device) for b in batch), cfg.score_temperature)


def per_response(groups, name, device="cpu"):
    """One number per trajectory (its reward, its ref_logp, ...) as a (Q, K) float tensor."""
    return torch.tensor([[getattr(t, name) for t in g] for g in groups], dtype=torch.float32, device=device)


def refresh_ref_logp(run, trajectories):
    """Compute log pi_ref for trajectories scored by another reference (or by none); cache it on them."""
    stale = [t for t in trajectories if t.ref_version != run.ref_version]  # (usually none: nothing to compute)
    values = score_logprobs(run.ref, [run.prompt_tokens[t.prompt_id] for t in stale], [t.response_ids for t in stale],
                            run.tokenizer.pad_token_id, run.cfg.score_temperature, run.cfg.micro_batch,
                            share_prompt=run.cfg.share_prompt)  # (no grad, micro-batched: ops/models.py)
    for t, v in zip(stale, values):
        t.ref_logp, t.ref_version = v, run.ref_version


def publish(run, version):
    """Sync: the trainer's weights become the searchers' policy (never non-finite ones)."""
    run.books.require_finite(run.policy, f"non-finite weights after step {version - 1}: not publishing them")
    run.books.publish_s = run.searchers.publish("policy", for_searchers(run.cfg, run.policy), version)  # (LoRA: ops/lora.py)


if __name__ == "__main__":  # your own model, data and reward (tasks/dataset.py): python tba.py --help
    from ops.launch import cli
    from searcher import spawn_searchers
    from tasks.dataset import PRESETS, DatasetConfig, make_task

    def main(cfg):
        with spawn_searchers(cfg) as searchers:  # searcher.py: stopped when the block ends, on every path
            return train(cfg, make_task(cfg), searchers)
    sys.exit(cli(DatasetConfig, PRESETS, main, description="TBA on your own model, data and reward: python tba.py "
                                                            "--model M --dataset D --reward FILE.py:NAME"))
