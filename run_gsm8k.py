"""
GSM8K with TBA: `python run_gsm8k.py` (the offline tiny preset, a few minutes on 2 CPU cores) or
`python run_gsm8k.py --preset paper` (the paper's run, on GPUs).

Presets (pick with --preset; every field can still be overridden by its own flag):
  tiny   (the default) a synthetic GSM8K-format task, a word-level tokenizer and a 0.45M-parameter Llama,
         SFT'd here as the warm start (cached after the first run), then TBA with 1 searcher and
         1 trainer process on 2 CPU cores.
  paper  the paper's GSM8K run (Table 2, Appendix B.1) with RhoMath-1B SFT; needs GPUs and either
         internet or --data-dir. `--preset paper --dry-run` prints what it would run where.

The tiny task. Word problems with five additions and subtractions of small numbers, in GSM8K's format:
    question: "Amy has 3 cups . Amy finds 5 more cups . Amy loses 6 cups . ... How many cups does Amy have now ?"
    answer:   "3 + 5 = 8 . 8 - 6 = 2 . ... 17 + 1 = 18 .\\n#### 18"
graded by the same `gsm8k_reward` as real GSM8K (last number == gold number after ####). The warm start
is deliberately imperfect, in a way RL can fix: the SFT "teacher" writes the worked solution only some of
the time (--tiny-sft-worked-frac) and otherwise a bare answer "#### 18", itself right only
--tiny-sft-guess-acc of the time. A small model cannot do five operations in its head, so after SFT the
policy mostly skips the work (greedy decoding always does) and starts low (the README's results); RL
shifts probability towards showing the work, which KL-regularised RL (TB's
target pi_ref * exp(r/beta)) can do because it reweights behaviours the SFT model already has. It is a
teaching stand-in, not GSM8K.

Output in --run-dir: config.json (the resolved config), metrics.jsonl (one record per step),
result.json (the eval metrics before and after), final/ (the trained policy and tokenizer). The last line
printed is `accuracy: before X% -> after Y%`, greedy pass@1 on the held-out problems.

Run:  python run_gsm8k.py                  # tiny preset
      python run_gsm8k.py --steps 50       # any field of the config is a flag; --help lists them
"""

import random
import sys
from dataclasses import dataclass

import tba
from config import Config, knob
from ops.launch import cli
from searcher import spawn_searchers

TINY = dict(
    run_dir="runs/gsm8k-tiny", steps=300, model="", trainer_dtype="float32", device="cpu", searcher_device="cpu", backend="hf",
    trainer_threads=1, searcher_threads=1, num_searchers=1,  # 2 cores: one trainer, one searcher
    prompts_per_search=8, samples_per_prompt=8, temperature=0.7, max_new_tokens=40,
    batch_size=64, responses_per_prompt=8, micro_batch_prompts=8, micro_batch=64,  # 8 prompts x K = 8
    # temperature 0.7 and lr 2e-5: hotter sampling and larger steps lifted held-out accuracy, then lost it to
    # wrong worked solutions (docs/LOG.md, "Numbers behind the presets")
    lr=2e-5, warmup_steps=20, stable_steps=180, decay_steps=100, lr_floor=0.1, lr_decay="linear",
    grad_clip=0.0,  # no clipping, as the official code: it did as well as the clip at 1.0 (docs/results.md)
    beta_start=0.1, beta_end=0.1, beta_decay_steps=0,  # constant beta
    sync_every=4, m=0.95, capacity_per_prompt=64,
    initial_completions=64,  # one batch (official: 500 of 98,000 episodes); a larger fill did no better (docs/results.md)
    eval_every=50, eval_size=0, eval_batch_size=100, log_every=10, checkpoint_every=100, searcher_timeout=60.0,
    tb_correction="trust-region",  # TB with a trust region, ours: the paper's plain TB is --tb-correction none (README)
)

