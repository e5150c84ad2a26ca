"""
TL;DR summarisation with TBA: `python run_tldr.py` (the offline tiny preset, under 10 minutes on 2 CPU cores)
or `python run_tldr.py --preset paper` (the paper's run, on GPUs).

Presets (pick with --preset; every field can still be overridden by its own flag):
  tiny   (the default) generated Reddit-style posts, a word-level tokenizer, a tiny Llama policy SFT'd on
         the reference summaries and a tiny Llama proxy reward model trained on gold-labelled pairs (both
         built here and cached after the first run), then TBA with 1 searcher and 1 trainer on 2 CPU cores.
  paper  the paper's TL;DR run (Sec. 5.2, Table 1; the official bbartoldson/TBA TL;DR config): Pythia-1B
         SFT, proxy RM Pythia-1B, gold RM Pythia-6.9B; needs GPUs and the data (--data-dir, or the
         `datasets` library). `--preset paper --dry-run` prints what it would run where.

The tiny task: the paper's protocol in miniature. A post tells three key facts (of a catalogue of twelve,
FACTS) and two distractors (DISTRACTORS):
    SUBREDDIT: r/tifu  TITLE: help with my boss
    POST: my boss cut my pay . we like tea . my mom sold my car . i watched chess . my dad lost my job .
    TL;DR:
and a summary lists phrases: " boss cut pay , mom sold car , dad lost job ." The gold score
(tldr.fact_score) counts the key facts stated and subtracts for distractors, unsupported phrases (invented
or garbled), repeats and length; a perfect summary scores 3. The reference summaries, which are also the
SFT data, come from a terse "teacher": always the main fact (the title's), the other two only sometimes
(TEACHER_FACTS), sometimes a distractor or a repeat. So the SFT policy, decoding greedily, writes the main
fact and stops, and rarely beats the reference (ties lose). The policy is trained on a *proxy* reward
model, a tiny LlamaForSequenceClassification trained with the Bradley-Terry loss on pairs of summaries
labelled by the gold score, as the paper's proxy RM was trained on pairs relabelled by its gold RM, and
it is judged by the gold score against the references. The proxy is accurate on summaries like those it
was trained on (`rm_candidate`: never more than five phrases); elsewhere it extrapolates, and a run that
pushes far from the SFT policy (small beta, many steps) can raise the proxy while the gold falls.

Output in --run-dir: config.json, metrics.jsonl (one record per step; eval/win_rate, eval/kl, ... every
--eval-every steps), result.json, final/. The last line printed is `win_rate: before X% -> after Y%`.

Run:  python run_tldr.py                   # tiny preset
      python run_tldr.py --seed 1          # another corpus, warm start, proxy RM and run
      python run_tldr.py --preset paper --dry-run
"""

import random
import sys
from dataclasses import dataclass

import tba
from config import ConfigError, Config, knob
from ops.launch import cli
from searcher import spawn_searchers

TINY = dict(
    run_dir="runs/tldr-tiny", steps=50, model="", trainer_dtype="float32", device="cpu", searcher_device="cpu", backend="hf",
    trainer_threads=1, searcher_threads=1, num_searchers=1,  # 2 cores: one trainer, one searcher
    prompts_per_search=8, samples_per_prompt=8, temperature=0.7, loss_temperature=0.7, max_new_tokens=24,
    no_eos_reward=-1.0, batch_size=64, responses_per_prompt=8, micro_batch_prompts=8, micro_batch=64,
    lr=1e-4, warmup_steps=5, stable_steps=30, decay_steps=15, lr_decay="linear", lr_floor=0.1,  # (docs/LOG.md: 2e-4 overshot)
    grad_clip=1.0,  # (the official trainer does not clip; unclipped TL;DR runs not measured yet)
    # constant beta: the official schedule's shape (1.0, then 0.05 from step 6) did worse at k = 10
    # (docs/results.md, the frontier)
    beta_start=0.2, beta_end=0.2, beta_decay_steps=0,
    sync_every=4, initial_completions=256, m=0.5, capacity_per_prompt=64,
    eval_every=10, eval_size=200, eval_batch_size=100, log_every=10,
    tb_correction="trust-region",  # TB with a trust region, ours: the paper's plain TB is --tb-correction none (README)
)

