"""
A memory plan before anything loads: per process (the trainer, each searcher), an estimate of its GPU memory,
and whether the processes that share a GPU fit on it. `--dry-run` prints the plan for the visible GPUs, or for a
stated machine with `--plan-for 1x80` (one 80 GiB GPU) or `4x80`; a run whose plan does not fit the visible GPUs
is refused before anything loads, naming the process, its estimate, the GPU's memory and a flag that would fit.

What is counted (bytes; P parameters, B the dtype's bytes, rows x tokens the micro-batch):
    trainer    weights P B_keep, gradients and AdamW's two moments 3 P_trained B_keep, the frozen reference
               P B_compute, then the larger of a step's transients and an evaluation's models (loaded for the
               evaluation and freed after it): activations layers x rows x tokens x (10 h + 4 i) B_compute (with
               --gradient-checkpointing: one layer's, plus h per token per layer) and the loss's logits at the
               response positions rows x (R + 1) x V x (B_compute + 8) (a float32 copy and its log-softmax);
               a CUDA context
    searcher   the policy (and the reference, if the objective reads it) in the searchers' dtype, the KV cache
               of one generation batch (HF), or vLLM's share of its GPU with vLLM's own copy inside it, the
               reference forward's logits, the task's reward models, a CUDA context
Model shapes come from a local directory's config.json, the Hugging Face cache, or the paper models' shapes
below (`PAPER_SHAPES`, their published configs), instantiated on the meta device to count parameters exactly.
An estimate, not a measurement: bench/memory.py checks it against the measured peak of a step on CPU.

Where processes share a GPU, a vLLM searcher's share (--vllm-gpu-memory-utilization) is lowered to what the
others leave (printed with the plan), never below what vLLM needs for its weights and one batch's KV cache.

Run: python run_gsm8k.py --preset paper --dry-run --plan-for 1x80
"""

import dataclasses
import os
import re

from config import ConfigError
from ops.lora import adapter_sync

GIB = 1 << 30
CUDA_CONTEXT = GIB // 2  # what a process's CUDA context and allocator take before its first tensor
VLLM_OVERHEAD = GIB  # vLLM's activations and CUDA graphs, besides its weights and KV cache
USABLE = 0.95  # the fraction of a GPU's memory a plan may fill (fragmentation, the driver)
BYTES = {"float32": 4, "bf16-mixed": 4, "bfloat16": 2, "float16": 2}

# The paper presets' models (their Hugging Face configs, as published), so that a plan needs no download.
PAPER_SHAPES = {
    "realtreetune/rho-1b-sft-GSM8K": dict(model_type="llama", hidden_size=2048, intermediate_size=5632,
                                          num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                                          vocab_size=32000, tie_word_embeddings=False),  # RhoMath-1B (TinyLlama)
    "mnoukhov/pythia1b-sft-tldr": dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
                                       num_hidden_layers=16, num_attention_heads=8, vocab_size=50304),  # Pythia-1B
    "mnoukhov/pythia1b-rm-tldr6.9b": dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
                                          num_hidden_layers=16, num_attention_heads=8, vocab_size=50304, head="cls"),
    "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr": dict(
        model_type="gpt_neox", hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
        vocab_size=50432, head="cls"),  # Pythia-6.9B
    "EleutherAI/pythia-410m": dict(model_type="gpt_neox", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                   num_attention_heads=16, vocab_size=50304),
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257),  # Lee et al.'s attacker
    "vicgalle/gpt2-alpaca": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50260),
    "facebook/roberta-hate-speech-dynabench-r4-target": dict(model_type="roberta", hidden_size=768, num_hidden_layers=12,
                                                             num_attention_heads=12, intermediate_size=3072,
                                                             vocab_size=50265, head="cls"),
}


@dataclasses.dataclass
class Shape:
    """What the plan needs of a model."""
    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # key/value width per layer (heads x head dim; fewer heads with grouped queries)
    vocab: int