# The official GSM8K run (bbartoldson/TBA: launch_training_gsm8k.sh, configs/tba_rho1b_gsm8k.yml,
# src/tba_trainer_gsm8k.py, src/buffer_utils.py) value for value; docs/tasks.md has the table.
PAPER = dict(
    run_dir="runs/gsm8k-paper", seed=42,  # the official trainer's seed (HF TrainingArguments default)
    model="realtreetune/rho-1b-sft-GSM8K",  # RhoMath-1B SFT on GSM8K (paper Sec. 5.1)
    steps=700,  # 98,000 episodes / 140 per step
    trainer_dtype="auto", device="auto", searcher_device="auto",
    num_searchers=0,  # one per GPU after the trainer's: 3 searchers + 1 trainer on 4 GPUs, as the official run
    trainer_threads=4, searcher_threads=4,
    backend="auto", vllm_gpu_memory_utilization=0.2,  # vLLM on GPU searchers, as the official code
    prompts_per_search=3, samples_per_prompt=24,  # S = 1.2 K; 72 sequences per vLLM call
    temperature=0.7, max_new_tokens=512, max_prompt_tokens=256,  # official asserts every prompt fits in 256
    batch_size=140, responses_per_prompt=20, micro_batch_prompts=1,  # 7 prompts x K = 20, one prompt per backward
    lr=1e-5, warmup_steps=50, stable_steps=350, decay_steps=600, lr_decay="cosine",  # get_wsd_schedule, cut at 700
    grad_clip=0.0,  # no clipping: the official loop never calls clip_grad_norm_
    beta_start=0.014, beta_end=0.004, beta_decay_steps=500,  # linear, no jump
    sync_every=2, m=0.95, initial_completions=500, capacity_per_prompt=100, prioritization="uniform",
    eval_every=0, eval_size=0, eval_batch_size=128, log_every=1, checkpoint_every=50,  # eval once, at the end
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
    tiny_hidden: int = knob(96, "tiny: model width (attention heads of 32 dimensions)")
    tiny_layers: int = knob(3, "tiny: transformer layers")
    tiny_sft_steps: int = knob(600, "tiny: SFT warm-start steps")
    tiny_sft_batch: int = knob(64, "tiny: SFT batch size")
    tiny_sft_lr: float = knob(3e-3, "tiny: SFT peak learning rate")
    tiny_sft_worked_frac: float = knob(0.4, "tiny: fraction of SFT solutions that show the work (the rest are bare answers)")
    tiny_sft_guess_acc: float = knob(0.5, "tiny: how often the SFT teacher's bare answers are right")


def make_task(cfg):
    """The GSM8K task for this preset; for tiny, also the SFT warm start as the policy unless --model is set."""
    from rewards import GSM8KTask, gsm8k_path, load_gsm8k
    if cfg.preset == "paper":
        train_rows = load_gsm8k(gsm8k_path("train", cfg.data_dir, cfg.cache_dir))
        return GSM8KTask.from_rows(train_rows, load_gsm8k(gsm8k_path("test", cfg.data_dir, cfg.cache_dir)))
    shape = (cfg.tiny_max_start, cfg.tiny_max_step, cfg.tiny_num_ops)
    train_rows = make_dataset(cfg.tiny_train_size, cfg.seed, *shape)
    eval_rows = make_dataset(cfg.tiny_eval_size, cfg.seed + 1, *shape, exclude={r["question"] for r in train_rows})
    if not cfg.model:
        cfg.model = warm_start(cfg, train_rows)
    return GSM8KTask.from_rows(train_rows, eval_rows)


# -----------------------------------------------------------------------------
# The tiny preset: synthetic problems and the SFT warm start

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Amy", "Tom", "Eva", "Dan"]
OBJECTS = ["apples", "pens", "coins", "books", "cards", "shells", "stamps", "marbles", "eggs", "cups"]
GAINS = [("finds", "more"), ("buys", "more"), ("gets", "more"), ("picks", "more")]
LOSSES = ["loses", "gives away", "sells", "eats"]
TEMPLATE_WORDS = "[ MATH TASK ] Problem : Solution has How many does have now ? . + - = ####".split()


def make_problem(rng, max_start, max_step, num_ops):
    """One problem as a GSM8K row with its worked solution; values stay in [0, max_start + num_ops * max_step]."""
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.randint(1, max_start)
    sentences, steps = [f"{name} has {value} {obj} ."], []
    for _ in range(num_ops):
        amount = rng.randint(1, max_step)
        if rng.random() < 0.5 and value - amount >= 0:
            sentences.append(f"{name} {rng.choice(LOSSES)} {amount} {obj} .")
            steps.append(f"{value} - {amount} = {value - amount} .")
            value -= amount
        else:
            verb, more = rng.choice(GAINS)
            sentences.append(f"{name} {verb} {amount} {more} {obj} .")
            steps.append(f"{value} + {amount} = {value + amount} .")
            value += amount
    question = " ".join(sentences) + f" How many {obj} does {name} have now ?"
    return {"question": question, "answer": " ".join(steps) + f"\n#### {value}"}


def make_dataset(n, seed, max_start, max_step, num_ops, exclude=()):
    """n distinct problems from a seed, none of whose questions is in `exclude`."""
    rng, seen, rows = random.Random(seed), set(exclude), []
    while len(rows) < n:
        row = make_problem(rng, max_start, max_step, num_ops)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def sft_examples(rows, worked_frac, guess_acc, seed):
    """The SFT teacher's (prompt, completion) pairs: the worked solution with probability worked_frac, else a
    bare answer "#### N" that is right only with probability guess_acc."""
    from rewards import gsm8k_prompt
    rng, out = random.Random(seed), []
    for r in rows:
        completion = r["answer"]
        if rng.random() >= worked_frac:
            value = int(r["answer"].split("####")[-1])
            if rng.random() >= guess_acc:
                value = max(0, value + rng.choice([-3, -2, -1, 1, 2, 3]))
            completion = f"#### {value}"
        out.append((gsm8k_prompt(r["question"]), completion))
    return out


def warm_start(cfg, train_rows):
    """Path of the SFT'd tiny policy for these settings (trained once, then reused from --cache-dir)."""
    import tiny
    max_number = cfg.tiny_max_start + cfg.tiny_num_ops * cfg.tiny_max_step
    settings = dict(seed=cfg.seed, n=len(train_rows), first=train_rows[0]["question"], max_number=max_number,
                    hidden=cfg.tiny_hidden, layers=cfg.tiny_layers, sft_steps=cfg.tiny_sft_steps,
                    sft_batch=cfg.tiny_sft_batch, sft_lr=cfg.tiny_sft_lr, worked_frac=cfg.tiny_sft_worked_frac,
                    guess_acc=cfg.tiny_sft_guess_acc, version=2)

    def build(path):
        words = TEMPLATE_WORDS + NAMES + OBJECTS + sorted({w for g in GAINS for w in g} | {w for l in LOSSES for w in l.split()})
        tokenizer = tiny.word_tokenizer(words + [str(i) for i in range(max_number + 1)])
        model = tiny.tiny_llama(tokenizer, cfg.tiny_hidden, cfg.tiny_layers, 256, cfg.seed)
        print(f"tiny preset: SFT of a {tiny.num_params(model) / 1e6:.2f}M-parameter Llama for {cfg.tiny_sft_steps} steps")
        examples = sft_examples(train_rows, cfg.tiny_sft_worked_frac, cfg.tiny_sft_guess_acc, cfg.seed)
        loss = tiny.sft(model, tokenizer, examples, cfg.tiny_sft_steps, cfg.tiny_sft_batch, cfg.tiny_sft_lr, cfg.seed)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return {"params": tiny.num_params(model), "final_loss": loss}

    return tiny.cached(cfg.cache_dir, "gsm8k-tiny-sft", settings, build)


PRESETS = {"tiny": TINY, "paper": PAPER}


def main(cfg):
    """GSM8K with TBA: the searchers start first (their imports overlap the warm start's), then the
    task, then the trainer (ops/launch.py runs it after its checks)."""
    with spawn_searchers(cfg) as searchers:  # searcher.py: stopped when the block ends, on every path
        return tba.train(cfg, make_task(cfg), searchers)  # (make_task: the task's data and warm start)


if __name__ == "__main__":
    sys.exit(cli(GSM8KConfig, PRESETS, main, description=__doc__.split("\n\n")[0]))