PAPER = dict(
    run_dir="runs/tldr-paper",
    model="mnoukhov/pythia1b-sft-tldr",  # official launch script: the 1b size (410m and 2.8b also exist)
    proxy_rm="mnoukhov/pythia1b-rm-tldr6.9b",  # proxy RM: Pythia-1B trained on pairs relabelled by the gold RM
    gold_rm="cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr",  # official evaluation's gold RM
    steps=256,  # 40,960 episodes / 160
    trainer_dtype="float32",  # the official trainer ran in fp32 (fp16 only in vLLM): fp32 compute too
    device="auto", searcher_device="auto", backend="auto",
    num_searchers=0,  # one per GPU after the trainer's: 1 trainer + 3 searcher GPUs on 4, as the official run
    vllm_gpu_memory_utilization=0.25,  # as the official searchers
    trainer_threads=4, searcher_threads=4,
    prompts_per_search=1, samples_per_prompt=20,  # one prompt x S = 20 per vLLM call, as the official 1b run
    temperature=0.7, loss_temperature=0.7,  # logits / 0.7 for pi and pi_ref in the loss, as sampled
    max_new_tokens=128, no_eos_reward=-1.0, max_prompt_tokens=512,
    batch_size=160, responses_per_prompt=20, micro_batch_prompts=1, micro_batch=20,  # 8 prompts x K = 20
    lr=3e-6, warmup_steps=0, stable_steps=0, decay_steps=256, lr_decay="linear", lr_floor=0.0,  # to 0, no warmup
    grad_clip=0.0,  # no clipping: the official TL;DR trainer never clips
    beta_start=1.0, beta_end=0.05, beta_decay_steps=128,
    beta_stop_step=31,  # official update 32 (counted from 1) is our step 31 (counted from 0): beta = 0.05 from there
    sync_every=10, m=0.5, initial_completions=10_000, capacity_per_prompt=100, prioritization="softmax", reward_temp=1.0,
    eval_every=0, eval_size=0, eval_batch_size=64, log_every=1, checkpoint_every=64,  # validation split, at the end
)


@dataclass
class TLDRConfig(Config):
    data_dir: str = knob("", "directory with the TL;DR train and validation files (.jsonl, .json or .parquet; "
                             "empty: download with the datasets library)")
    cache_dir: str = knob("~/.cache/tba", "where the tiny preset's SFT policy and proxy reward model are kept")
    proxy_rm: str = knob("", "training reward model: HF hub name or local directory (empty: the tiny preset trains one)")
    gold_rm: str = knob("", "evaluation reward model: HF hub name or local directory (empty: tldr.fact_score, tiny only)")
    query_tokens: int = knob(512, "longest prompt in tokens: the post is cut at its last newline until it fits")
    tiny_train_size: int = knob(4000, "tiny: generated training posts")
    tiny_eval_size: int = knob(200, "tiny: generated held-out posts")
    tiny_hidden: int = knob(96, "tiny: policy width (attention heads of 32 dimensions)")
    tiny_layers: int = knob(3, "tiny: policy transformer layers")
    tiny_sft_steps: int = knob(300, "tiny: SFT steps on the reference summaries")
    tiny_sft_batch: int = knob(32, "tiny: SFT batch size")
    tiny_sft_lr: float = knob(3e-3, "tiny: SFT peak learning rate")
    tiny_rm_hidden: int = knob(64, "tiny: proxy reward model width")
    tiny_rm_layers: int = knob(2, "tiny: proxy reward model transformer layers")
    tiny_rm_steps: int = knob(300, "tiny: proxy reward model training steps (Bradley-Terry)")
    tiny_rm_batch: int = knob(32, "tiny: summary pairs per reward-model step")
    tiny_rm_lr: float = knob(2e-3, "tiny: proxy reward model peak learning rate")

    def extra_models(self):
        """The proxy RM scores in every searcher; the evaluation adds the gold RM, the proxy RM and an SFT copy (KL)."""
        proxy, gold = [(self.proxy_rm, "cls")] if self.proxy_rm else [], [(self.gold_rm, "cls")] if self.gold_rm else []
        return {"trainer": gold + proxy + [(self.ref_model or self.model, "lm")], "searcher": proxy}


