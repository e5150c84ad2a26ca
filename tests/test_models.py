"""
ops/models.py, searcher.HFGenerator and loss.py with real architectures: a chat model's every EOS id ends a
response (both backends read stop_ids), and sequence log-probs computed from the response positions' logits alone equal those from every
position's. Tiny random models saved with save_pretrained and loaded back through from_pretrained.

Run: python -m pytest -q tests/test_models.py
"""

import os

import pytest
import torch

from loss import make_batch, response_logprobs
from ops.models import completions, cut_at_eos, load_model, score_logprobs, shared_prompt_logprobs, stop_ids
from searcher import HFGenerator
from tests.helpers import _bpe_tokenizer, _tiny_qwen2, _tiny_random_hf_model

TEXTS = ["yes no maybe yes", "the cat says yes", "hello world, hello you"] * 20


def test_every_eos_id_of_a_chat_model_ends_a_response(tmp_path):
    model, tokenizer = load_model(_tiny_qwen2(tmp_path / "qwen", TEXTS))
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    assert stop_ids(model, tokenizer) == (eos, im_end), "the tokenizer's EOS, then the generation config's others"
    assert cut_at_eos([5, 6, im_end, 7, eos], (eos, im_end)) == [5, 6, im_end]
    assert cut_at_eos([5, 6, 7], (eos, im_end)) == [5, 6, 7], "a truncated response is kept whole"
    done = completions(tokenizer, [[5, im_end], [5, eos], [5, 6]], (eos, im_end))
    assert [c.finished for c in done] == [True, True, False]
    generator = HFGenerator(model, tokenizer, max_new_tokens=12)
    torch.manual_seed(0)
    rows = generator.generate([tokenizer("the cat")["input_ids"]], n=64, temperature=3.0)
    stops = {eos, im_end}
    for row in rows:
        assert not stops & set(row[:-1]), f"a response runs past a stop id: {row}"
        assert len(row) == 12 or row[-1] in stops, f"a response ended early without a stop id: {row}"