def shape_of(path, head="lm"):
    """The Shape of a model (a hub id or a local directory), or None when neither it nor its config is at hand.
    head "cls": a reward model / classifier (a score head instead of the vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging
    logging.set_verbosity_error()
    known = dict(PAPER_SHAPES.get(path, {}))
    head = known.pop("head", head)
    try:  # (the paper's shapes, else a local directory or the Hugging Face cache: never the network)
        config = AutoConfig.for_model(known.pop("model_type"), **known) if known else \
            AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None
    if head == "cls":
        config.num_labels = 1  # (a reward model's score head)
    with torch.device("meta"):
        model = (AutoModelForSequenceClassification if head == "cls" else AutoModelForCausalLM).from_config(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return Shape(params=sum(p.numel() for p in model.parameters()), layers=config.num_hidden_layers, hidden=hidden,
                 intermediate=intermediate, kv_dim=kv_heads * hidden // heads, vocab=config.vocab_size)


# -----------------------------------------------------------------------------
# Estimates, per process

def prompt_tokens(cfg):
    """The longest prompt the plan assumes: --max-prompt-tokens, else the task's own limit, else 256."""
    return cfg.max_prompt_tokens or getattr(cfg, "query_tokens", 0) or 256


def trainer_estimate(cfg, shape, extra):
    """{component: bytes} of the trainer process; `extra`: its evaluation models' bytes."""
    keep, compute = BYTES[cfg.trainer_dtype], BYTES[cfg.trainer_dtype if cfg.trainer_dtype != "bf16-mixed" else "bfloat16"]
    trained = lora_params(cfg, shape) if cfg.lora_rank else shape.params
    rows, tokens = cfg.micro_batch_prompts * cfg.responses_per_prompt, prompt_tokens(cfg) + cfg.max_new_tokens
    per_layer = (10 * shape.hidden + 4 * shape.intermediate) * compute  # per token: what one layer keeps for backward
    layers = 1 if cfg.gradient_checkpointing else shape.layers
    activations = rows * tokens * (layers * per_layer + shape.layers * shape.hidden * compute * cfg.gradient_checkpointing)
    step = activations + rows * (cfg.max_new_tokens + 1) * shape.vocab * (compute + 8)  # (+ the loss's logits)
    return {"weights": shape.params * keep + trained * keep * bool(cfg.lora_rank), "gradients": trained * keep,
            "AdamW state": 2 * trained * keep, "reference": 0 if cfg.lora_rank else shape.params * compute,
            # a training step's activations and logits, or an evaluation's models: never both at once
            "activations and logits" if step >= extra else "evaluation models": max(step, extra)}


def lora_params(cfg, shape):
    """The adapters' parameters: rank x (in + out) per adapted matrix (every linear layer: q, k, v, o, the MLP's)."""
    per_layer = 2 * 2 * shape.hidden + 2 * (shape.hidden + shape.kv_dim) + 3 * (shape.hidden + shape.intermediate)
    return cfg.lora_rank * per_layer * shape.layers


def searcher_estimate(cfg, shape, extra, vllm_bytes=0):
    """{component: bytes} of one searcher process; `extra`: its reward models' bytes; `vllm_bytes`: vLLM's share."""
    b = BYTES[cfg.searcher_dtype]
    rows, tokens = cfg.prompts_per_search * cfg.samples_per_prompt, prompt_tokens(cfg) + cfg.max_new_tokens
    kv_cache = 2 * shape.layers * shape.kv_dim * b * rows * tokens
    score_rows = min(cfg.micro_batch, rows)
    return {"policy": shape.params * b, "reference": shape.params * b * ("ref_logp" in cfg.needs),
            "generation": vllm_bytes if cfg.backend == "vllm" else kv_cache,
            "logits": score_rows * (cfg.max_new_tokens + 1) * shape.vocab * b + LOGITS_CHUNK * (cfg.max_new_tokens + 1)
            * shape.vocab * 8, "reward models": extra}


LOGITS_CHUNK = 8  # rows whose float32 log-softmax a no-grad scoring forward holds at once (models.token_logprobs)


def vllm_need(cfg, shape):
    """The least vLLM can run on: its weights, one generation batch's KV cache, its overhead."""
    b = BYTES[cfg.searcher_dtype]
    rows, tokens = cfg.prompts_per_search * cfg.samples_per_prompt, prompt_tokens(cfg) + cfg.max_new_tokens
    return shape.params * b + 2 * shape.layers * shape.kv_dim * b * rows * tokens + VLLM_OVERHEAD


def models_bytes(paths, dtype):
    """Bytes of the task's extra models ([(path, head)]) in `dtype`; unknown ones count 0 (named by the plan)."""
    shapes = [(p, shape_of(p, head)) for p, head in paths]
    return sum(s.params * BYTES[dtype] for _, s in shapes if s), [p for p, s in shapes if s is None]


