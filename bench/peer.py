"""
This project against the peer users pick, TRL's GRPOTrainer, on the tiny GSM8K preset (`python -m bench
--sections trl`; the protocol is bench/protocol.py).

    python bench/peer.py --seed 0 --run-dir D [any run_gsm8k.py flag]

trains the tiny preset's SFT warm start (the same cached model as run_gsm8k.py's) with trl.GRPOTrainer on the
same training prompts and reward (the task's own scorer), evaluates it with the task's own `evaluate` on the
same held-out problems every --eval-every steps (evaluation time excluded from every clock, as in this
project's runs), and writes metrics.jsonl and result.json under the names the bench reads. TRL is an optional
bench dependency: pip install -r requirements-bench.txt.

Matched, read from the resolved GSM8K config (`trl_args`; tests/test_bench.py checks each against the trainer
TRL builds): group size K (num_generations), prompts per step (Q x K completions per step, one generation per
step), steps, AdamW's learning rate and weight decay, the warmup-stable-decay schedule, gradient clipping (0:
none), sampling temperature, max new tokens, beta (TRL's KL coefficient; TB's beta is the same coefficient of
KL in r - beta KL), gradient checkpointing, dtype, seed, and the 2 CPU threads (one process for both
generation and training, where this project gives one thread to its trainer and one to its searcher).
Not matched (TRL's own, listed next to the table): its GRPO loss (`loss_type` "dapo", token-level; rewards
scaled by the group's std; ratio clip 0.2, inactive at one update per generation), its KL estimator (k3, per
token, with a reference model forward each step), AdamW as `adamw_torch_fused`, and its scheduler stepped after
each update, so its learning rates lag this project's (the official code's) by one step.
"""

import json
import os
import sys
import time

if __name__ == "__main__":  # run as a file: the project root, not bench/, is where its modules are
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trl_args(cfg, output_dir):
    """trl.GRPOConfig's arguments for every hyperparameter the two systems share, read from this project's resolved
    config; TRL's own defaults for the rest."""
    return dict(
        output_dir=output_dir, seed=cfg.seed, use_cpu=cfg.device == "cpu", bf16=cfg.trainer_dtype == "bfloat16",
        num_generations=cfg.responses_per_prompt,  # K responses per prompt
        per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=1,  # Q x K completions per update
        steps_per_generation=1, num_iterations=1,  # a fresh generation for every update: on-policy, as TRL's default
        max_steps=cfg.steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        lr_scheduler_type="warmup_stable_decay", warmup_steps=cfg.warmup_steps,
        lr_scheduler_kwargs=dict(num_stable_steps=cfg.stable_steps, num_decay_steps=cfg.decay_steps,
                                 min_lr_ratio=cfg.lr_floor, decay_type=cfg.lr_decay),
        max_grad_norm=cfg.grad_clip,  # (the Trainer clips only above 0)
        temperature=cfg.temperature, max_completion_length=cfg.max_new_tokens, beta=cfg.beta_start,
        gradient_checkpointing=cfg.gradient_checkpointing,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)


def make_trainer(cfg, task, clock):
    """A GRPOTrainer on the task's training prompts and scorer, starting from cfg.model (the warm start); `clock`:
    the callback that times and evaluates (None: neither)."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from ops.models import dtype_of, load_model
    score = task.make_scorer()

    def reward(prompts, completions, meta, **_):  # the task's own scorer, on the texts TRL decoded
        return score(prompts, completions, meta)
    reward.__name__ = task.name

    data = Dataset.from_list([{"prompt": p, "meta": m} for p, m in zip(task.prompts, task.metas)])
    model, tokenizer = load_model(cfg.model, dtype=dtype_of(cfg.trainer_dtype))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**trl_args(cfg, cfg.run_dir)),
                          train_dataset=data, processing_class=tokenizer, callbacks=[clock] if clock else None)
    trainer.remove_callback(PrinterCallback)  # (a dict printed per step; metrics.jsonl has the numbers)
    return trainer


def make_clock(cfg, task):
    """A TrainerCallback that times every step and evaluates like this project's runs, writing metrics.jsonl."""
    from transformers import TrainerCallback

    from config import LAUNCHED
    from ops.evaluation import EvalPolicy
    from ops.metrics import write_metrics

    class Clock(TrainerCallback):
        def __init__(self):
            self.path, self.eval_seconds, self.evals = os.path.join(cfg.run_dir, "metrics.jsonl"), 0.0, []
            open(self.path, "w").close()

        def since_launch(self):
            return time.time() - LAUNCHED - self.eval_seconds

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **_):
            self.tokenizer = processing_class
            self.evaluate(model, 0)

        def on_step_begin(self, args, state, control, **_):
            self.t_step = time.time()

        def on_step_end(self, args, state, control, model=None, **_):
            self.record = {"step": state.global_step - 1, "time/train": time.time() - self.t_step,
                           "time/since_launch": self.since_launch()}

        def on_log(self, args, state, control, logs=None, model=None, **_):
            if "loss" not in (logs or {}):  # (the closing summary of train())
                return
            write_metrics(self.path, {**self.record, "loss/train": logs["loss"], "reward/batch": logs.get("reward"),
                                      "loss/kl": logs.get("kl"), "grad/norm": logs.get("grad_norm")})
            step = state.global_step
            if step == state.max_steps or step % cfg.eval_every == 0:
                self.evaluate(model, step)

        def evaluate(self, model, step):
            t0 = time.time()
            model.eval()
            metrics = task.evaluate(EvalPolicy(cfg, model, None, self.tokenizer), cfg.eval_size or len(task.eval_prompts))
            model.train()
            self.eval_seconds += time.time() - t0
            value = metrics[task.headline]
            self.evals.append(value)
            print(f"eval step {step} | {task.headline} {100 * value:.1f}% | {time.time() - t0:.1f}s", flush=True)
            write_metrics(self.path, {"step": step, f"eval/{task.headline}": value,
                                      "time/eval_since_launch": self.since_launch()})

    return Clock()


def main(argv=None):
    """Parse run_gsm8k.py's flags (the tiny preset), build the task and its warm start, train with TRL."""
    from config import parse_config
    from run_gsm8k import PRESETS, GSM8KConfig, make_task
    cfg = parse_config(GSM8KConfig, PRESETS, sys.argv[1:] if argv is None else argv)
    import torch
    torch.set_num_threads(cfg.trainer_threads + cfg.searcher_threads)  # the cores this project's run uses
    os.makedirs(cfg.run_dir, exist_ok=True)
    task = make_task(cfg)
    clock = make_clock(cfg, task)
    make_trainer(cfg, task, clock).train()
    with open(os.path.join(cfg.run_dir, "result.json"), "w") as f:
        json.dump({"headline": task.headline, "before": clock.evals[0], "after": clock.evals[-1]}, f)
    print(f"{task.headline}: before {100 * clock.evals[0]:.1f}% -> after {100 * clock.evals[-1]:.1f}%")


if __name__ == "__main__":
    main()
