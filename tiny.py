"""
The offline tiny preset: a synthetic GSM8K-format task, a word-level tokenizer, a 0.45M-parameter Llama,
and the supervised warm start (SFT) that plays the role of the paper's RhoMath-1B SFT checkpoint.

Everything is built from a seed on the machine, so the quick start needs no download. The model and
tokenizer are ordinary transformers objects (LlamaForCausalLM, PreTrainedTokenizerFast) saved with
`save_pretrained`, and the RL code loads them back with `from_pretrained`, exactly as it loads a hub model.

The task. Word problems with five additions and subtractions of small numbers, in GSM8K's format:
    question: "Amy has 3 cups . Amy finds 5 more cups . Amy loses 6 cups . ... How many cups does Amy have now ?"
    answer:   "3 + 5 = 8 . 8 - 6 = 2 . ... 17 + 1 = 18 .\\n#### 18"
graded by the same `gsm8k_reward` as real GSM8K (last number == gold number after ####).

The warm start is deliberately imperfect, in a way RL can fix. The SFT "teacher" writes the worked
solution above only some of the time (`tiny_sft_worked_frac`) and otherwise just a bare answer
"#### 18", which is itself right only `tiny_sft_guess_acc` of the time. A small model cannot do five
operations in its head, so bare answers are often wrong; worked solutions are mostly right. After SFT the
policy usually skips the work (greedy decoding always does), which gives a modest start (about 19% on
held-out problems). Reward-driven training then shifts probability towards showing the work, and greedy
accuracy rises: RL improves the policy by reweighting behaviours the SFT model already has, which is what
KL-regularised RL (and TB's target pi_ref * exp(r/beta)) is about.

This is a teaching stand-in, not GSM8K: it exercises every part of TBA (processes, buffer, loss, sync,
reference) at a size a laptop CPU trains in minutes; it says nothing about how large models reason.

Run `python tiny.py` to build the tokenizer, SFT the model and print its greedy accuracy.
"""

import hashlib
import json
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Amy", "Tom", "Eva", "Dan"]
OBJECTS = ["apples", "pens", "coins", "books", "cards", "shells", "stamps", "marbles", "eggs", "cups"]
GAINS = [("finds", "more"), ("buys", "more"), ("gets", "more"), ("picks", "more")]
LOSSES = ["loses", "gives away", "sells", "eats"]
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
TEMPLATE_WORDS = "[ MATH TASK ] Problem : Solution has How many does have now ? . + - = ####".split()


# -----------------------------------------------------------------------------
# The synthetic task

def make_problem(rng, max_start, max_step, num_ops):
    """One problem as a GSM8K row plus the worked solution; results stay in [0, max_start + ops*max_step]."""
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.randint(1, max_start)
    sentences, steps = [f"{name} has {value} {obj} ."], []
    for _ in range(num_ops):
        amount = rng.randint(1, max_step)
        if rng.random() < 0.5 and value - amount >= 0:
            verb = rng.choice(LOSSES)
            sentences.append(f"{name} {verb} {amount} {obj} .")
            steps.append(f"{value} - {amount} = {value - amount} .")
            value -= amount
        else:
            verb, more = rng.choice(GAINS)
            sentences.append(f"{name} {verb} {amount} {more} {obj} .")
            steps.append(f"{value} + {amount} = {value + amount} .")
            value += amount
    question = " ".join(sentences) + f" How many {obj} does {name} have now ?"
    worked = " ".join(steps) + f"\n#### {value}"
    return {"question": question, "answer": worked}


def make_dataset(n, seed, max_start, max_step, num_ops, exclude=()):
    """n distinct problems from a seed, none of whose questions is in `exclude`."""
    rng, seen, rows = random.Random(seed), set(exclude), []
    while len(rows) < n:
        row = make_problem(rng, max_start, max_step, num_ops)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def bare_answer(row, rng, guess_acc):
    """The SFT teacher's shortcut: the answer line without the work, right only with probability guess_acc."""
    value = int(row["answer"].split("####")[-1])
    if rng.random() >= guess_acc:
        value = max(0, value + rng.choice([-3, -2, -1, 1, 2, 3]))
    return f"#### {value}"


# -----------------------------------------------------------------------------
# Tokenizer and model

