"""
What a sync costs with LoRA: the adapters alone (--lora-sync adapter, the default with vLLM searchers) against the
merged model (--lora-sync merged, and HF searchers): the bytes a publish copies into the searchers' shared copy and
the trainer's milliseconds for it (ops/weights.SharedWeights.publish, a merge of every adapter included for the
merged model), median of 10, rank-16 adapters on every linear layer, the searchers' dtype bfloat16. Two random
Llamas: the GSM8K tiny preset's shape, and RhoMath-1B's width and vocabulary with 2 of its 22 layers (the time of
all 22 is about 11 times that); then the bytes for the whole of RhoMath-1B, from its published shape.

Run: python -m bench.lora_sync      (CPU, about a minute; needs PEFT: requirements-extras.txt)
"""

import statistics
import time

import torch


def publish_ms(model, sent, repeats=10):
    """Bytes of one publish of `sent` (Adapters or Merged of `model`) and its median milliseconds."""
    import torch.multiprocessing as mp
    from ops.weights import SharedWeights
    shared = SharedWeights(mp.get_context("spawn"))
    shared.allocate(sent, 0, ["cpu"], torch.bfloat16)
    times = []
    for version in range(1, repeats + 1):
        t0 = time.perf_counter()
        shared.publish(sent, version)
        times.append(1e3 * (time.perf_counter() - t0))
    return sum(t.numel() * t.element_size() for t in shared.tensors["cpu"].values()), statistics.median(times)


def row(name, model, cfg):
    from ops.lora import Adapters, Merged, add_lora
    policy = add_lora(model, cfg)
    (merged_bytes, merged_ms), (adapter_bytes, adapter_ms) = (publish_ms(policy, kind(policy)) for kind in (Merged, Adapters))
    return (f"| {name} | {merged_bytes / 2**20:,.1f} | {adapter_bytes / 2**20:,.2f} | {merged_bytes / adapter_bytes:.0f}x "
            f"| {merged_ms:.1f} | {adapter_ms:.2f} |")


def main():
    import tiny
    from transformers import LlamaConfig, LlamaForCausalLM
    from config import Config
    from ops.memory import PAPER_SHAPES, lora_params, shape_of
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = Config(lora_rank=16, lora_alpha=32.0)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | merged (MiB) | adapters (MiB) | ratio | merged publish (ms) | adapter publish (ms) |\n|---|---|---|---|---|---|")
    tokenizer = tiny.word_tokenizer([str(i) for i in range(40)])
    print(row("GSM8K tiny preset's shape (random)", tiny.tiny_llama(tokenizer, hidden=64, layers=2, max_len=256, seed=0), cfg),
          flush=True)
    rho = {k: v for k, v in PAPER_SHAPES["realtreetune/rho-1b-sft-GSM8K"].items() if k != "model_type"}
    print(row("RhoMath-1B's shape, 2 of 22 layers (random)", LlamaForCausalLM(LlamaConfig(**{**rho, "num_hidden_layers": 2})), cfg))
    shape = shape_of("realtreetune/rho-1b-sft-GSM8K")
    merged, adapters = shape.params * 2, lora_params(cfg, shape) * 2
    print(f"\nRhoMath-1B, all 22 layers, bfloat16: {merged / 1e9:.2f} GB merged against {adapters / 1e6:.1f} MB of "
          f"adapters a sync ({merged / adapters:.0f}x less)")


if __name__ == "__main__":
    main()
