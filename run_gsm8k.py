"""
GSM8K with TBA: `python run_gsm8k.py` (tiny offline preset on a CPU) or `--preset paper` (GPUs).

Presets (pick with --preset; every field can still be overridden by its own flag):
  tiny   the default without CUDA. Builds a word-level tokenizer and a ~0.5M-parameter Llama, SFTs it on a
         synthetic GSM8K-format task (tiny.py; cached after the first run), then runs TBA with 1 searcher
         and 1 trainer process on 2 CPU cores.
  paper  the default with CUDA: the paper's GSM8K run (Table 2, Appendix B.1) with RhoMath-1B SFT; needs
         GPUs and either internet or --data-dir. `--preset paper --dry-run` prints what it would run where.

Output in --run-dir: config.json (the resolved config), metrics.jsonl (one record per step), final/ (the
trained policy and tokenizer, save_pretrained format). The last line printed is
    accuracy: before X% -> after Y%
for greedy pass@1 on the held-out problems.

Run:  python run_gsm8k.py                  # tiny preset, a few minutes on 2 CPU cores
      python run_gsm8k.py --steps 50       # any field of the config is a flag; --help lists them
"""

import dataclasses
import os
import sys
from dataclasses import dataclass

from tba import (Config, ConfigError, NonFiniteError, SearcherDied, device_plan, knob, parse_config, print_config,
                 resolve_devices, save_config, train, validate)

TINY = dict(
    run_dir="runs/gsm8k-tiny", steps=300, model="", dtype="float32", device="cpu", searcher_device="cpu", backend="hf",
    trainer_threads=1, searcher_threads=1, num_searchers=1,  # 2 cores: one trainer, one searcher
    prompts_per_search=8, samples_per_prompt=8, temperature=0.7, max_new_tokens=40,
    batch_size=64, responses_per_query=8, micro_batch_queries=8, micro_batch=64,  # 8 queries x K = 8
    # measured here: sampling at temperature 1.0 with lr 5e-5..3e-4 and beta 0.05..0.2 first lifted held-out
    # accuracy to ~60% and then lost it (too many wrong worked solutions); temperature 0.7 with lr 2e-5 kept it
    lr=2e-5, warmup_steps=20, stable_steps=180, decay_steps=100, lr_floor=0.1,
    beta_start=0.1, beta_end=0.1, beta_decay_steps=0,  # constant beta
    sync_every=4, initial_completions=256, m=0.95, capacity_per_query=64,
    eval_every=50, eval_size=0, eval_batch_size=100, log_every=10, checkpoint_every=100,
)

PAPER = dict(
    run_dir="runs/gsm8k-paper",
    model="realtreetune/rho-1b-sft-GSM8K",  # RhoMath-1B SFT on GSM8K (paper Sec. 5.1)
    steps=700,  # Appendix B.1: the 700-step run
    dtype="auto", device="auto", searcher_device="auto", num_searchers=3,  # 3 searchers + 1 trainer, a GPU each
    trainer_threads=4, searcher_threads=4,
    backend="auto",  # vLLM when installed, as the official code uses
    prompts_per_search=7, samples_per_prompt=24,  # S = 24 samples per prompt
    temperature=0.7, max_new_tokens=512, max_prompt_tokens=512,  # Table 2: prompt and response up to 512 tokens
    batch_size=140, responses_per_query=20, micro_batch_queries=1,  # 7 prompts x K = 20
    lr=1e-5, warmup_steps=50, stable_steps=350, decay_steps=600,  # WSD, official launch script
    beta_start=0.014, beta_end=0.004, beta_decay_steps=500,  # Table 2
    sync_every=2, m=0.95, initial_completions=500,  # Table 2
    eval_every=0, eval_size=0, eval_batch_size=64, log_every=1, checkpoint_every=50,
)


