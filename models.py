"""
Models: load a policy, generate with it, score log-probs with it. Shared by the trainer (tba.py), the
searchers (searcher.py) and the tasks' evaluations (rewards.py, tasks/).

    load_model(path, device, dtype)   AutoModelForCausalLM + AutoTokenizer, in eval mode, with a pad token
    HFGenerator                       transformers `generate` with a KV cache: n responses per prompt, cut at
                                      the first stop id; the searchers' default backend (ops/vllm_backend.py
                                      has the same interface: generate(prompt_ids, n, temperature, greedy),
                                      load_state_dict(tensors), stop_ids)
    stop_ids(model, tokenizer)        every id that ends a response: the tokenizer's EOS and the model's
                                      generation-config EOS ids (a chat model ends its turn with another id)
    score_logprobs(model, ...)        no-grad log pi(y|x) of (prompt, response) pairs, a micro-batch at a time
    Policy                            text in, text out: what a task's `evaluate` works with

Sampling is full-support (top_k=0, top_p=1), as TB requires of an off-policy sampler.

Run it through a run_*.py script; this module has no entry point of its own.
"""

from dataclasses import dataclass

import torch

from config import ConfigError
from loss import make_batch, response_logprobs


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


def load_from_flag(cfg, field):
    """load_model for --model or --ref-model on the trainer's device, a load failure being one line naming the flag."""
    path = getattr(cfg, field)
    try:
        return load_model(path, cfg.device, dtype_of(cfg.dtype), cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--{field.replace('_', '-')} {path}: cannot load it ({str(e).splitlines()[0]})") from None


def dtype_of(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# -----------------------------------------------------------------------------
# Generation and scoring

class HFGenerator:
    """transformers `generate` (KV cache) on a model this process owns."""

    def __init__(self, model, tokenizer, max_new_tokens):
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.stop_ids = stop_ids(model, tokenizer)

    def load_state_dict(self, tensors):
        self.model.load_state_dict(tensors)

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature, greedy=False):
        """n responses per prompt (prompt-major order), each a list of ids ending in a stop id unless truncated."""
        rows = [p for p in prompt_ids for _ in range(n)]
        input_ids, attention_mask, _ = make_batch(rows, [[]] * len(rows), self.tokenizer.pad_token_id)
        device = self.model.device
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=list(self.stop_ids), **sampling)
        return [cut_at_eos(row, self.stop_ids) for row in out[:, input_ids.shape[1]:].tolist()]


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
def score_logprobs(model, prompt_ids, responses, pad_id, temperature, micro_batch, per_token=False):
    """Log-probs of each (prompt, response) pair under `model`, micro_batch rows at a time: a list of
    log pi(y|x), or with per_token a list of per-token tuples (one log-prob per response token)."""
    out = []
    for i in range(0, len(responses), micro_batch):
        chunk = responses[i:i + micro_batch]
        batch = make_batch(prompt_ids[i:i + micro_batch], chunk, pad_id)
        token_logp = response_logprobs(model, *(t.to(model.device) for t in batch), temperature).cpu()  # (n, R)
        if per_token:
            out += [tuple(row[:len(r)]) for row, r in zip(token_logp.tolist(), chunk)]
        else:
            out += token_logp.sum(dim=1).tolist()
    return out


# -----------------------------------------------------------------------------
# The policy as a task's evaluation sees it

@dataclass
class Completion:
    text: str  # decoded without special tokens
    token_ids: tuple  # generated ids, EOS included when generated
    finished: bool  # ended with a stop id (False: cut at max_new_tokens)


class Policy:
    """The trained policy and its reference, text in and out: what `Task.evaluate` works with."""

    def __init__(self, cfg, model, ref, tokenizer):
        self.cfg, self.model, self.ref, self.tokenizer = cfg, model, ref, tokenizer
        self.generator = HFGenerator(model, tokenizer, cfg.max_new_tokens)

    def generate(self, prompts, n=1, temperature=1.0, greedy=False):
        """n completions per prompt (prompt-major), eval_batch_size rows per generate call."""
        rows = [ids for ids in self.tokenizer(list(prompts))["input_ids"] for _ in range(n)]
        out = []
        for i in range(0, len(rows), self.cfg.eval_batch_size):
            out += self.generator.generate(rows[i:i + self.cfg.eval_batch_size], 1, temperature, greedy)
        return completions(self.tokenizer, out, self.generator.stop_ids)

    def logprobs(self, prompts, completions, model="policy"):
        """Sequence log-probs (at the loss temperature) of completions of prompts under the policy or the reference."""
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        net = self.model if model == "policy" else self.ref
        T = self.cfg.loss_temperature or self.cfg.temperature
        return score_logprobs(net, prompt_ids, [c.token_ids for c in completions], self.tokenizer.pad_token_id, T,
                              self.cfg.micro_batch)


def completions(tokenizer, responses, stop=None):
    """Completion records of generated ids; `stop`: the ids that end a response (default: the tokenizer's EOS)."""
    stop = stop or (tokenizer.eos_token_id,)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return [Completion(t, tuple(r), bool(r) and r[-1] in stop) for t, r in zip(texts, responses)]
