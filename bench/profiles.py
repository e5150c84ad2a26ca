"""
Where a tiny GSM8K run's time goes (issue: speed against the peer), as two tables for docs/operations.md:

  step      one trainer step of the tiny preset, taken apart: batching (padding the token ids into tensors), the
            forward (log pi of every response token), the loss, the backward, the gradient norm, the optimiser
            step, the step's metrics; median milliseconds over --repeats steps on one fixed batch of Q prompts x
            K responses sampled by the warm start, on --trainer-threads threads, with the trainer's own functions
            (loss.py), once with every (prompt, response) row run whole and once with --share-prompt.
  searcher  one searcher batch (prompts_per_search prompts x samples_per_prompt responses): generation (with
            the behaviour log-probs), scoring, the reference forward (with and without --share-prompt),
            against the trainer's step on as many responses.
The start-up of a whole run is read from its metrics.jsonl by `python -m bench --sections trl` (start-up
column).

Run: python -m bench.profiles [--repeats 30] [any run_gsm8k.py flag, e.g. --objective grpo]
"""

import statistics
import sys
import time

import torch

from buffer import Trajectory
from config import parse_config
from ops.devices import resolve_devices
from loss import make_batch, offpolicy_metrics, response_logprobs, tb_log_Z, vargrad_tb_loss
from ops.models import encode_prompts, load_trainer_models, score_logprobs, shared_prompt_logprobs
from searcher import HFGenerator
from run_gsm8k import PRESETS, GSM8KConfig, make_task


def timed(fn, times, name):
    t0 = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
    return out


def fixed_batch(cfg, task, policy, ref, tokenizer, times):
    """Q groups of K trajectories sampled by the warm start, as a searcher sends them (`times`: the searcher's)."""
    Q, K = cfg.prompts_per_step, cfg.responses_per_prompt
    generator, score = HFGenerator(policy, tokenizer, cfg.max_new_tokens), task.make_scorer()
    prompt_tokens = encode_prompts(tokenizer, task.prompts[:Q])
    responses, behavior = timed(lambda: generator.sample(prompt_tokens, K, cfg.temperature, cfg.score_temperature), times,
                                "generate (with behaviour log-probs)")
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    rewards = timed(lambda: score([task.prompts[q] for q in range(Q) for _ in range(K)], texts,
                                  [task.metas[q] for q in range(Q) for _ in range(K)]), times, "score")
    rows = [p for p in prompt_tokens for _ in range(K)]
    for share in (False, True):
        ref_logp = timed(lambda: score_logprobs(ref, rows, responses, tokenizer.pad_token_id, cfg.score_temperature,
                                                cfg.micro_batch, share_prompt=share), times,
                         f"reference forward, {'--share-prompt' if share else '--no-share-prompt'}")
    flat = [Trajectory(i // K, tuple(r), rw, 0, sum(b), (), lr, 0)
            for i, (r, rw, b, lr) in enumerate(zip(responses, rewards, behavior, ref_logp))]
    return [flat[q * K:(q + 1) * K] for q in range(Q)], prompt_tokens


def step_parts(cfg, policy, opt, groups, prompt_tokens, pad_id, times):
    """One TB step, each part timed (the parts tba.train_step is made of, at micro_batch_prompts = Q)."""
    flat = [t for g in groups for t in g]
    Q, K = len(groups), len(groups[0])
    per = lambda name: torch.tensor([[getattr(t, name) for t in g] for g in groups], device=cfg.device)
    if cfg.share_prompt:  # (tba.policy_logprobs: each prompt run once for its K responses)
        token_logp = timed(lambda: shared_prompt_logprobs(policy, [prompt_tokens[g[0].prompt_id] for g in groups],
                                                          [t.response_ids for t in flat], pad_id, cfg.score_temperature),
                           times, "forward (batching included)")
    else:
        batch = timed(lambda: make_batch([prompt_tokens[t.prompt_id] for t in flat], [t.response_ids for t in flat], pad_id),
                      times, "batching")
        token_logp = timed(lambda: response_logprobs(policy, *batch, cfg.score_temperature), times, "forward")
    logp = token_logp.sum(dim=1).view(Q, K)
    loss = timed(lambda: vargrad_tb_loss(logp, per("ref_logp"), per("reward"), cfg.beta_start), times, "loss")
    timed(loss.backward, times, "backward")
    timed(lambda: torch.nn.utils.clip_grad_norm_(policy.parameters(), float("inf")), times, "gradient norm")
    timed(opt.step, times, "optimiser step")
    timed(lambda: opt.zero_grad(set_to_none=True), times, "zero grad")
    timed(lambda: (tb_log_Z(logp.detach(), per("ref_logp"), per("reward"), cfg.beta_start),
                   offpolicy_metrics(logp.detach(), per("behavior_logp"), cfg.clip_eps)), times, "metrics")


def table(times, total=None):
    rows = [(name, statistics.median(ms)) for name, ms in times.items()]
    total = total or sum(ms for _, ms in rows)
    lines = ["| part | ms (median) | share |", "|---|---|---|"]
    return "\n".join(lines + [f"| {name} | {ms:.1f} | {100 * ms / total:.0f}% |" for name, ms in rows])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 30
    argv = [a for i, a in enumerate(argv) if a != "--repeats" and (i == 0 or argv[i - 1] != "--repeats")]
    cfg = resolve_devices(parse_config(GSM8KConfig, PRESETS, argv), torch.cuda.device_count())  # ("auto" fields)
    torch.set_num_threads(cfg.trainer_threads)
    task = make_task(cfg)
    policy, ref, tokenizer = load_trainer_models(cfg)
    torch.set_num_threads(cfg.searcher_threads)
    searcher_times = {}
    for _ in range(max(3, repeats // 5) + 1):  # (the first batch warms up)
        groups, prompt_tokens = fixed_batch(cfg, task, policy, ref, tokenizer, searcher_times)
    searcher_times = {name: ms[1:] for name, ms in searcher_times.items()}
    torch.set_num_threads(cfg.trainer_threads)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.0)  # lr 0: the batch stays put
    n = sum(len(t.response_ids) for g in groups for t in g)
    for share in (False, True):  # before and after --share-prompt
        cfg.share_prompt, times = share, {}
        for _ in range(repeats + 3):
            step_parts(cfg, policy, opt, groups, prompt_tokens, tokenizer.pad_token_id, times)
        times = {name: ms[3:] for name, ms in times.items()}  # the first 3 steps warm up
        print(f"## One trainer step, tiny GSM8K, {'--share-prompt' if share else '--no-share-prompt'} ({cfg.prompts_per_step} x "
              f"{cfg.responses_per_prompt} responses, {n} response tokens, {cfg.trainer_threads} thread(s), {repeats} "
              f"steps)\n\n{table(times)}\n")
    search_ms = sum(statistics.median(ms) for name, ms in searcher_times.items() if "--no-share" not in name)
    print(f"## One searcher batch of Q x K responses ({cfg.searcher_threads} thread(s), "
          f"{len(next(iter(searcher_times.values())))} batches; the share: of a batch with --share-prompt)\n\n"
          f"{table(searcher_times, search_ms)}\n\n"
          f"trainer step {sum(statistics.median(ms) for ms in times.values()):.0f} ms against searcher batch "
          f"{search_ms:.0f} ms for as many responses (both --share-prompt)")


if __name__ == "__main__":
    main()