# -----------------------------------------------------------------------------
# The plan: processes per GPU, and whether they fit

def parse_plan_for(text):
    """--plan-for NxG: N GPUs of G GiB each."""
    match = re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)", text)
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"--plan-for {text}: expected NxG, N GPUs of G GiB (e.g. 1x80, 4x80)")
    return int(match.group(1)), float(match.group(2)) * GIB


def plan(cfg, gpu_bytes):
    """The memory plan of a resolved config on GPUs of `gpu_bytes` each: (per-process lines, problems: a line per GPU
    that does not fit); the vLLM share is lowered where processes share a GPU (set on cfg, and a line says so)."""
    shape = shape_of(cfg.model) if cfg.model else None
    if shape is None:
        return [f"memory plan: the shape of --model {cfg.model or '(built by the task)'} is not at hand; no estimate"], []
    extra = cfg.extra_models()
    trainer_extra, unknown_t = models_bytes(extra.get("trainer", []), cfg.searcher_dtype)
    searcher_extra, unknown_s = models_bytes(extra.get("searcher", []), cfg.searcher_dtype)
    processes = [("trainer", cfg.device, trainer_estimate(cfg, shape, trainer_extra))]
    if not cfg.sync:
        processes += [(f"searcher-{r}", d, searcher_estimate(cfg, shape, searcher_extra))
                      for r, d in enumerate(cfg.searcher_devices)]
    add_shared_copies(cfg, shape, processes)
    share = fit_vllm(cfg, shape, processes, gpu_bytes)
    lines = [f"--vllm-gpu-memory-utilization {cfg.vllm_gpu_memory_utilization} -> {share:.3f}: what the processes "
             f"sharing its GPU leave"] if share is not None else []
    cfg.vllm_gpu_memory_utilization = share if share is not None else cfg.vllm_gpu_memory_utilization
    lines += [f"{name:<12}: {device}, {total(est) / GIB:6.1f} GiB  ({', '.join(f'{k} {v / GIB:.1f}' for k, v in est.items() if v)})"
             for name, device, est in processes]
    lines += [f"not counted (shape not at hand): {', '.join(unknown_t + unknown_s)}"] if unknown_t + unknown_s else []
    return lines, problems(processes, gpu_bytes)


def add_shared_copies(cfg, shape, processes):
    """What the trainer allocates on each HF searcher's GPU (ops/weights.SharedWeights): a copy of the policy, and of
    the reference if the objective reads it, in the searchers' dtype; on another GPU than its own, with a CUDA
    context there (`total`). vLLM searchers' copies are in host memory (/dev/shm: check_shared_memory)."""
    if cfg.sync or cfg.backend == "vllm":
        return
    copies = shape.params * BYTES[cfg.searcher_dtype] * (1 + ("ref_logp" in cfg.needs))
    for device in dict.fromkeys(d for d in cfg.searcher_devices if d.startswith("cuda")):
        if device == cfg.device:
            processes[0][2]["weights shared with its searchers"] = copies  # (the trainer's entry, its own GPU)
        else:
            processes.append(("trainer", device, {"weights shared with its searchers": copies}))


def total(estimate):
    return sum(estimate.values()) + CUDA_CONTEXT


def fit_vllm(cfg, shape, processes, gpu_bytes):
    """Give the vLLM searchers of each GPU --vllm-gpu-memory-utilization, or less where the GPU's other processes
    leave less, never below what vLLM needs; returns the lowered share (the smallest over GPUs), or None."""
    if cfg.backend != "vllm" or cfg.sync:
        return None
    shares = []
    for device in {d for _, d, _ in processes}:
        here = [est for name, d, est in processes if d == device]
        vllm = [est for name, d, est in processes if d == device and name.startswith("searcher")]
        left = USABLE * gpu_bytes - sum(map(total, here))  # (their generation is 0 until given a share)
        share = min(cfg.vllm_gpu_memory_utilization, max(left, 0) / len(vllm) / gpu_bytes) if vllm else None
        if vllm:
            shares.append(max(share, vllm_need(cfg, shape) / gpu_bytes))
            for est in vllm:
                est["generation"] = shares[-1] * gpu_bytes
    return round(min(shares), 3) if shares and min(shares) < cfg.vllm_gpu_memory_utilization else None


