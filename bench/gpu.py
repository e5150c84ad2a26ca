"""
One command that measures a GPU: `python -m bench.gpu` (from the repo root; no network, no vLLM).

For each paper preset's architecture (RhoMath-1B: Llama; Pythia-410M and Pythia-1B: GPT-NeoX; GPT-2), random
weights of the real shape and a word-level tokenizer of the real vocabulary size, both built here; then a short
async run of `python tba.py` with them (a trainer and one searcher on one GPU, the HF backend, the default GPU
precision: bf16-mixed trainer, bfloat16 searcher), and one table from its metrics.jsonl:

    trainer step    median seconds of a trainer step, and MFU: 6 x parameters x tokens / step time / the card's
                    dense bf16 peak (CARDS)
    searcher        generated tokens per second, against the memory-bandwidth bound of decoding: every decode
                    step of a batch of B sequences reads every weight once, so B x bandwidth / weight bytes
    weights         publish (trainer: into the shared copy) and pull (searcher: out of it) milliseconds
    memory          each process's peak (torch's on a GPU, the resident set on a CPU) against the memory plan's
                    estimate (ops/memory.py) for the same config

On a CPU it runs the same steps at small shapes (SMALL: a few layers, the real vocabularies) in a few minutes;
CI runs that. The GPU table belongs in docs/scaling.md with the card and the date.

`--weights`: instead, the weights' trip alone at RhoMath-1B's full shape (random weights): a publish into the shared
copy (ops/weights.SharedWeights, cast to the searchers' dtype) and a pull out of it in another process, in
milliseconds, for float32 and bfloat16 copies (on a CPU: shared memory; on a GPU: a CUDA buffer between processes).

Run: python -m bench.gpu [--steps N]        python -m bench.gpu --weights
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # the paper models' architectures (ops/memory.PAPER_SHAPES), by the names their presets use
    "RhoMath-1B (Llama)": "realtreetune/rho-1b-sft-GSM8K", "Pythia-410M (GPT-NeoX)": "EleutherAI/pythia-410m",
    "Pythia-1B (GPT-NeoX)": "mnoukhov/pythia1b-sft-tldr", "GPT-2": "gpt2"}
SMALL = dict(num_hidden_layers=2, n_layer=2, hidden_size=64, n_embd=64, intermediate_size=128, num_attention_heads=4,
             n_head=4, num_key_value_heads=2)  # on a CPU: these fields of each shape, the vocabulary kept
CARDS = {"H200": (989e12, 4.8e12), "H100 PCIe": (756e12, 2.0e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}
RUN = ["--sync-every", "2", "--eval-every", "0", "--eval-size", "4", "--log-every", "1000", "--lr", "1e-5",
       "--num-searchers", "1", "--backend", "hf", "--eval-holdout", "8", "--max-prompt-tokens", "64", "--micro-batch", "32"]
GPU_BATCH = ["--batch-size", "32", "--responses-per-prompt", "8", "--samples-per-prompt", "8", "--prompts-per-search", "4",
             "--micro-batch-prompts", "4", "--max-new-tokens", "64", "--initial-completions", "32"]
CPU_BATCH = ["--batch-size", "16", "--responses-per-prompt", "4", "--samples-per-prompt", "4", "--prompts-per-search", "4",
             "--micro-batch-prompts", "4", "--max-new-tokens", "16", "--initial-completions", "16"]


def build(name, out, gpu):
    """Random weights of the named architecture (full size on a GPU, SMALL on a CPU) and a tokenizer of its vocabulary,
    saved to `out`; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging
    import tiny
    logging.disable_progress_bar()
    from ops.memory import PAPER_SHAPES
    fields = dict(PAPER_SHAPES[SHAPES[name]])
    kind = fields.pop("model_type")
    if not gpu:
        fields.update({k: v for k, v in SMALL.items() if k in fields})
    tokenizer = tiny.word_tokenizer([f"w{i}" for i in range(fields["vocab_size"] - len(tiny.SPECIAL))])
    config = AutoConfig.for_model(kind, **fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):  # (random initialisation of a 1B model is slow on a CPU)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def data(out, vocab):
    """64 prompts of 32 random words, and a reward with some spread (the length of the completion, modulo 7)."""
    import random
    rng = random.Random(0)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": " ".join(f"w{rng.randrange(vocab - 4)}" for _ in range(32))}) + "\n")
    with open(os.path.join(out, "reward.py"), "w") as f:
        f.write("def reward(prompts, completions, **kwargs):\n    return [len(c) % 7 / 7 for c in completions]\n")


def run(name, steps, gpu):
    """The async run of one architecture; its table row."""
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        params = build(name, model, gpu)
        data(tmp, json.load(open(os.path.join(model, "config.json")))["vocab_size"])
        device = ["--device", "cuda:0", "--searcher-device", "cuda:0"] if gpu else ["--device", "cpu", "--searcher-device", "cpu"]
        cmd = [sys.executable, os.path.join(HERE, "tba.py"), "--model", model, "--dataset", os.path.join(tmp, "prompts.jsonl"),
               "--reward", os.path.join(tmp, "reward.py") + ":reward", "--run-dir", os.path.join(tmp, "run"),
               "--steps", str(steps), *device, *RUN, *(GPU_BATCH if gpu else CPU_BATCH)]
        t0 = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
        if out.returncode != 0:
            raise RuntimeError(f"{name}: the run failed (exit {out.returncode})\n{out.stderr[-3000:]}")
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "loss/train" in r]
        with open(os.path.join(tmp, "run", "config.json")) as f:
            cfg = json.load(f)
        return summarise(name, params, rows, cfg, model, time.time() - t0)


