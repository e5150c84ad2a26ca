"""
SEARCHER side of TBA: generate, score, annotate, and ship trajectories; receive new weights.

A searcher process loops until told to stop:
    1. if the trainer published newer weights (policy or reference), copy them in;
    2. take the next `prompts_per_search` prompts of its own shard of the training set (cycling, reshuffled
       every pass);
    3. generate S = `samples_per_prompt` responses per prompt at the sampling temperature (optionally a
       random temperature per batch, for exploration, as the official code offers);
    4. score them with the task's scorer (loaded once in this process by `task.make_scorer`), and compute
       what the objective needs and is cheaper here than on the trainer: the reference log-prob (tagged with
       the reference version it came from, so the trainer can recompute it if the reference has since
       moved) and, for importance-ratio objectives only, the behaviour log-prob;
    5. put the batch of `Trajectory`s on its queue (with a timeout, re-checking the stop flag).

The loop talks to the trainer through a `link` (the transport), so the same loop serves one machine and
many. On one machine (rollout.QueueLink) weights travel through `rollout.SharedWeights`: one shared-memory
copy of the state dict plus a version counter, guarded by a lock; the trainer writes it at every sync and a
searcher copies it into its model when the version changed; batches go on a multiprocessing queue. Under
torchrun (distributed.StoreLink) batches go to the trainer's TCPStore as JSON and weights arrive over gloo.
Nothing is pickled per step.

Generation sits behind a small backend interface, `generate(prompt_ids, n, temperature, greedy) -> [ids]`
and `load_state_dict(tensors)`: `HFGenerator` here (transformers `generate` with KV cache; CPU or GPU) and
`vllm_backend.VLLMGenerator` (vLLM's engine, CPU or GPU build; imported only when --backend vllm is chosen).
Sampling is full-support (top_k=0, top_p=1), as TB requires of an off-policy sampler. `Policy` wraps the
same pieces for a task's evaluation.

Departures from the official code:
  1. Searchers never block on a barrier at sync time; the trainer merges whatever has arrived (see
     buffer.py for how the staleness of most-on-policy draws stays bounded).
  2. A searcher that raises exits non-zero with its traceback on stderr; the trainer notices within one
     step and stops the run (the official MPI code hangs).

Run it through a run_*.py script; this module has no entry point of its own.
"""

import math
import os
import random
from dataclasses import dataclass

import torch

from buffer import Trajectory
from loss import OBJECTIVE_INPUTS, make_batch, response_logprobs


# -----------------------------------------------------------------------------
# Models and weights

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


def dtype_of(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# -----------------------------------------------------------------------------
# Generation backends

class HFGenerator:
    """transformers `generate` (KV cache) on a model this process owns."""

    def __init__(self, model, tokenizer, max_new_tokens):
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens

    def load_state_dict(self, tensors):
        self.model.load_state_dict(tensors)

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature, greedy=False):
        """n responses per prompt (prompt-major order), each a list of ids ending in EOS unless truncated."""
        rows = [p for p in prompt_ids for _ in range(n)]
        input_ids, attention_mask, _ = make_batch(rows, [[]] * len(rows), self.tokenizer.pad_token_id)
        device = self.model.device
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=self.tokenizer.eos_token_id, **sampling)
        return [cut_at_eos(row, self.tokenizer.eos_token_id) for row in out[:, input_ids.shape[1]:].tolist()]


def cut_at_eos(ids, eos_id):
    """Keep tokens up to and including the first EOS (what follows is padding)."""
    return ids[:ids.index(eos_id) + 1] if eos_id in ids else ids


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
    finished: bool  # ended with EOS (False: cut at max_new_tokens)


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
        return completions(self.tokenizer, out)

    def logprobs(self, prompts, completions, model="policy"):
        """Sequence log-probs (at the loss temperature) of completions of prompts under the policy or the reference."""
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        net = self.model if model == "policy" else self.ref
        T = self.cfg.loss_temperature or self.cfg.temperature
        return score_logprobs(net, prompt_ids, [c.token_ids for c in completions], self.tokenizer.pad_token_id, T,
                              self.cfg.micro_batch)


def completions(tokenizer, responses):
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return [Completion(t, tuple(r), bool(r) and r[-1] == tokenizer.eos_token_id) for t, r in zip(texts, responses)]


# -----------------------------------------------------------------------------
# One search batch

class Searcher:
    """Turns query ids into scored, annotated Trajectories. Used by searcher processes and by --sync mode."""

    def __init__(self, cfg, task, generator, tokenizer, scorer, seed, policy=None, ref=None):
        """`policy` / `ref`: models to score behaviour / reference log-probs with (None: leave them to the trainer)."""
        self.cfg, self.task, self.generator, self.tokenizer, self.scorer = cfg, task, generator, tokenizer, scorer
        self.policy, self.ref = policy, ref
        self.prompt_ids = {}  # query id -> token ids, filled as prompts are first used
        self.rng = random.Random(seed)

    def temperature(self):
        lo, hi = self.cfg.temperature, self.cfg.temperature_max
        return lo if hi is None else self.rng.uniform(lo, hi)

    def search(self, query_ids, policy_version, ref_version):
        cfg, S = self.cfg, self.cfg.samples_per_prompt
        T = self.temperature()
        for q, ids in zip(query_ids, self.tokenizer([self.task.prompts[q] for q in query_ids])["input_ids"]):
            self.prompt_ids[q] = ids
        responses = self.generator.generate([self.prompt_ids[q] for q in query_ids], S, T)
        qids = [q for q in query_ids for _ in range(S)]
        done = completions(self.tokenizer, responses)
        rewards = self.scorer([self.task.prompts[q] for q in qids], [c.text for c in done],
                              [self.task.metas[q] for q in qids])
        if cfg.no_eos_reward is not None:  # a response cut at max_new_tokens gets the fixed penalty reward
            rewards = [r if c.finished else cfg.no_eos_reward for r, c in zip(rewards, done)]
        nan = [math.nan] * len(qids)
        prompts = [self.prompt_ids[q] for q in qids]
        pad = self.tokenizer.pad_token_id
        behavior = (score_logprobs(self.policy, prompts, responses, pad, cfg.loss_temperature or cfg.temperature, cfg.micro_batch,
                                   per_token=True) if self.policy is not None else [()] * len(qids))
        ref_logp = (score_logprobs(self.ref, prompts, responses, pad, cfg.loss_temperature or cfg.temperature,
                                   cfg.micro_batch) if self.ref is not None else nan)
        ref_version = ref_version if self.ref is not None else -1
        return [Trajectory(query_id=q, response_ids=tuple(r), reward=float(rw), policy_version=policy_version,
                           behavior_logp=math.fsum(b) if b else math.nan, behavior_token_logp=b, ref_logp=float(lr),
                           ref_version=ref_version)
                for q, r, rw, b, lr in zip(qids, responses, rewards, behavior, ref_logp)]


