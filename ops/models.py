"""
Models, the operations around them: load a policy, its reference and tokenizer (precision, LoRA, gradient
checkpointing), encode prompts, and the faster log-probs that the trainer and the searchers use in place of
loss.py's plain ones (--share-prompt: each prompt run once for its K responses; the same numbers, tested).
The algorithm does not live here: log-probs are loss.py's, generation is searcher.py's (`HFGenerator`).

    load_model(path, device, dtype)   AutoModelForCausalLM + AutoTokenizer, in eval mode, with a pad token
    load_trainer_models(cfg)          the policy and its reference (LoRA: one model, the adapters on and off)
    load_for_training(cfg, task)      the same, and the task without prompts over --max-prompt-tokens
    encode_prompts(tokenizer, texts)  prompt token ids, never with a second BOS (chat templates render one)
    PromptTokens(tokenizer, texts)    the same by index, each encoded on first use
    TokenLogprobs(temperature)        a logits processor: each generated token's log-prob, as generation runs
    stop_ids(model, tokenizer)        every id that ends a response: the tokenizer's EOS and the model's
                                      generation-config EOS ids (a chat model ends its turn with another id)
    policy_logprobs_fast(...)         loss.response_logprobs for Q prompts x K responses, each prompt run once
                                      (shared_prompt_logprobs: its KV cache repeated for its K responses)
    score_logprobs(model, ...)        no-grad log pi(y|x) (or per token) of (prompt, response) pairs, a micro-batch
                                      at a time, runs of one prompt run once with share_prompt
    completions(tokenizer, ids)       Completion records (text, ids, finished) of generated ids

Run it through a run_*.py script; this module has no entry point of its own.
"""

import contextlib
from dataclasses import dataclass

import torch

from config import ConfigError
from loss import make_batch, response_logprobs, takes_logits_to_keep, token_logprobs


# -----------------------------------------------------------------------------
# Loading

def load_model(path, device="cpu", dtype=torch.float32, trust_remote_code=False):
    """AutoModelForCausalLM + AutoTokenizer from a hub name or local dir, in eval mode, with a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()  # no "Loading weights" bar per model
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token; responses could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is always masked out, so any id will do
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer


def load_trainer_models(cfg):
    """The policy and its reference on the trainer's device, and the tokenizer: two models, or with --lora-rank
    one, whose adapters train and whose base (the adapters off) is the reference. With --gradient-checkpointing
    the policy recomputes activations in the backward (transformers does so in train mode only: the trainer
    switches it to train mode for the loss, and every dropout is off)."""
    policy, tokenizer = load_from_flag(cfg, "model", dtype_of(cfg.trainer_dtype))
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_dropout(policy)
    if cfg.lora_rank:
        from ops.lora import AdaptersOff, add_lora
        policy = add_lora(policy, cfg)
        return policy, AdaptersOff(policy), tokenizer
    ref, _ = load_from_flag(cfg, "ref_model" if cfg.ref_model else "model", dtype_of(compute_dtype(cfg)))  # (frozen)
    return policy, ref.requires_grad_(False), tokenizer


def load_for_training(cfg, task):
    """The trainer's (policy, reference, tokenizer, task): `load_trainer_models`, and the task without the prompts
    longer than --max-prompt-tokens (before any searcher sees them). Seeds torch with --seed first."""
    torch.manual_seed(cfg.seed)
    policy, ref, tokenizer = load_trainer_models(cfg)
    return policy, ref, tokenizer, drop_long_prompts(task, tokenizer, cfg.max_prompt_tokens)


def drop_long_prompts(task, tokenizer, max_tokens):
    """Skip prompts longer than max_tokens (counted and printed), before any searcher sees them."""
    if not max_tokens:
        return task
    keep = lambda prompts: [i for i, ids in enumerate(encode_prompts(tokenizer, prompts)) if len(ids) <= max_tokens]
    train_ids, eval_ids = keep(task.prompts), keep(task.eval_prompts)
    print(f"--max-prompt-tokens {max_tokens}: skipped {len(task.prompts) - len(train_ids)} of {len(task.prompts)} "
          f"training and {len(task.eval_prompts) - len(eval_ids)} of {len(task.eval_prompts)} held-out prompts")
    if not train_ids or not eval_ids:
        raise ConfigError(f"--max-prompt-tokens {max_tokens} leaves no training or no held-out prompts")
    return task.select(train_ids, eval_ids)


def load_from_flag(cfg, field, dtype):
    """load_model for --model or --ref-model on the trainer's device, a load failure being one line naming the flag."""
    path = getattr(cfg, field)
    try:
        return load_model(path, cfg.device, dtype, cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--{field.replace('_', '-')} {path}: cannot load it ({str(e).splitlines()[0]})") from None


def encode_prompts(tokenizer, texts):
    """Token ids of each prompt text, with the tokenizer's special tokens unless the text already starts with its
    BOS (a chat template renders it): never a second BOS."""
    bos = tokenizer.bos_token
    return [tokenizer(t, add_special_tokens=not (bos and t.startswith(bos)))["input_ids"] for t in texts]


class PromptTokens(dict):
    """Token ids of a task's prompts by prompt id, each encoded when first asked for: a run uses a fraction of a
    large training set, and encoding all of it up front delays the first step (docs/LOG.md, start-up)."""

    def __init__(self, tokenizer, prompts):
        super().__init__()
        self.tokenizer, self.prompts = tokenizer, prompts

    def __missing__(self, prompt_id):
        self[prompt_id] = encode_prompts(self.tokenizer, [self.prompts[prompt_id]])[0]
        return self[prompt_id]


def dtype_of(name):
    """The dtype weights are kept in (bf16-mixed: float32, with bfloat16 compute under `autocast`)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "bf16-mixed": torch.float32}[name]


def source_dtype(cfg):
    """The dtype of the checkpoint the run started from, as its config.json says (None: it says none, or it cannot
    be read): final/ is saved in it, so that a bfloat16 model comes out in bfloat16 (not twice its size in float32)."""
    from transformers import AutoConfig
    try:
        dtype = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code).dtype
    except (OSError, ValueError):
        return None
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def autocast(cfg, device):
    """bfloat16 compute on float32 weights under --trainer-dtype bf16-mixed (a no-op context otherwise)."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.trainer_dtype == "bf16-mixed")


def compute_dtype(cfg):
    """The trainer's compute dtype: what its frozen reference is kept in (bfloat16 under bf16-mixed)."""
    return "bfloat16" if cfg.trainer_dtype == "bf16-mixed" else cfg.trainer_dtype


# -----------------------------------------------------------------------------
# Generation and scoring

class TokenLogprobs:
    """A logits processor that records log softmax(logits / T) of each generated token, one step at a time (the
    logits of every step at once would be N x T x V: gigabytes for a large vocabulary). transformers runs it on the
    model's logits before the sampling temperature is applied; the token chosen at one step is read from the next
    step's input ids (and the last one from the output, by `finish`). searcher.HFGenerator passes it to
    `generate` (logits_processor=[recorder])."""

    def __init__(self, temperature):
        self.temperature, self.steps, self.last = temperature, [], None

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated):
        """`generated`: (N, T) the new tokens; their log-probs, (N, T) as nested lists."""
        self.steps.append(self.last.gather(1, generated[:, -1:].to(self.last.device)))
        token_logp, self.steps, self.last = torch.cat(self.steps, dim=1).cpu().tolist(), [], None
        return token_logp