def build_tokenizer(max_number):
    """A word-level PreTrainedTokenizerFast: every word, punctuation mark and number 0..max_number is a token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = SPECIAL + TEMPLATE_WORDS + NAMES + OBJECTS + sorted({w for g in GAINS for w in g} |
                                                              {w for l in LOSSES for w in l.split()})
    words += [str(i) for i in range(max_number + 1)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits on \w+|[^\w\s]+ : "####", "[", ":" are tokens
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_model(vocab_size, hidden, layers, heads, max_len, tokenizer, seed):
    """A small LlamaForCausalLM with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_len, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


# -----------------------------------------------------------------------------
# Supervised warm start

def sft_examples(rows, worked_frac, guess_acc, seed):
    """(prompt, completion) pairs: the worked solution with probability worked_frac, else a bare answer."""
    from rewards import gsm8k_prompt
    rng = random.Random(seed)
    return [(gsm8k_prompt(r["question"]), r["answer"] if rng.random() < worked_frac else bare_answer(r, rng, guess_acc))
            for r in rows]


def collate(tokenizer, prompts, completions):
    """Right-padded (input_ids, attention_mask, labels) with labels = -100 outside the completion."""
    rows = []
    for p, c in zip(prompts, completions):
        p_ids = tokenizer(p)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p_ids + c_ids, [-100] * len(p_ids) + c_ids))
    T = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (T - len(ids)) for ids, _ in rows])  # (N, T)
    labels = torch.tensor([lab + [-100] * (T - len(lab)) for _, lab in rows])  # (N, T)
    attention_mask = (torch.arange(T)[None] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    return input_ids, attention_mask, labels


def sft(model, tokenizer, examples, steps, batch_size, lr, seed, log_every=100):
    """Cross-entropy on completion tokens, AdamW with linear warmup and cosine decay."""
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    bar = tqdm(range(steps), desc="sft", leave=False)
    for step in bar:
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + torch.cos(torch.tensor(step / steps * torch.pi)).item())
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(len(examples), (batch_size,), generator=g).tolist()
        input_ids, attention_mask, labels = collate(tokenizer, *zip(*[examples[i] for i in idx]))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return loss.item()


def warm_start(cache_dir, seed, train_rows, max_number, hidden, layers, heads, max_len, sft_steps, sft_batch,
               sft_lr, worked_frac, guess_acc):
    """Path of the SFT'd tiny model for these settings: trained and saved once, then reused from the cache."""
    settings = dict(seed=seed, n=len(train_rows), first=train_rows[0]["question"], max_number=max_number,
                    hidden=hidden, layers=layers, heads=heads, max_len=max_len, sft_steps=sft_steps,
                    sft_batch=sft_batch, sft_lr=sft_lr, worked_frac=worked_frac, guess_acc=guess_acc, version=1)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(os.path.expanduser(cache_dir), f"tiny-sft-{key}")
    if os.path.isfile(os.path.join(path, "sft.json")):
        print(f"tiny preset: reusing the SFT warm start in {path}")
        return path
    tokenizer = build_tokenizer(max_number)
    model = build_model(len(tokenizer), hidden, layers, heads, max_len, tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny preset: SFT of a {n_params / 1e6:.2f}M-parameter Llama for {sft_steps} steps "
          f"(cached in {path} for later runs)")
    t0 = time.time()
    loss = sft(model, tokenizer, sft_examples(train_rows, worked_frac, guess_acc, seed), sft_steps, sft_batch, sft_lr, seed)
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "sft.json"), "w") as f:
        json.dump({**settings, "params": n_params, "final_loss": loss, "seconds": time.time() - t0}, f, indent=2)
    if os.path.exists(path):  # another run finished the same warm start first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    print(f"tiny preset: SFT done in {time.time() - t0:.0f}s, final loss {loss:.3f}")
    return path


if __name__ == "__main__":
    import tempfile
    from run_gsm8k import TINY, GSM8KConfig, tiny_task_and_model
    from searcher import HFGenerator, evaluate, load_model
    cfg = GSM8KConfig(**{**TINY, "cache_dir": tempfile.mkdtemp()})  # the tiny preset's settings, a fresh cache
    task = tiny_task_and_model(cfg)
    model, tok = load_model(cfg.model)
    gen = HFGenerator(model, tok, cfg.max_new_tokens)
    acc, sample = evaluate(gen, tok, task.eval_prompts, task.eval_answers, task.reward, cfg.eval_batch_size)
    print(f"greedy accuracy after SFT: {100 * acc:.1f}% on {len(task.eval_prompts)} held-out problems (e.g. {sample!r})")