def make_task(cfg):
    """The TL;DR task; for tiny, also the SFT policy (unless --model) and the proxy RM (unless --proxy-rm)."""
    if cfg.preset == "paper" and not (cfg.proxy_rm and cfg.gold_rm):
        raise ConfigError("--proxy-rm and --gold-rm are needed with real data (fact_score is the tiny preset's gold)")
    from transformers import AutoTokenizer
    from tasks.tldr import TLDRTask, tldr_rows
    if cfg.preset == "paper":
        train_rows, eval_rows = tldr_rows("train", cfg.data_dir), tldr_rows("validation", cfg.data_dir)
    else:
        train_rows = make_corpus(cfg.tiny_train_size, cfg.seed)
        eval_rows = make_corpus(cfg.tiny_eval_size, cfg.seed + 1, exclude={r["post"] for r in train_rows})
        cfg.model = cfg.model or warm_start(cfg, train_rows)
        cfg.proxy_rm = cfg.proxy_rm or proxy_reward_model(cfg, train_rows, eval_rows)
    return TLDRTask.from_rows(train_rows, eval_rows, AutoTokenizer.from_pretrained(cfg.model), cfg.query_tokens,
                              proxy_rm=cfg.proxy_rm, gold_rm=cfg.gold_rm, dtype=cfg.searcher_dtype, rm_batch_size=cfg.micro_batch)


# -----------------------------------------------------------------------------
# The tiny preset: generated posts, their reference summaries, the summaries the proxy RM learns from

SUBREDDITS = ["relationships", "tifu", "personalfinance", "legaladvice", "AskReddit", "offmychest"]
FACTS = ["boss cut pay", "roommate stole food", "girlfriend read texts", "boyfriend forgot birthday", "mom sold car",
         "dad lost job", "sister broke phone", "brother borrowed money", "friend skipped wedding", "coworker took credit",
         "landlord kept deposit", "neighbor blocked driveway"]  # "boss cut pay" is told as "my boss cut my pay ."
DISTRACTORS = ["we like tea", "i watched chess", "they cooked pasta", "i played soccer", "we visited paris",
               "they love movies", "i bought shoes", "we painted walls", "they adopted cats", "i read novels",
               "we baked bread", "they hiked trails"]
TEMPLATE_WORDS = "SUBREDDIT TITLE POST TL DR r / : ; , . my help with".split()
TEACHER_FACTS = (0.7, 0.2, 0.1)  # the reference states 1, 2 or 3 key facts with these probabilities
TEACHER_DISTRACTOR, TEACHER_REPEAT = 0.2, 0.05  # ... adds a distractor, repeats a phrase, this often


def make_post(rng):
    """One post: three key facts (in order) and two distractors among its sentences, and its reference summary."""
    facts, distractors = rng.sample(FACTS, 3), rng.sample(DISTRACTORS, 2)
    sentences = [f"my {p} {v} my {o} ." for p, v, o in map(str.split, facts)]
    for d in distractors:
        sentences.insert(rng.randint(0, len(sentences)), f"{d} .")
    return {"subreddit": rng.choice(SUBREDDITS), "title": f"help with my {facts[0].split()[0]}",
            "post": " ".join(sentences), "summary": teacher_summary(rng, facts, distractors), "facts": facts,
            "distractors": distractors}


def teacher_summary(rng, facts, distractors):
    """A reference summary: the main fact, maybe more facts, sometimes a distractor or a repeat."""
    k = rng.choices([1, 2, 3], weights=TEACHER_FACTS)[0]
    more = rng.sample(facts[1:], k - 1)
    phrases = [facts[0]] + [f for f in facts[1:] if f in more]  # in the post's order
    if rng.random() < TEACHER_DISTRACTOR:
        phrases.insert(rng.randint(0, len(phrases)), rng.choice(distractors))
    if rng.random() < TEACHER_REPEAT:
        phrases.append(rng.choice(phrases))
    return " , ".join(phrases) + " ."