def problems(processes, gpu_bytes):
    """A line per GPU whose processes do not fit, naming the largest of them."""
    out = []
    for device in sorted({d for _, d, _ in processes if d.startswith("cuda")}):
        here = [(name, total(est)) for name, d, est in processes if d == device]
        need = sum(t for _, t in here)
        if need > USABLE * gpu_bytes:
            name, biggest = max(here, key=lambda x: x[1])
            out.append(f"{device}: {', '.join(n for n, _ in here)} need {need / GIB:.1f} GiB of its {gpu_bytes / GIB:.0f} "
                       f"GiB ({name}: {biggest / GIB:.1f} GiB)")
    return out


def peak_memory(device):
    """The most memory this process has held: on a GPU, what torch allocated there; on a CPU, its peak resident set."""
    import torch
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)


# -----------------------------------------------------------------------------
# /dev/shm: what the searcher processes share on one machine

SHM = "/dev/shm"
SHM_FLOOR = 1 << 20  # the processes' semaphores, queue and counter pages (a tmpfs page each), with room to spare


def shared_device(cfg, device):
    """Where a searcher's copy of the weights lives: on its device, but in host shared memory for vLLM on a GPU."""
    return "cpu" if cfg.backend == "vllm" else device


def shared_memory_bytes(cfg, params=None):
    """What a run puts in /dev/shm: the searcher processes' semaphores and counters, the copy of the policy (and
    the reference, if the objective reads it) that the trainer shares with searchers whose copy is on the host
    (`shared_device`), and with the vLLM backend each searcher's snapshot of the policy, which it
    writes there to reload its engine at every sync (ops/vllm_backend.py), all in the searchers' dtype; with LoRA
    and --lora-sync adapter, the policy's copy and snapshots are its adapters.
    params: the policy's parameter count, if known."""
    if cfg.sync:
        return 0
    host = any(shared_device(cfg, d) == "cpu" for d in cfg.searcher_devices)
    snapshots = cfg.num_searchers if cfg.backend == "vllm" else 0  # (at once, in the worst case)
    needed = (host or snapshots) and cfg.model
    from_dir = params is None and os.path.isdir(cfg.model)  # (a local model's count: its safetensors headers)
    shape = shape_of(cfg.model) if needed and (adapter_sync(cfg) or params is None and not from_dir) else None
    if needed and params is None:
        params = local_params(cfg.model) if from_dir else shape.params if shape else None
    sent = lora_params(cfg, shape) if adapter_sync(cfg) and shape else params  # (what a publish copies there)
    ref = ("ref_logp" in cfg.needs) * host
    return SHM_FLOOR + BYTES[cfg.searcher_dtype] * ((sent or 0) * (host + snapshots) + (params or 0) * ref)


def local_params(path):
    """The parameters of a save_pretrained directory, from its safetensors headers (nothing loaded), or None."""
    import glob
    import json
    import math
    import struct
    files = glob.glob(os.path.join(path, "*.safetensors"))
    total = 0
    for name in files:
        with open(name, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total if files else None


def check_shared_memory(cfg, params=None, path=SHM):
    """Refuse (one line, naming /dev/shm, what is needed and the fix) a run that /dev/shm cannot hold."""
    import shutil
    need, free = shared_memory_bytes(cfg, params), shutil.disk_usage(path).free
    if need > free:
        mib = 1 << 20
        raise ConfigError(f"{path} has {free / mib:.1f} MiB free, and this run's searcher processes need "
                          f"{need / mib:.1f} MiB there (their semaphores, and the weights they share on this host): "
                          f"enlarge it (Docker: docker run --shm-size={max(1, -(-2 * need // GIB))}g)")


REMEDIES = [("num_searchers", 1, "--num-searchers 1"), ("micro_batch_prompts", 1, "--micro-batch-prompts 1"),
            ("gradient_checkpointing", True, "--gradient-checkpointing"), ("lora_rank", 16, "--lora-rank 16"),
            ("vllm_gpu_memory_utilization", 0.05, "--vllm-gpu-memory-utilization 0.05")]


def remedy(unresolved, gpu_bytes, resolve):
    """The first single flag of REMEDIES with which the plan fits (None if none does); `resolve(cfg)` resolves the
    'auto' fields of a copy of the unresolved config, as the plan's own were."""
    for field, value, flag in REMEDIES:
        if getattr(unresolved, field) != value and not plan(resolve(dataclasses.replace(unresolved, **{field: value})),
                                                               gpu_bytes)[1]:
            return flag
    return None