def stop_ids(model, tokenizer):
    """Every token id that ends a response: the tokenizer's EOS and every EOS id of the model's generation
    config (chat models end a turn with another id, e.g. Qwen's <|im_end|> besides <|endoftext|>)."""
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    config_ids = [] if config_ids is None else [config_ids] if isinstance(config_ids, int) else list(config_ids)
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *config_ids]))  # (ordered, without repeats)


def cut_at_eos(ids, stop):
    """Keep tokens up to and including the first stop id (what follows is padding)."""
    end = next((i for i, t in enumerate(ids) if t in stop), None)
    return ids if end is None else ids[:end + 1]


@torch.no_grad()
def score_logprobs(model, prompt_tokens, responses, pad_id, temperature, micro_batch, per_token=False, share_prompt=False):
    """Log-probs of each (prompt, response) pair under `model`, micro_batch rows at a time: a list of
    log pi(y|x), or with per_token a list of per-token tuples (one log-prob per response token). share_prompt:
    rows that come in runs of one prompt run it once (shared_prompt_logprobs), whatever micro_batch is."""
    out = []
    for start, end, K in micro_batches(prompt_tokens, micro_batch, share_prompt and takes_logits_to_keep(model)):
        chunk, prompts = responses[start:end], prompt_tokens[start:end]
        if K > 1:
            token_logp = shared_prompt_logprobs(model, prompts[::K], chunk, pad_id, temperature).cpu()  # (n, R)
        else:
            batch = make_batch(prompts, chunk, pad_id)
            token_logp = response_logprobs(model, *(t.to(model.device) for t in batch), temperature).cpu()  # (n, R)
        if per_token:
            out += [tuple(row[:len(r)]) for row, r in zip(token_logp.tolist(), chunk)]
        else:
            out += token_logp.sum(dim=1).tolist()
    return out


