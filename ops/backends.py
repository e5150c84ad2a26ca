"""
A searcher's models and its generation backend: the policy copy (inside the generator), the reference, the
tokenizer, on the searcher's device and in its dtype; HF `generate` (searcher.HFGenerator) or vLLM
(ops/vllm_backend.py, imported only when chosen: vLLM is optional).
"""

import torch

from ops.devices import claim_gpu
from ops.models import dtype_of, load_model


def load_searcher(cfg, rank, seed, hf_generator):
    """A searcher's models: (reference or None, tokenizer, generator, device), on its device (ops/devices.claim_gpu:
    vLLM takes the first visible GPU, so the others are masked) and in --searcher-dtype. The generator holds the
    policy: `hf_generator` (searcher.HFGenerator) on it, or with --backend vllm ops/vllm_backend.VLLMGenerator
    (imported only then: vLLM is optional). The reference is loaded only for objectives that read log pi_ref. Sets the
    process's torch threads (--searcher-threads) and seed first."""
    torch.set_num_threads(cfg.searcher_threads)
    torch.manual_seed(seed)
    device, dtype = claim_gpu(cfg, cfg.searcher_devices[rank]), dtype_of(cfg.searcher_dtype)
    policy, tokenizer = load_model(cfg.model, device, dtype, cfg.trust_remote_code)
    ref = (load_model(cfg.ref_model or cfg.model, device, dtype, cfg.trust_remote_code)[0]
           if "ref_logp" in cfg.needs else None)
    if cfg.backend == "vllm":
        from ops.vllm_backend import VLLMGenerator
        return ref, tokenizer, VLLMGenerator(cfg, policy, tokenizer, seed, device), device
    return ref, tokenizer, hf_generator(policy, tokenizer, cfg.max_new_tokens), device
