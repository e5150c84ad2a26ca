"""
The paper presets' code paths with tiny random models of the real architectures (GPT-NeoX, Llama), saved with
save_pretrained and loaded back through the same from_pretrained code, and the paper preset's dry run.

Run: python -m pytest -q tests/test_presets.py
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rewards import load_gsm8k
from tests.helpers import ROOT, _gsm8k_dir, _tiny_random_hf_model, read_metrics


@pytest.mark.parametrize("arch,cls", [("gpt_neox", "GPTNeoXForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_paper_preset_code_path_with_tiny_random_models(tmp_path, arch, cls):
    data_dir = _gsm8k_dir(tmp_path)
    rows = load_gsm8k(os.path.join(data_dir, "train.jsonl"))
    model_dir = _tiny_random_hf_model(arch, tmp_path / "model", [r["question"] + " " + r["answer"] for r in rows[:2000]])
    cmd = [sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "paper", "--model", model_dir,
           "--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--searcher-device", "cpu",
           "--backend", "hf", "--num-searchers", "1", "--trainer-threads", "1", "--searcher-threads", "1",
           "--steps", "3", "--batch-size", "4", "--responses-per-prompt", "2", "--samples-per-prompt", "2",
           "--prompts-per-search", "2", "--micro-batch-prompts", "1", "--initial-completions", "4",
           "--max-new-tokens", "8", "--eval-size", "6", "--warmup-steps", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [0, 1, 2] and all(np.isfinite(r["loss/train"]) for r in metrics)
    config = json.load(open(tmp_path / "run" / "final" / "config.json"))
    assert config["architectures"] == [cls]
    resolved = json.load(open(tmp_path / "run" / "config.json"))
    assert resolved["trainer_dtype"] == "float32" and resolved["beta_start"] == 0.014 and resolved["m"] == 0.95


def test_paper_preset_dry_run_prints_paper_values():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "paper", "--dry-run",
                          "--plan-for", "4x80"], capture_output=True, text=True, timeout=60)  # (the paper's 4 A100s)
    assert out.returncode == 0, out.stderr
    values = {k.strip(): v for k, v in (line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)}
    # the official GSM8K run (bbartoldson/TBA launch script, config and trainer), value for value
    want = {"model": "realtreetune/rho-1b-sft-GSM8K", "lr": "1e-05", "warmup_steps": "50", "stable_steps": "350",
            "decay_steps": "600", "lr_decay": "cosine", "grad_clip": "0.0", "temperature": "0.7",
            "max_new_tokens": "512", "batch_size": "140", "responses_per_prompt": "20", "samples_per_prompt": "24",
            "m": "0.95", "sync_every": "2", "beta_start": "0.014", "beta_end": "0.004", "beta_decay_steps": "500",
            "beta_stop_step": "None", "num_searchers": "3", "initial_completions": "500", "steps": "700",
            "max_prompt_tokens": "256", "capacity_per_prompt": "100", "prioritization": "uniform", "seed": "42",
            "loss_temperature": "None", "eval_every": "0", "prompts_per_search": "3", "weight_decay": "0.0"}
    assert {k: values[k].strip() for k in want} == want
    assert "process-to-device plan" in out.stdout and "searcher-2" in out.stdout


@pytest.mark.parametrize("script,flags", [("run_gsm8k.py", []), ("run_tldr.py", []), ("run_redteam.py", ["--model", "gpt2"])])
@pytest.mark.parametrize("machine", ["1x80", "4x80"])
def test_every_paper_preset_plans_to_fit_one_80gb_gpu_and_its_paper_hardware(script, flags, machine):
    """The memory plan of each paper preset, as it resolves on one 80 GiB GPU and on four (the paper's): every process's
    estimate printed, the trainer's precision named, and it fits. (Red-teaming's --model: GPT-2, the SFT's shape.)"""
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), "--preset", "paper", "--dry-run", "--plan-for",
                          machine, *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = out.stdout.split("memory plan")[1]
    n = int(machine[0])
    assert [line.split(":")[0].strip() for line in plan.splitlines() if " GiB  (" in line] == \
        ["trainer"] + [f"searcher-{i}" for i in range(max(1, n - 1))], plan
    precision = "float32" if script == "run_tldr.py" else "float32 weights and AdamW state, bfloat16 compute"
    assert f"trainer     : cuda:0 ({precision}," in out.stdout