def policy_logprobs_fast(cfg, model, prompts, responses, pad_id, K):
    """loss.response_logprobs (with grad) of Q prompts x K responses, prompt-major, each prompt run once for its K
    responses (shared_prompt_logprobs) where the model allows it: not under --gradient-checkpointing, which
    recomputes activations in train mode (`recomputing_activations`), and only for models that take
    `logits_to_keep`. Under --trainer-dtype bf16-mixed the forward computes in bfloat16 (`autocast`)."""
    with recomputing_activations(model, cfg.gradient_checkpointing), autocast(cfg, cfg.device):
        if cfg.share_prompt and not cfg.gradient_checkpointing and takes_logits_to_keep(model):
            return shared_prompt_logprobs(model, prompts[::K], responses, pad_id, cfg.score_temperature)
        batch = make_batch(prompts, responses, pad_id)
        return response_logprobs(model, *(b.to(cfg.device) for b in batch), cfg.score_temperature)


def micro_batches(prompts, size, share):
    """(start, end, K) of micro-batches of at most `size` rows. With share, each is made of runs of K rows with one
    prompt, K alike within it (a run longer than `size` is split; K = 1 where nothing repeats); else K = 1."""
    if not share:
        return [(i, min(i + size, len(prompts)), 1) for i in range(0, len(prompts), size)]
    out, i = [], 0
    while i < len(prompts):
        n = next((j for j in range(1, min(size, len(prompts) - i)) if prompts[i + j] != prompts[i]), min(size, len(prompts) - i))
        if out and out[-1][2] == n and out[-1][1] == i and out[-1][1] - out[-1][0] + n <= size:
            out[-1] = (out[-1][0], i + n, n)  # (another run of n rows: the same micro-batch)
        else:
            out.append((i, i + n, n))
        i += n
    return out


def shared_prompt_logprobs(model, prompts, responses, pad_id, temperature=1.0):
    """
    loss.response_logprobs for Q prompts with K responses each, every prompt run through the model once: the same
    (Q K, R) log-probs as response_logprobs on make_batch([each prompt K times], responses), in the same
    layout, for 1/K of the prompt's compute (half the step on the tiny GSM8K preset, whose prompts are ~6x its
    responses). prompts: Q token-id lists; responses: Q K token-id lists, prompt-major (K per prompt).

    The prompts' forward keeps its keys and values (transformers' KV cache, with grad); each is repeated for its
    K responses, which run on top of it, as generation does:
        prompts   [pad p1 p2 p3]            -> logits at p3 (predict r1) + the cache, repeated K times
        responses [r1 r2 pad] at positions 3, 4, 5, attending to [0 1 1 1 | 1 1 0]
    For a model transformers' way (a `logits_to_keep` argument and a cache), not under gradient checkpointing.
    """
    Q, device = len(prompts), next(model.parameters()).device
    K, P, R = len(responses) // Q, max(len(p) for p in prompts), max(len(r) for r in responses)
    if R == 0:
        return torch.zeros(len(responses), 0)
    prompt_tokens = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts], device=device)  # (Q, P)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model(input_ids=prompt_tokens, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(K)  # (Q K, ...): each prompt's keys and values for each of its responses
    targets = torch.tensor([list(r) + [pad_id] * (R - len(r)) for r in responses], device=device)  # (Q K, R)
    response_mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in responses], device=device)
    positions = prompt_mask.sum(dim=1).repeat_interleave(K)[:, None] + torch.arange(R, device=device)  # (Q K, R)
    attention = torch.cat([prompt_mask.repeat_interleave(K, dim=0), response_mask], dim=1)  # (Q K, P + R)
    logits = model(input_ids=targets, attention_mask=attention, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=R).logits  # (Q K, R, V)
    logits = torch.cat([out.logits.repeat_interleave(K, dim=0), logits[:, :-1]], dim=1)  # predict r1 .. rR
    token_logp = token_logprobs(logits, targets, temperature)  # (Q K, R)
    return torch.where(response_mask.bool(), token_logp, torch.zeros_like(token_logp))


# -----------------------------------------------------------------------------
# The policy as a task's evaluation sees it

@dataclass
class Completion:
    text: str  # decoded without special tokens
    token_ids: tuple  # generated ids, EOS included when generated
    finished: bool  # ended with a stop id (False: cut at max_new_tokens)


def completions(tokenizer, responses, stop=None):
    """Completion records of generated ids; `stop`: the ids that end a response (default: the tokenizer's EOS)."""
    stop = stop or (tokenizer.eos_token_id,)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return [Completion(t, tuple(r), bool(r) and r[-1] in stop) for t, r in zip(texts, responses)]


# -----------------------------------------------------------------------------
# Memory: gradient checkpointing (LoRA: ops/lora.py)

def without_dropout(model):
    """Every dropout off (nn.Dropout modules, and the dropout rates attention layers keep as floats), so that
    train mode, which transformers' gradient checkpointing needs, computes the same log-probs as eval mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


@contextlib.contextmanager
def recomputing_activations(model, on):
    """With --gradient-checkpointing (on), the block's forwards and backwards run in train mode, the only mode in
    which transformers recomputes activations (every dropout is off: `without_dropout`); eval mode after it."""
    model.train(on)
    try:
        yield
    finally:
        model.eval()
