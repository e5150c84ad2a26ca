"""
Helpers the process-level tests share: the tiny preset shrunk to seconds, its metrics read back strictly, the
process-tree checks of the fault tests (no orphan may outlive a run), and a simulated GPU machine.
"""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.path.join(ROOT, "..", "shared", "data", "gsm8k")  # real GSM8K, for tests only (never shipped)
# The shrunk preset's SFT: 80 steps make ~3% of sampled answers right (20 made ~1%, and a run with not one
# reward never moves: with pi = pi_ref and equal rewards every objective's gradient is exactly 0).
TINY_SFT = ["--tiny-train-size", "400", "--tiny-eval-size", "20", "--tiny-sft-steps", "80"]
TINY_RUN = [*TINY_SFT, "--eval-size", "20", "--initial-completions", "64", "--max-new-tokens", "24", "--log-every", "1"]


def traj(x, resp, reward=0.0, version=0):
    """A Trajectory of prompt x with response token ids `resp`, as the buffer tests make them."""
    from buffer import Trajectory
    return Trajectory(prompt_id=x, response_ids=tuple(resp), reward=reward, policy_version=version)


def gsm8k_cli(argv):
    """run_gsm8k.py's command line, in this process: its exit code."""
    import run_gsm8k
    from ops.launch import cli
    return cli(run_gsm8k.GSM8KConfig, run_gsm8k.PRESETS, run_gsm8k.main, argv)


def tiny_args(tmp_path, cache_dir, *extra):
    """A run of the tiny preset shrunk to seconds: an 80-step SFT on 400 problems (cached), a short RL run."""
    return [sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "tiny", "--cache-dir", str(cache_dir),
            "--run-dir", str(tmp_path / "run"), *TINY_RUN, *extra]


def read_metrics(tmp_path, evals=False):
    """The records of metrics.jsonl (strict JSON: no NaN): the training steps' only, or with the final
    evaluation's (evals=True)."""
    def no_nan(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [r for r in (json.loads(line, parse_constant=no_nan) for line in f) if evals or "loss/train" in r]


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def _popen(args):
    """A run in its own process group, unbuffered, with Ctrl-C enabled even if this shell ignores SIGINT."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _start_and_wait_for_training(tmp_path, cache_dir):
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "100000"))
    watchdog = threading.Timer(150, proc.kill)  # never hang the suite
    watchdog.start()
    for line in proc.stdout:  # the first metrics line: searchers are up and the trainer is stepping
        if re.search(r"step\s+\d+ \| loss", line):  # (tqdm's progress bar may share the line)
            watchdog.cancel()
            return proc
    raise AssertionError(f"the run ended before training (exit code {proc.wait()})")


def _descendants(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children, found = {}, []
    for p, pp in zip(out[::2], out[1::2]):
        children.setdefault(int(pp), []).append(int(p))
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _wait_gone(pids, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline and [p for p in pids if _alive(p)]:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _start_in_the_warm_start(tmp_path):
    """A run with a fresh cache, returned once the trainer is busy with a (long) SFT warm start while the
    searchers wait for their job; and the process family at that moment."""
    proc = _popen([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--cache-dir", str(tmp_path / "cache"),
                   "--run-dir", str(tmp_path / "run"), "--tiny-train-size", "400", "--tiny-sft-steps", "100000"])
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    for line in proc.stdout:
        if "SFT of a" in line:
            break
    watchdog.cancel()
    return proc, _descendants(proc.pid)


# -----------------------------------------------------------------------------
# Tiny random models of real architectures, saved with save_pretrained

def _gsm8k_dir(tmp_path):
    """The real GSM8K files when ../shared has them, else a few rows in the official format."""
    if os.path.isfile(os.path.join(GSM8K_DIR, "train.jsonl")):
        return GSM8K_DIR
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(1, 9) for b in range(1, 9)]
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(tmp_path)


def _bpe_tokenizer(arch, texts):
    """A small BPE tokenizer trained here, wrapped in the architecture's real tokenizer class."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXTokenizerFast, LlamaTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>" if arch == "llama" else None))
    if arch == "llama":  # sentencepiece-style: a metaspace BPE with <s> / </s>
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        specials = ["<unk>", "<s>", "</s>"]
    else:  # GPT-NeoX (Pythia): byte-level BPE with <|endoftext|>
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        specials = ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if arch != "llama" else [])
    tok.train_from_iterator(texts, trainer)
    if arch == "llama":
        return LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return GPTNeoXTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _tiny_random_hf_model(arch, out_dir, texts):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
    tokenizer = _bpe_tokenizer(arch, texts)
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=1024,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else GPTNeoXForCausalLM(GPTNeoXConfig(**shape))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


QWEN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_qwen2(out_dir, texts):
    """A tiny random Qwen2 as chat models ship: a byte-level BPE tokenizer with <|im_start|> / <|im_end|> and a
    chat template, EOS <|endoftext|>, and a generation config that also ends a turn at <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    torch.manual_seed(0)
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, eos_token_id=eos, pad_token_id=eos))
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eos], pad_token_id=eos)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def simulated_gpus(monkeypatch, n, gib=80):
    """A machine with n CUDA devices of `gib` GiB each, for the GPU branches CI has no GPU for: torch.cuda's queries
    answer as that machine would, and a tensor sent to cuda:N stays on the CPU, its bytes counted under "cuda:N" in
    the Counter returned (what each device would hold)."""
    allocated = collections.Counter()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=gib << 30, name=f"simulated GPU {i}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    to = torch.Tensor.to

    def to_cpu(tensor, *args, **kwargs):
        device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if device is None or not str(device).startswith("cuda"):
            return to(tensor, *args, **kwargs)
        args, kwargs = (("cpu", *args[1:]), kwargs) if "device" not in kwargs else (args, {**kwargs, "device": "cpu"})
        out = to(tensor, *args, **kwargs)
        allocated[str(device)] += out.numel() * out.element_size()
        return out
    monkeypatch.setattr(torch.Tensor, "to", to_cpu)
    return allocated