@dataclass
class GSM8KConfig(Config):
    data_dir: str = knob("", "directory with GSM8K train.jsonl and test.jsonl (empty: download into --cache-dir)")
    cache_dir: str = knob("~/.cache/tba", "where downloaded data and the tiny preset's SFT model are kept")
    tiny_train_size: int = knob(20000, "tiny: synthetic training problems")
    tiny_eval_size: int = knob(500, "tiny: synthetic held-out problems")
    tiny_max_start: int = knob(9, "tiny: largest starting amount in a problem")
    tiny_max_step: int = knob(9, "tiny: largest amount added or removed per operation")
    tiny_num_ops: int = knob(5, "tiny: operations per problem")
    tiny_hidden: int = knob(96, "tiny: model width")
    tiny_layers: int = knob(3, "tiny: transformer layers")
    tiny_heads: int = knob(4, "tiny: attention heads")
    tiny_sft_steps: int = knob(600, "tiny: SFT warm-start steps")
    tiny_sft_batch: int = knob(64, "tiny: SFT batch size")
    tiny_sft_lr: float = knob(3e-3, "tiny: SFT peak learning rate")
    tiny_sft_worked_frac: float = knob(0.4, "tiny: fraction of SFT solutions that show the work (the rest are bare answers)")
    tiny_sft_guess_acc: float = knob(0.5, "tiny: how often the SFT teacher's bare answers are right")


def tiny_task_and_model(cfg):
    """The synthetic task, and the SFT warm start as the policy unless --model was given."""
    from rewards import gsm8k_task
    from tiny import make_dataset, warm_start
    shape = (cfg.tiny_max_start, cfg.tiny_max_step, cfg.tiny_num_ops)
    train_rows = make_dataset(cfg.tiny_train_size, cfg.seed, *shape)
    eval_rows = make_dataset(cfg.tiny_eval_size, cfg.seed + 1, *shape, exclude={r["question"] for r in train_rows})
    if not cfg.model:
        cfg.model = warm_start(cfg.cache_dir, cfg.seed, train_rows, cfg.tiny_max_start + cfg.tiny_num_ops * cfg.tiny_max_step,
                               cfg.tiny_hidden, cfg.tiny_layers, cfg.tiny_heads, 256, cfg.tiny_sft_steps,
                               cfg.tiny_sft_batch, cfg.tiny_sft_lr, cfg.tiny_sft_worked_frac, cfg.tiny_sft_guess_acc)
    return gsm8k_task(train_rows, eval_rows, "gsm8k-tiny")


def paper_task(cfg):
    from rewards import gsm8k_path, gsm8k_task, load_gsm8k
    train_rows = load_gsm8k(gsm8k_path("train", cfg.data_dir, cfg.cache_dir))
    test_rows = load_gsm8k(gsm8k_path("test", cfg.data_dir, cfg.cache_dir))
    return gsm8k_task(train_rows, test_rows)


def check_run_dir(cfg):
    """Unwritable --run-dir or a --resume without a checkpoint: errors before any data or model work."""
    from checkpoint import latest_checkpoint
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        probe = os.path.join(cfg.run_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--run-dir {cfg.run_dir} is not writable ({e.strerror})") from None
    if cfg.resume:
        try:
            latest_checkpoint(cfg.resume)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None


def main(argv=None):
    import torch
    default = "paper" if torch.cuda.is_available() else "tiny"
    cfg, preset = parse_config(GSM8KConfig, {"tiny": TINY, "paper": PAPER}, argv, default_preset=default)
    unresolved = dataclasses.replace(cfg)
    resolve_devices(cfg, torch.cuda.device_count())
    validate(dataclasses.replace(cfg, model=cfg.model or "tiny warm start"))  # fail fast, before any work
    if cfg.dry_run:
        print_config(cfg, preset)
        print("\n".join(["", "process-to-device plan:", *device_plan(cfg)]))
        if not torch.cuda.device_count():
            backend = "vllm" if unresolved.backend == "auto" else unresolved.backend
            four = resolve_devices(dataclasses.replace(unresolved, backend=backend), num_gpus=4)
            print("\n".join(["", "no CUDA device is visible; with 4 GPUs (and vLLM installed) the plan would be:",
                             *device_plan(four)]))
        return 0
    check_run_dir(cfg)
    task = tiny_task_and_model(cfg) if preset == "tiny" else paper_task(cfg)
    save_config(cfg, preset)
    try:
        train(cfg, task)
    except (SearcherDied, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: all processes stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
