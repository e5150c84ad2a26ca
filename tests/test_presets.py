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
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "paper", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
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