def make_corpus(n, seed, exclude=()):
    """n posts with distinct texts from a seed, none of which is in `exclude`."""
    rng, seen, rows = random.Random(seed), set(exclude), []
    while len(rows) < n:
        row = make_post(rng)
        if row["post"] not in seen:
            seen.add(row["post"])
            rows.append(row)
    return rows


def rm_candidate(rng, row):
    """A summary for the proxy RM's pairs: the teacher's half the time, else a random edit of the full summary
    (facts dropped, a distractor added, a phrase made unsupported, a repeat): never more than five phrases."""
    if rng.random() < 0.5:
        return teacher_summary(rng, row["facts"], row["distractors"])
    phrases = [f for f in row["facts"] if rng.random() < 0.7]
    if rng.random() < 0.3:
        phrases.insert(rng.randint(0, len(phrases)), rng.choice(row["distractors"]))
    if phrases and rng.random() < 0.3:  # an invented fact, or words of two facts mixed
        i, other = rng.randrange(len(phrases)), rng.choice(row["facts"]).split()
        mixed = " ".join(phrases[i].split()[:2] + other[2:])
        phrases[i] = rng.choice([f for f in FACTS if f not in row["facts"]]) if rng.random() < 0.5 else mixed
    if phrases and rng.random() < 0.2:
        phrases.append(rng.choice(phrases))
    return " , ".join(phrases) + " ." if phrases else "."


def preference_pairs(rows, n, seed, count_tokens):
    """n (prompt, chosen, rejected) triples: two candidates for one post, ordered by the gold score (ties skipped)."""
    from tasks.tldr import fact_score, tldr_query
    rng, pairs = random.Random(seed), []
    while len(pairs) < n:
        row = rng.choice(rows)
        a, b = " " + rm_candidate(rng, row), " " + rm_candidate(rng, row)
        (ga, gb) = fact_score(["", ""], [a, b], [row, row])
        if ga != gb:
            pairs.append((tldr_query(row, count_tokens), *((a, b) if ga > gb else (b, a))))
    return pairs


# -----------------------------------------------------------------------------
# The tiny preset's models: the SFT policy and the proxy reward model, each trained once and cached

def tiny_tokenizer():
    import tiny
    return tiny.word_tokenizer(TEMPLATE_WORDS + SUBREDDITS + " ".join(FACTS + DISTRACTORS).split())


def warm_start(cfg, train_rows):
    """Path of the tiny policy SFT'd on the reference summaries of the training posts (built once, then cached)."""
    import tiny
    from tasks.tldr import tldr_query
    settings = dict(seed=cfg.seed, n=len(train_rows), first=train_rows[0]["post"], hidden=cfg.tiny_hidden,
                    layers=cfg.tiny_layers, sft_steps=cfg.tiny_sft_steps, sft_batch=cfg.tiny_sft_batch,
                    sft_lr=cfg.tiny_sft_lr, teacher=[TEACHER_FACTS, TEACHER_DISTRACTOR, TEACHER_REPEAT], version=2)

    def build(path):
        tokenizer = tiny_tokenizer()
        model = tiny.tiny_llama(tokenizer, cfg.tiny_hidden, cfg.tiny_layers, 256, cfg.seed)
        print(f"tiny preset: SFT of a {tiny.num_params(model) / 1e6:.2f}M-parameter Llama for {cfg.tiny_sft_steps} steps")
        count = lambda text: len(tokenizer(text)["input_ids"])
        examples = [(tldr_query(r, count, cfg.query_tokens), " " + r["summary"]) for r in train_rows]
        loss = tiny.sft(model, tokenizer, examples, cfg.tiny_sft_steps, cfg.tiny_sft_batch, cfg.tiny_sft_lr, cfg.seed)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return {"params": tiny.num_params(model), "final_loss": loss}

    return tiny.cached(cfg.cache_dir, "tldr-tiny-sft", settings, build)