# -----------------------------------------------------------------------------
# The process

class PromptSampler:
    """Endless batches of query ids from one searcher's shard, reshuffled every pass; its state can be saved.
    With fewer prompts than searchers (red-teaming has one prompt), every searcher cycles through all of them."""

    def __init__(self, num_prompts, rank, world, batch_size, seed):
        self.shard = list(range(rank, num_prompts, world)) or list(range(num_prompts))
        self.batch_size = batch_size
        self.rng, self.order, self.pos = random.Random(seed), [], 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.order):
            self.order, self.pos = self.rng.sample(self.shard, len(self.shard)), 0
        batch = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state_dict(self):
        return {"rng": json_rng_state(self.rng.getstate()), "order": self.order, "pos": self.pos}

    def load_state_dict(self, state):
        self.rng.setstate(tuple_rng_state(state["rng"]))
        self.order, self.pos = state["order"], state["pos"]


def json_rng_state(state):
    """random.Random.getstate() as JSON-friendly lists."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def tuple_rng_state(state):
    version, internal, gauss = state
    return version, tuple(internal), gauss


def searcher_main(rank, cfg, task, seed, link):
    """The work of a searcher: a process started by rollout.searcher_process, or a torchrun rank started by
    distributed.searcher_rank_main. `link` is its connection to the trainer (rollout.QueueLink or
    distributed.StoreLink): link.alive() is False once the trainer said stop or is gone; link.pull(kind,
    model, version) copies newer "policy" or "ref" weights into the model and returns the version it holds;
    link.put(batch) sends a batch, waiting while the trainer's queue is full. An error exits it non-zero."""
    torch.set_num_threads(cfg.searcher_threads)
    torch.manual_seed(seed)
    device, dtype = cfg.searcher_devices[rank], dtype_of(cfg.dtype)
    if cfg.backend == "vllm" and device.startswith("cuda"):  # vLLM's engine takes the first visible GPU:
        index = int(device.split(":")[1]) if ":" in device else 0  # mask all but ours, before CUDA starts here
        os.environ["CUDA_VISIBLE_DEVICES"] = physical_device(os.environ.get("CUDA_VISIBLE_DEVICES"), index)
        device = "cuda:0"
    policy, tokenizer = load_model(cfg.model, device, dtype, cfg.trust_remote_code)
    inputs = OBJECTIVE_INPUTS[cfg.objective]
    ref = load_model(cfg.ref_model or cfg.model, device, dtype, cfg.trust_remote_code)[0] if "ref_logp" in inputs else None
    generator = make_generator(cfg, policy, tokenizer, seed, device)
    searcher = Searcher(cfg, task, generator, tokenizer, task.make_scorer(device), seed,
                        policy=policy if "behavior_logp" in inputs else None, ref=ref)
    version = ref_version = -1
    for query_ids in PromptSampler(len(task.prompts), rank, cfg.num_searchers, cfg.prompts_per_search, seed):
        if not link.alive():
            break
        new_version = link.pull("policy", policy, version)
        if new_version != version and generator.model is not policy:
            generator.load_state_dict(policy.state_dict())  # the backend's own copy (vLLM's engine)
        version = new_version
        if ref is not None:
            ref_version = link.pull("ref", ref, ref_version)
        batch = searcher.search(query_ids, version, ref_version)
        if not link.put(batch):
            break


def make_generator(cfg, policy, tokenizer, seed, device):
    if cfg.backend == "vllm":
        from vllm_backend import VLLMGenerator  # vLLM is optional: imported only when chosen
        return VLLMGenerator(cfg, policy, tokenizer, seed, device)
    return HFGenerator(policy, tokenizer, cfg.max_new_tokens)


def physical_device(mask, logical_index):
    """The CUDA_VISIBLE_DEVICES entry for our cuda:<logical_index>, given the mask this process inherited.

    Our device flags count the GPUs this process sees. A scheduler (Slurm, Kubernetes) may already have
    masked the machine's GPUs, e.g. CUDA_VISIBLE_DEVICES=4,6: then cuda:1 is GPU 6, not GPU 1. Entries may
    also be UUIDs (GPU-8c1e...) or MIG ids, kept as written. mask None: nothing masked, the index itself."""
    if mask is None:
        return str(logical_index)
    entries = [e.strip() for e in mask.split(",") if e.strip()]
    if not 0 <= logical_index < len(entries):
        raise ValueError(f"cuda:{logical_index} is not visible: CUDA_VISIBLE_DEVICES={mask!r} has {len(entries)} device(s)")
    return entries[logical_index]
