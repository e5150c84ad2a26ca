"""
The machinery every task's offline tiny preset shares: a word-level tokenizer, small transformers models,
a supervised warm start (SFT), and a cache so each warm start is trained once per machine.

Everything is built from a seed on the machine, so the quick starts need no download. The models and
tokenizers are ordinary transformers objects (LlamaForCausalLM, PreTrainedTokenizerFast, ...) saved with
`save_pretrained`, and the RL code loads them back with `from_pretrained`, exactly as it loads a hub model.
What each task builds with these pieces (its synthetic data, its SFT teacher) lives with the task.

Shapes: attention heads of 32 dimensions, the smallest that vLLM's CPU attention supports, so the tiny
models run on every backend.

Run a task's tiny preset, e.g. `python run_gsm8k.py`; this module has no entry point of its own.
"""

import hashlib
import json
import os
import shutil
import time

import torch
import torch.nn.functional as F

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


# -----------------------------------------------------------------------------
# Tokenizer and models

def word_tokenizer(words):
    """A word-level PreTrainedTokenizerFast over `words` (plus <pad> <bos> <eos> <unk>); text is split on
    \\w+|[^\\w\\s]+, so "####", "[" and ":" are tokens, and every prompt starts with <bos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIAL + list(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def tiny_llama(tokenizer, hidden, layers, max_len, seed, head_dim=32):
    """A small LlamaForCausalLM with random weights (tied embeddings; hidden / head_dim heads)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(tokenizer, hidden, layers, max_len, head_dim, tie_word_embeddings=True))


def tiny_classifier(tokenizer, hidden, layers, max_len, seed, head_dim=32):
    """A small LlamaForSequenceClassification with one label (a reward model), random weights; it scores
    the last token that is not padding."""
    from transformers import LlamaForSequenceClassification
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(_llama_config(tokenizer, hidden, layers, max_len, head_dim, num_labels=1))


def _llama_config(tokenizer, hidden, layers, max_len, head_dim, **extra):
    from transformers import LlamaConfig
    heads = hidden // head_dim
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       head_dim=head_dim, max_position_embeddings=max_len, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


# -----------------------------------------------------------------------------
# Supervised warm start

def collate(tokenizer, prompts, completions):
    """Right-padded (input_ids, attention_mask, labels) with labels = -100 outside the completion (+ EOS)."""
    rows = []
    for p_ids, c in zip(tokenizer(list(prompts))["input_ids"], completions):
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p_ids + c_ids, [-100] * len(p_ids) + c_ids))
    T = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (T - len(ids)) for ids, _ in rows])  # (N, T)
    labels = torch.tensor([lab + [-100] * (T - len(lab)) for _, lab in rows])  # (N, T)
    attention_mask = (torch.arange(T)[None] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()  # (N, T)
    return input_ids, attention_mask, labels


def sft(model, tokenizer, examples, steps, batch_size, lr, seed, log_every=100):
    """Cross-entropy on completion tokens of (prompt, completion) pairs; AdamW, linear warmup, cosine decay."""
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    bar = tqdm(range(steps), desc="sft", leave=False, disable=None)
    for step in bar:
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + torch.cos(torch.tensor(step / steps * torch.pi)).item())
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(len(examples), (batch_size,), generator=g).tolist()
        input_ids, attention_mask, labels = collate(tokenizer, *zip(*[examples[i] for i in idx]))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (N, T-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return loss.item()


# -----------------------------------------------------------------------------
# The cache

def cached(cache_dir, name, settings, build):
    """Path of a saved model for these settings: `build(path)` saves it there once; later calls reuse it.

    The folder is named by a hash of `settings` and written under a temporary name, then renamed, so an
    interrupted build leaves nothing half-written behind; two runs building the same thing at once both
    succeed."""
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(os.path.expanduser(cache_dir), f"{name}-{key}")
    if os.path.isfile(os.path.join(path, "settings.json")):
        print(f"{name}: reusing {path}")
        return path
    from transformers.utils import logging
    logging.disable_progress_bar()  # no "Writing model shards" bar in the log
    tmp = path + f".tmp{os.getpid()}"
    t0 = time.time()
    try:
        info = build(tmp) or {}
        with open(os.path.join(tmp, "settings.json"), "w") as f:
            json.dump({**settings, **info, "seconds": round(time.time() - t0, 1)}, f, indent=2)
        if os.path.exists(path):  # another run finished the same build first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: built in {time.time() - t0:.0f}s, cached in {path}")
    return path