def proxy_reward_model(cfg, train_rows, eval_rows):
    """Path of the tiny proxy RM trained with Bradley-Terry on gold-labelled pairs (built once, then cached)."""
    import tiny
    settings = dict(seed=cfg.seed, n=len(train_rows), first=train_rows[0]["post"], hidden=cfg.tiny_rm_hidden,
                    layers=cfg.tiny_rm_layers, steps=cfg.tiny_rm_steps, batch=cfg.tiny_rm_batch, lr=cfg.tiny_rm_lr,
                    teacher=[TEACHER_FACTS, TEACHER_DISTRACTOR, TEACHER_REPEAT], version=2)

    def build(path):
        tokenizer = tiny_tokenizer()
        model = tiny.tiny_classifier(tokenizer, cfg.tiny_rm_hidden, cfg.tiny_rm_layers, 256, cfg.seed)
        print(f"tiny preset: Bradley-Terry training of a {tiny.num_params(model) / 1e6:.2f}M-parameter reward model "
              f"for {cfg.tiny_rm_steps} steps")
        count = lambda text: len(tokenizer(text)["input_ids"])
        pairs = preference_pairs(train_rows, cfg.tiny_rm_steps * cfg.tiny_rm_batch, cfg.seed, count)
        loss = train_reward_model(model, tokenizer, pairs, cfg.tiny_rm_steps, cfg.tiny_rm_batch, cfg.tiny_rm_lr, cfg.seed)
        accuracy = pair_accuracy(model, tokenizer, preference_pairs(eval_rows, 1000, cfg.seed + 1, count))
        print(f"tiny preset: proxy reward model final loss {loss:.3f}, held-out pair accuracy {100 * accuracy:.1f}%")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return {"params": tiny.num_params(model), "final_loss": loss, "heldout_pair_accuracy": accuracy}

    return tiny.cached(cfg.cache_dir, "tldr-tiny-rm", settings, build)


def bradley_terry_loss(r_chosen, r_rejected):
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs (TRL's RewardTrainer, which trained the
    official proxy RM). r_chosen, r_rejected: (N,)."""
    import torch.nn.functional as F
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def pair_rewards(model, tokenizer, pairs):
    """Rewards of the chosen and the rejected summary of each pair: two (N,) tensors."""
    from tasks.tldr import reward_inputs
    prompts, chosen, rejected = zip(*pairs)
    input_ids, attention_mask = reward_inputs(tokenizer, prompts * 2, chosen + rejected)
    r = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]  # (2N,)
    return r[:len(pairs)], r[len(pairs):]


def train_reward_model(model, tokenizer, pairs, steps, batch_size, lr, seed):
    """Minimise the Bradley-Terry loss over random batches of pairs; AdamW, linear warmup, cosine decay."""
    import math
    import torch
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        batch = [pairs[i] for i in torch.randint(len(pairs), (batch_size,), generator=g).tolist()]
        loss = bradley_terry_loss(*pair_rewards(model, tokenizer, batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return loss.item()


def pair_accuracy(model, tokenizer, pairs, batch_size=200):
    """Fraction of pairs whose chosen summary the reward model scores higher."""
    import torch
    wins = 0
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            r_chosen, r_rejected = pair_rewards(model, tokenizer, pairs[i:i + batch_size])
            wins += (r_chosen > r_rejected).sum().item()
    return wins / len(pairs)


PRESETS = {"tiny": TINY, "paper": PAPER}


def main(cfg):
    """TL;DR with TBA: the searchers start first (their imports overlap the SFT and reward model's),
    then the task, then the trainer (ops/launch.py runs it after its checks)."""
    with spawn_searchers(cfg) as searchers:  # searcher.py: stopped when the block ends, on every path
        return tba.train(cfg, make_task(cfg), searchers)  # (make_task: the task's data and warm start)


if __name__ == "__main__":
    sys.exit(cli(TLDRConfig, PRESETS, main, description=__doc__.split("\n\n")[0]))