def summarise(name, params, rows, cfg, model, seconds):
    """A table row from a run's step records and resolved config."""
    import torch
    from ops.memory import plan
    from tasks.dataset import DatasetConfig
    steady = rows[len(rows) // 3:]  # (the first steps warm up)
    step_s = statistics.median(r["time/train"] for r in steady)
    tokens = statistics.mean(r["response/tokens"] for r in steady) + 33  # (+ the prompt: <bos> and 32 words)
    flops, bandwidth = card()
    mfu = 6 * params * tokens * cfg["batch_size"] / step_s / flops if flops else None
    tokens_s = steady[-1]["perf/tokens_per_s"]
    bound = cfg["prompts_per_search"] * cfg["samples_per_prompt"] * bandwidth / (2 * params) if bandwidth else None
    lines, _ = plan(DatasetConfig(**{**cfg, "model": model}), (torch.cuda.get_device_properties(0).total_memory
                                                                if torch.cuda.is_available() else 1 << 50))
    estimates = [float(line.split(",")[1].split("GiB")[0]) for line in lines if " GiB  (" in line]
    fmt = lambda x, f: "n/a" if x is None else f.format(x)
    return {"architecture": name, "parameters (M)": f"{params / 1e6:.0f}", "trainer step (s)": f"{step_s:.3f}",
            "MFU": fmt(mfu, "{:.1%}"), "searcher tokens/s": f"{tokens_s:.0f}", "bandwidth bound": fmt(bound, "{:.0f}"),
            "publish (ms)": f"{1e3 * statistics.median(r['time/publish'] for r in steady):.1f}",
            "pull (ms)": f"{1e3 * max(r['time/pull'] or 0 for r in steady):.1f}",
            "trainer peak / plan (GiB)": f"{fmt(rows[-1]['memory/trainer_gb'], '{:.2f}')} / "
                                         f"{fmt(estimates[0] if estimates else None, '{:.2f}')}",
            "searcher peak / plan (GiB)": f"{fmt(rows[-1]['memory/searcher_gb'], '{:.2f}')} / "
                                          f"{fmt(estimates[1] if len(estimates) > 1 else None, '{:.2f}')}",
            "run (s)": f"{seconds:.0f}"}


def card():
    """(dense bf16 FLOP/s, memory bandwidth in bytes/s) of this machine's GPU, or (None, None) for a CPU or a card not
    in CARDS."""
    import torch
    if not torch.cuda.is_available():
        return None, None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in CARDS.items() if k in name), (None, None))


def weights_trip(dtype, repeats=5, **smaller):
    """(publish ms, pull ms, versions held right): medians of `repeats` trips of RhoMath-1B's state dict through
    SharedWeights (its config's fields replaced by `smaller`, for a test), and how many of the versions the searcher
    pulled held exactly what the trainer published (every tensor filled with its version number)."""
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoConfig, AutoModelForCausalLM
    from ops.memory import PAPER_SHAPES
    from ops.weights import SharedWeights
    fields = {**PAPER_SHAPES[SHAPES["RhoMath-1B (Llama)"]], **smaller}
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model = model.to_empty(device=device).float()  # (random bytes: what they hold does not matter to a copy)
    ctx = mp.get_context("spawn")
    shared, results = SharedWeights(ctx), ctx.Queue()
    shared.allocate(model, 0, [device], dtype)
    child = ctx.Process(target=_puller, args=(shared, shared.tensors[device], results, repeats))
    child.start()
    publish = []
    for version in range(1, repeats + 1):
        results.get(timeout=600)  # (the child is ready for this version)
        with torch.no_grad():
            for t in model.state_dict().values():
                t.fill_(version)  # (exact in every dtype for these small integers)
        t0 = time.perf_counter()
        shared.publish(model, version)
        publish.append(1e3 * (time.perf_counter() - t0))
    pull, right = results.get(timeout=600)  # (the child's median, and its count of versions held exactly)
    child.join(timeout=60)
    return statistics.median(publish), pull, right


def _puller(shared, tensors, results, repeats):
    """The searcher's side of weights_trip: a model of the copy's dtype, a pull per published version."""
    import torch
    target = {n: torch.empty_like(t) for n, t in tensors.items()}
    model = type("Model", (), {"load_state_dict": lambda self, s: [target[n].copy_(t) for n, t in s.items()],
                               "state_dict": lambda self: target})()
    times, version, right = [], 0, 0
    for _ in range(repeats):
        results.put("ready")
        while shared.version.value == version:
            time.sleep(0.001)
        t0 = time.perf_counter()
        version = shared.pull(model, tensors, version)
        times.append(1e3 * (time.perf_counter() - t0))
        right += all(bool((t == version).all()) for t in target.values())
    results.put((statistics.median(times), right))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    import torch
    gpu = torch.cuda.is_available()
    if "--weights" in argv:
        print(f"RhoMath-1B's state dict through SharedWeights on {torch.cuda.get_device_name(0) if gpu else 'CPU'}, "
              f"{time.strftime('%Y-%m-%d')}, medians of 5\n\n| copy | publish (ms) | pull (ms) |\n|---|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            print(f"| {str(dtype)[6:]} | {'{:.0f} | {:.0f}'.format(*weights_trip(dtype)[:2])} |", flush=True)
        return
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else (12 if gpu else 4)
    machine = torch.cuda.get_device_name(0) if gpu else f"CPU ({os.cpu_count()} cores), small shapes"
    print(f"bench.gpu on {machine}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {steps} steps a run\n", flush=True)
    rows = [run(name, steps, gpu) for name in SHAPES]
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(r[c] for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