class _FullLogits(torch.nn.Module):
    """The same model, without transformers' logits_to_keep: every position's logits are computed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_response_logprobs_from_the_response_positions_alone(tmp_path):
    model, tokenizer = load_model(_tiny_qwen2(tmp_path / "qwen", TEXTS))
    prompts = [tokenizer(t)["input_ids"] for t in ("the cat says", "hello")]
    responses = [tokenizer(" yes")["input_ids"] + [tokenizer.eos_token_id], tokenizer(" world, hello you")["input_ids"]]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id)
    kept = response_logprobs(model, *batch, temperature=0.7)  # (N, R): logits_to_keep = R + 1
    full = response_logprobs(_FullLogits(model), *batch, temperature=0.7)
    assert kept.shape == full.shape == (2, max(map(len, responses)))
    assert torch.allclose(kept, full, atol=1e-5), (kept - full).abs().max()
    assert (kept[0, len(responses[0]):] == 0).all(), "padding contributes exactly 0"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_behaviour_logprobs_come_with_generation_and_equal_a_forward(tmp_path, arch):
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS) if arch == "qwen2" else _tiny_random_hf_model("llama", tmp_path, TEXTS)
    model, tokenizer = load_model(path)
    generator = HFGenerator(model, tokenizer, max_new_tokens=12)
    prompts = [tokenizer(t)["input_ids"] for t in ("the cat says", "hello")]
    torch.manual_seed(0)
    for temperature, score_temperature in ((0.7, 0.7), (1.0, 0.7)):  # (--temperature-max: another sampling one)
        responses, token_logp = generator.sample(prompts, 3, temperature, score_temperature)
        forward = score_logprobs(model, [p for p in prompts for _ in range(3)], responses, tokenizer.pad_token_id,
                                 score_temperature, micro_batch=64, per_token=True)
        assert [len(t) for t in token_logp] == [len(r) for r in responses]
        assert max(abs(a - b) for x, y in zip(token_logp, forward) for a, b in zip(x, y)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox", "qwen2-lora"])
def test_shared_prompt_logprobs_equal_the_full_forward_and_its_gradient(tmp_path, arch):
    """Each prompt run once for its K responses (--share-prompt): the same log-probs and the same gradient as the
    forward over every (prompt, response) row, prompts of different lengths, responses of different lengths."""
    from ops.models import load_trainer_models
    if arch.endswith("lora"):
        pytest.importorskip("peft")
    path = (_tiny_qwen2(tmp_path / "qwen", TEXTS) if arch.startswith("qwen2")
            else _tiny_random_hf_model(arch.replace("_", ""), tmp_path, TEXTS))
    policy, _, tokenizer = load_trainer_models(_cfg(model=path, lora_rank=4 if arch.endswith("lora") else 0))
    torch.manual_seed(0)
    with torch.no_grad():  # (LoRA: adapters that change the model)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    prompts = [tokenizer(t)["input_ids"] for t in ("the cat says", "hello", "yes no maybe yes")]
    responses = [tokenizer(t)["input_ids"][:n] + [tokenizer.eos_token_id][:e] for t in TEXTS[:3]
                 for n, e in ((1, 1), (4, 0), (2, 1))]  # K = 3 per prompt
    results = []
    for shared in (True, False):
        logp = (shared_prompt_logprobs(policy, prompts, responses, tokenizer.pad_token_id, 0.7) if shared else
                response_logprobs(policy, *make_batch([p for p in prompts for _ in range(3)], responses,
                                                      tokenizer.pad_token_id), 0.7))
        grads = torch.autograd.grad((logp * torch.arange(1.0, 1 + logp.numel()).view_as(logp)).sum(),
                                    [p for p in policy.parameters() if p.requires_grad])
        results.append((logp.detach(), grads))
    (shared, g_shared), (full, g_full) = results
    assert shared.shape == full.shape == (9, max(map(len, responses)))
    assert torch.allclose(shared, full, atol=1e-5), (shared - full).abs().max()
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(g_shared, g_full))
    from ops.models import micro_batches  # (score_logprobs finds the runs of one prompt itself)
    cases = ([[1], [1], [2], [2]], [[1], [2]], [[1]] * 3, [[1], [1], [2]], [[1], [1], [2], [1]])
    assert [micro_batches(p, 64, share=True) for p in cases] == [[(0, 4, 2)], [(0, 2, 1)], [(0, 3, 3)], [(0, 2, 2), (2, 3, 1)],
                                                                [(0, 2, 2), (2, 4, 1)]]
    S = [[q] for q in range(3) for _ in range(24)]  # the GSM8K paper preset: S = 24 responses a prompt
    assert micro_batches(S, 64, share=True) == [(0, 48, 24), (48, 72, 24)], "whole prompts, whatever the micro-batch"
    assert micro_batches(S, 16, share=True)[:3] == [(0, 16, 16), (16, 24, 8), (24, 40, 16)], "a run split, still shared"
    assert micro_batches(S, 64, share=False) == [(0, 64, 1), (64, 72, 1)]


def _cfg(**fields):
    from config import Config
    return Config(**{"device": "cpu", "trainer_dtype": "float32", **fields})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_lora_reference_searcher_weights_and_final_model(tmp_path):
    pytest.importorskip("peft")
    from ops.models import load_trainer_models
    from ops.lora import AdaptersOff, plain_state_dict, save_model
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS)
    policy, ref, tokenizer = load_trainer_models(_cfg(model=path, lora_rank=4))
    assert isinstance(ref, AdaptersOff) and not [p for p in ref.parameters() if p.requires_grad]
    with torch.no_grad():  # trained adapters: B != 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([tokenizer("the cat says yes")["input_ids"]])
    base, _ = load_model(path)
    assert torch.allclose(_logits(ref, ids), _logits(base, ids), atol=1e-5), "the reference is the base model"
    assert not torch.allclose(_logits(policy, ids), _logits(base, ids), atol=1e-3), "the adapters change the policy"
    searcher, _ = load_model(path)  # what a searcher holds, given the merged weights
    searcher.load_state_dict(plain_state_dict(policy))
    assert torch.allclose(_logits(searcher, ids), _logits(policy, ids), atol=1e-4), "searchers sample the policy"
    save_model(policy, tmp_path / "final")
    final, _ = load_model(str(tmp_path / "final"))
    assert torch.allclose(_logits(final, ids), _logits(policy, ids), atol=1e-4), "final/ is the merged policy"


def test_gradient_checkpointing_changes_no_log_prob_and_no_gradient(tmp_path):
    from ops.models import load_trainer_models
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS)
    tokenizer = load_model(path)[1]
    batch = make_batch([tokenizer("the cat")["input_ids"]] * 2, [tokenizer(" says yes")["input_ids"], [5, 6, 7]],
                       tokenizer.pad_token_id)
    grads = []
    for checkpointing in (False, True):
        policy = load_trainer_models(_cfg(model=path, gradient_checkpointing=checkpointing))[0]
        policy.train(checkpointing)  # as tba.train_step
        logp = response_logprobs(policy, *batch, temperature=0.7)
        logp.sum().backward()
        grads.append((logp.detach(), [p.grad.clone() for p in policy.parameters()]))
    (logp0, g0), (logp1, g1) = grads
    assert torch.allclose(logp0, logp1, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g0, g1))


def test_bf16_mixed_computes_in_bfloat16_and_keeps_float32_weights(tmp_path):
    from ops.models import autocast, load_trainer_models
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS)
    cfg = _cfg(model=path, trainer_dtype="bf16-mixed")
    policy, ref, tokenizer = load_trainer_models(cfg)
    batch = make_batch([tokenizer("the cat")["input_ids"]], [tokenizer(" says yes")["input_ids"]], tokenizer.pad_token_id)
    exact = response_logprobs(policy, *batch, temperature=0.7)
    with autocast(cfg, "cpu"):
        mixed = response_logprobs(policy, *batch, temperature=0.7)
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, exact), "bfloat16 matmuls, float32 log-probs"
    assert torch.allclose(mixed, exact, atol=0.1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    mixed.sum().backward()
    opt.step()
    assert all(p.dtype == torch.float32 for p in policy.parameters()), "master weights stay float32"


def _tiny_llama_std002(out_dir):
    """A small random Llama initialised as transformers does (weights ~ N(0, 0.02), norms 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=128, initializer_range=0.02))
    tokenizer = _bpe_tokenizer("llama", TEXTS)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def _changed_by_one_step(cfg):
    """The fraction of the trained elements that one AdamW step at lr 1e-5 changes, in the trainer's precision."""
    from ops.models import autocast, load_trainer_models
    policy, _, tokenizer = load_trainer_models(cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    batch = make_batch([tokenizer("the cat")["input_ids"]] * 2, [tokenizer(" says yes")["input_ids"], [5, 6]],
                       tokenizer.pad_token_id)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=0.0)
    with autocast(cfg, "cpu"):
        logp = response_logprobs(policy, *batch)
    (-logp.sum()).backward()
    trained = [p.grad != 0 for p in policy.parameters()]  # (embedding rows of tokens not in the batch get no gradient)
    opt.step()
    changed = sum((p.detach() != b)[t].sum().item() for p, b, t in zip(policy.parameters(), before, trained))
    return changed / sum(t.sum().item() for t in trained)


