"""
Peak memory of one trainer step on a model with a real vocabulary: a random Qwen2-shaped model with Qwen2.5's
151,936-token vocabulary (tied embeddings), 8 rows of a 512-token prompt and a 64-token response, the VarGrad TB
loss, backward and an AdamW step, as tba.train_step computes them with --no-share-prompt (loss.response_logprobs;
the 8 rows have 8 different prompts, so there would be nothing to share). Each row of
the table runs in a fresh process; the number is how far the step's peak resident memory (ru_maxrss) rose above
what the process held just before it (VmRSS), so it counts activations, logits, gradients and the optimiser's
state (the model's weights were there before).

    full logits       the logits of every position, prompt included (the code before logits_to_keep)
    response logits   the logits of the response positions only (loss.response_logprobs today)
    + checkpointing   --gradient-checkpointing
    + LoRA            --lora-rank 8 on every linear layer (PEFT): gradients and AdamW state for the adapters only

The plan's estimate (ops/memory.py: gradients, AdamW state, activations and logits, the part of the trainer's
estimate a step adds) is checked against the same measurement for two model sizes (`plan_check`, and
tests/test_bench.py asserts it within 30%).

Run: python -m bench.memory            (CPU, about a minute; prints two markdown tables; Linux: /proc)
"""

import json
import resource
import subprocess
import sys

CASES = [("full logits", dict(full_logits=True)), ("response logits", {}),
         ("response logits + checkpointing", dict(checkpointing=True)), ("response logits + LoRA r=8", dict(lora=8)),
         ("response logits + LoRA r=8 + checkpointing", dict(lora=8, checkpointing=True))]
SHAPE = dict(vocab_size=151_936, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
ROWS, PROMPT, RESPONSE = 8, 512, 64


def step(full_logits=False, checkpointing=False, lora=0, shape=None):
    """One trainer step in this process; returns the peak memory it added and what the process held before (MiB)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from loss import response_logprobs, vargrad_tb_loss
    from ops.models import without_dropout
    torch.manual_seed(0)
    torch.set_num_threads(2)
    shape = shape or SHAPE
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_dropout(model).train()
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    net = model
    if full_logits:  # the forward without logits_to_keep: every position's logits
        net = lambda input_ids, attention_mask, position_ids: model(input_ids=input_ids, attention_mask=attention_mask,
                                                                    position_ids=position_ids)
        net.forward = net
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    input_ids = torch.randint(0, shape["vocab_size"], (ROWS, PROMPT + RESPONSE))
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros_like(input_ids)
    response_mask[:, PROMPT:] = 1
    before, loading_peak = resident_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logp = response_logprobs(net, input_ids, attention_mask, response_mask, temperature=0.7).sum(dim=1).view(2, ROWS // 2)
    loss = vargrad_tb_loss(logp, torch.zeros_like(logp), torch.rand_like(logp), beta=0.05)
    loss.backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak > loading_peak, "the model's creation peaked above the step: the step's peak is not measured"
    return peak - before, before


def resident_mib():
    """This process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


SIZES = {"small": dict(SHAPE, vocab_size=32_000, hidden_size=128, intermediate_size=512, num_hidden_layers=2),
         "large": dict(SHAPE, vocab_size=32_000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6)}


def measured(shape):
    """The peak memory (bytes) one step adds, measured in a fresh process (as the table's rows)."""
    code = f"import json, bench.memory as m; print(json.dumps(m.step(shape={shape!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])[0] * (1 << 20)


def estimated(shape):
    """What ops/memory.py's trainer estimate says such a step adds: gradients, AdamW state, activations and logits."""
    import types
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from ops.memory import Shape, trainer_estimate
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**shape)).parameters())
    kv = shape["num_key_value_heads"] * shape["hidden_size"] // shape["num_attention_heads"]
    cfg = types.SimpleNamespace(trainer_dtype="float32", lora_rank=0, gradient_checkpointing=False, micro_batch_prompts=ROWS,
                                responses_per_prompt=1, max_prompt_tokens=PROMPT, max_new_tokens=RESPONSE)
    plan = trainer_estimate(cfg, Shape(params, shape["num_hidden_layers"], shape["hidden_size"],
                                       shape["intermediate_size"], kv, shape["vocab_size"]), extra=0)
    return plan["gradients"] + plan["AdamW state"] + plan["activations and logits"]


def plan_check():
    """[(size, measured bytes, estimated bytes)] for SIZES."""
    return [(name, measured(shape), estimated(shape)) for name, shape in SIZES.items()]


def main():
    print(f"one trainer step: {ROWS} rows x ({PROMPT} prompt + {RESPONSE} response) tokens, vocabulary "
          f"{SHAPE['vocab_size']:,}, a random Qwen2 of width {SHAPE['hidden_size']} and {SHAPE['num_hidden_layers']} "
          f"layers, float32, 2 threads\n")
    print("| step | peak memory added by the step (MiB) | held before it: model, inputs (MiB) |")
    print("|---|---|---|")
    for name, kwargs in CASES:
        code = f"import json, bench.memory as m; print(json.dumps(m.step(**{kwargs!r})))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        added, held = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {added:,.0f} | {held:,.0f} |")
    print("\nthe memory plan's estimate of a step (ops/memory.py) against the same measurement, vocabulary 32,000\n")
    print("| model | measured (MiB) | estimate (MiB) | estimate / measured |")
    print("|---|---|---|---|")
    for name, got, guess in plan_check():
        print(f"| {name}: width {SIZES[name]['hidden_size']}, {SIZES[name]['num_hidden_layers']} layers | "
              f"{got / (1 << 20):,.0f} | {guess / (1 << 20):,.0f} | {guess / got:.2f} |")


if __name__ == "__main__":
    main()