def test_a_plan_that_does_not_fit_is_refused_in_one_line():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_tldr.py"), "--preset", "paper", "--dry-run", "--plan-for",
                          "1x16"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and [l.split(":")[0] for l in out.stdout.splitlines()] == ["warning"], out.stdout[-2000:]
    assert "not in the Hugging Face cache here" in out.stdout, "offline: the model's published shape, said so"
    [line] = out.stderr.splitlines()
    assert line.startswith("error: --plan-for 1x16: cuda:0: trainer, searcher-0 need ") and "of its 16 GiB (trainer: " in line
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_redteam.py"), "--preset", "paper", "--model", "gpt2",
                          "--dry-run", "--plan-for", "1x16"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().endswith("--micro-batch-prompts 1 would make it fit"), out.stderr


@pytest.mark.skipif(subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0,
                    reason="needs a private mount namespace (unshare -m, as root)")
def test_a_small_dev_shm_is_one_line_before_anything_spawns(tmp_path):
    """With a 64 KiB /dev/shm (a private mount, this test's alone) the run ends in one line naming /dev/shm, the size
    needed and the fix, exit 2, with nothing written or spawned."""
    run = [sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--run-dir", str(tmp_path / "run")]
    script = "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec " + " ".join(run)
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = out.stderr.splitlines()
    assert line.startswith("error: /dev/shm has 0.1 MiB free, and this run's searcher processes need 1.0 MiB there")
    assert line.endswith("(Docker: docker run --shm-size=1g)") and not os.path.exists(tmp_path / "run")


def test_paper_dry_run_on_a_simulated_one_gpu_machine_prints_its_plan(monkeypatch, capsys):
    """`--preset paper --dry-run` without --plan-for where one 80 GiB GPU is visible (torch.cuda's queries patched):
    the memory plan for that GPU, exit 0 (it raised UnboundLocalError on any machine with a GPU)."""
    import run_gsm8k
    from ops.launch import cli
    from tests.helpers import simulated_gpus
    simulated_gpus(monkeypatch, 1)
    code = cli(run_gsm8k.GSM8KConfig, run_gsm8k.PRESETS, run_gsm8k.main, ["--preset", "paper", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "memory plan (estimates; GPUs of 80 GiB):" in out and "cuda:0" in out


def test_dev_shm_need_counts_each_vllm_searchers_snapshot():
    """With --backend vllm each searcher writes a snapshot of the policy to /dev/shm at every sync (ops/vllm_backend.py):
    the need counts one per searcher, beside the host copies the trainer shares (policy and reference)."""
    from config import Config
    import dataclasses

    from ops.memory import SHM_FLOOR, lora_params, shape_of, shared_memory_bytes
    cfg = lambda backend: Config(backend=backend, num_searchers=2, searcher_dtype="bfloat16", searcher_device="cpu")
    params = 10 ** 9
    assert shared_memory_bytes(cfg("hf"), params) == SHM_FLOOR + params * 2 * 2  # (policy and reference, shared)
    assert shared_memory_bytes(cfg("vllm"), params) == SHM_FLOOR + params * 2 * (2 + 2)  # (and 2 snapshots)
    lora = dataclasses.replace(cfg("vllm"), lora_rank=16, model="realtreetune/rho-1b-sft-GSM8K")  # (--lora-sync adapter)
    adapters = lora_params(lora, shape_of(lora.model))
    assert shared_memory_bytes(lora, params) == SHM_FLOOR + params * 2 + adapters * 2 * (1 + 2)  # (the reference whole)
    assert shared_memory_bytes(dataclasses.replace(lora, lora_sync="merged"), params) == SHM_FLOOR + params * 2 * 4


def test_the_plan_counts_the_weights_the_trainer_shares_on_each_hf_searchers_gpu():
    """With --backend hf the trainer keeps a copy of the policy and the reference (RhoMath-1B in bfloat16: 4.1 GiB)
    on each searcher's GPU (ops/weights.SharedWeights): the plan counts it there, with a CUDA context on another
    GPU, and in the trainer's own entry on its GPU (it counted none of them)."""
    def plan_lines(machine):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "paper", "--dry-run",
                              "--plan-for", machine, "--backend", "hf"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("memory plan")[1].splitlines()
    four = plan_lines("4x80")
    for gpu in (1, 2, 3):
        assert any(l.startswith(f"trainer     : cuda:{gpu},    4.6 GiB  (weights shared with its searchers 4.1)")
                   for l in four), four
    one = [l for l in plan_lines("1x80") if l.startswith("trainer ")]
    assert len(one) == 1 and "weights shared with its searchers 4.1" in one[0] and " 53.2 GiB" in one[0], one