def test_an_update_at_lr_1e5_survives_the_default_gpu_precision_and_not_pure_bf16(tmp_path):
    """What a GPU run keeps by default (bf16-mixed: float32 weights and AdamW state, bfloat16 compute) takes one AdamW
    step at lr 1e-5 in >= 99% of the weights; pure bfloat16 weights round most of it away (printed: docs/scaling.md)."""
    from ops.devices import resolve_devices
    path = _tiny_llama_std002(tmp_path / "llama")
    gpu = resolve_devices(_cfg(model=path, trainer_dtype="auto", device="auto"), num_gpus=1)
    assert gpu.trainer_dtype == "bf16-mixed" and gpu.searcher_dtype == "bfloat16", "the default precision on a GPU"
    mixed = _changed_by_one_step(_cfg(model=path, trainer_dtype=gpu.trainer_dtype))
    pure = _changed_by_one_step(_cfg(model=path, trainer_dtype="bfloat16"))
    print(f"elements changed by one AdamW step at lr 1e-5: bf16-mixed {100 * mixed:.2f}%, pure bfloat16 {100 * pure:.2f}%")
    assert mixed >= 0.99, f"bf16-mixed changed only {100 * mixed:.1f}% of the weights"
    assert pure < 0.5, f"pure bfloat16 changed {100 * pure:.1f}%: the rounding this test exists to show is gone"


def test_no_grad_scoring_never_holds_a_float32_copy_of_all_the_logits(monkeypatch):
    import torch.nn.functional as F

    import loss
    logits, targets = torch.randn(20, 5, 11).to(torch.bfloat16), torch.randint(0, 11, (20, 5))
    whole = torch.gather(F.log_softmax(logits.float() / 0.7, dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)
    seen, log_softmax = [], F.log_softmax
    monkeypatch.setattr(loss.F, "log_softmax", lambda x, dim: seen.append(x.shape[0]) or log_softmax(x, dim=dim))
    with torch.no_grad():
        chunked = loss.token_logprobs(logits, targets, 0.7)
    assert torch.equal(chunked, whole) and chunked.dtype == torch.float32
    assert max(seen) == loss.NO_GRAD_ROWS < 20, f"float32 log-softmax of {max(seen)} rows at once"


def test_checkpoints_load_onto_the_policys_device_and_torchrun_ranks_share_fewer_gpus(monkeypatch, tmp_path):
    import ops.checkpoint
    from ops.devices import local_device
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(policy.parameters())
    saved = {"optimizer.pt": opt.state_dict(), "rng.pt": {"torch": torch.get_rng_state()}}
    loads = {}
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "load_file", lambda path, device: policy.state_dict())
    monkeypatch.setattr(torch, "load", lambda path, **kw: loads.setdefault(os.path.basename(path), kw) and
                        saved[os.path.basename(path)])
    with pytest.raises(ops.checkpoint.CheckpointError, match="buffer.json"):  # (no buffer.json here: enough)
        ops.checkpoint.load_checkpoint(str(tmp_path), policy, ref, opt, None)
    assert loads == {"optimizer.pt": {"weights_only": True, "map_location": torch.device("cpu")},
                     "rng.pt": {"weights_only": True, "map_location": "cpu"}}, "onto the device the policy is on now"
    for rank, want in [(0, "cuda:0"), (1, "cuda:1"), (2, "cuda:0"), (5, "cuda:1")]:  # 2 GPUs, more ranks than GPUs
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        assert local_device("auto", rank) == want
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert local_device("auto", 1) == "cpu" and local_device("cuda:1,cuda:0", 2) == "cuda:0"


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_final_is_saved_in_the_dtype_the_model_came_in(tmp_path, source):
    """A model that came in bfloat16 is trained in float32 (bf16-mixed holds float32 weights) and final/ is saved in
    bfloat16 again, half the size, config.json saying so; float32 stays float32. from_pretrained loads either."""
    import json

    from transformers import AutoModelForCausalLM
    from ops.lora import save_model
    from ops.models import source_dtype
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS)
    AutoModelForCausalLM.from_pretrained(path, dtype=source).save_pretrained(path)  # the checkpoint, in `source`
    policy, _ = load_model(path, dtype=torch.float32)  # as the trainer holds it
    assert source_dtype(_cfg(model=path)) == source
    save_model(policy, tmp_path / "final", source_dtype(_cfg(model=path)))
    assert json.load(open(tmp_path / "final" / "config.json"))["dtype"] == str(source).removeprefix("torch.")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert {p.dtype for p in final.parameters()} == {source}
    want = {n: t.to(source) for n, t in policy.state_dict().items()}
    assert all(torch.equal(t, want[n]) for n, t in final.state_dict().items()), "the trained weights, cast"


def test_lora_adapters_sent_to_vllm_are_what_peft_saves(tmp_path):
    """--lora-sync adapter (LoRA with vLLM searchers): a publish sends the adapters alone, the very tensors and names
    of PEFT's adapter_model.safetensors; with HF searchers, or --lora-sync merged, the merged weights."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from ops.lora import Adapters, Merged, for_searchers
    from ops.models import load_trainer_models
    path = _tiny_qwen2(tmp_path / "qwen", TEXTS)
    policy, _, _ = load_trainer_models(_cfg(model=path, lora_rank=4))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    sent = for_searchers(_cfg(model=path, lora_rank=4, backend="vllm"), policy)
    policy.save_pretrained(tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert isinstance(sent, Adapters) and sent.state_dict().keys() == saved.keys()
    assert all(torch.equal(sent.state_dict()[k], saved[k]) for k in saved)
    for cfg in (_cfg(model=path, lora_rank=4, backend="hf"), _cfg(model=path, lora_rank=4, backend="vllm", lora_sync="merged")):
        assert isinstance(for_searchers(cfg, policy), Merged)
