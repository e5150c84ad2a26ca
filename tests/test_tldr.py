"""
Tests for the TL;DR task: the prompt and its truncation, the official data schema, the reward models and
their scoring position, the Bradley-Terry loss, the evaluation quantities against closed forms, the no-EOS
penalty, and end-to-end runs (the paper preset's code path with tiny random GPT-NeoX models; the tiny
preset, shrunk). CPU only, no network.

Run: python -m pytest -q tests/test_tldr.py
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from config import ConfigError
from tasks.tldr import (TLDR_PROMPT, RewardModel, TLDRTask, fact_score, kl_and_perplexity, load_tldr, reward_inputs,
                  rm_pad_id, tldr_query, tldr_rows, win_rate)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root


# -----------------------------------------------------------------------------
# Prompt, truncation, data

def test_prompt_format():
    row = {"subreddit": "relationships", "title": "My cat", "post": "He sat.", "summary": "cat sat"}
    assert tldr_query(row, len) == "SUBREDDIT: r/relationships\n\nTITLE: My cat\n\nPOST: He sat.\n\nTL;DR:"


def test_truncation_cuts_post_at_last_newline_then_by_character():
    count = lambda text: len(text.split())  # one token per word, so lengths can be checked by hand
    row = {"subreddit": "s", "title": "t", "post": "one two\nthree four\nfive six seven", "summary": "x"}
    head = len(TLDR_PROMPT.format(subreddit="s", title="t", post="").split())  # 6 words without the post
    assert tldr_query(row, count, head + 7) == TLDR_PROMPT.format(subreddit="s", title="t", post=row["post"]), "fits"
    assert tldr_query(row, count, head + 6).endswith("POST: one two\nthree four\n\nTL;DR:"), "cut at the last newline"
    assert tldr_query(row, count, head + 2).endswith("POST: one two\n\nTL;DR:"), "cut again at the new last newline"
    # no newline left: drop one character at a time ("one tw" is still 2 words, "one " is 1)
    assert tldr_query(row, count, head + 1).endswith("POST: one \n\nTL;DR:")
    with pytest.raises(ValueError, match="without its post"):
        tldr_query(row, count, head - 1)


def _official_rows(n, long_post_every=0):
    """Rows in the official data set's schema (with some of its extra columns)."""
    rows = []
    for i in range(n):
        post = f"I have {i} cats.\nThey sleep all day.\nToday one of them ate my {i} socks."
        if long_post_every and i % long_post_every == 0:
            post += "\n" + " ".join(["and then it also ate more socks"] * 40)
        rows.append({"id": f"t3_{i}", "subreddit": "cats", "title": f"My {i} cats", "post": post,
                     "summary": f"my {i} cats ate socks", "query": "ignored", "reference_response_token_len": 7})
    return rows


def test_load_official_schema_jsonl_and_json_array(tmp_path):
    rows = _official_rows(3)
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "validation.json").write_text(json.dumps(rows[:2]))
    assert [r["summary"] for r in tldr_rows("train", str(tmp_path))] == [r["summary"] for r in rows]
    assert len(tldr_rows("validation", str(tmp_path))) == 2, "a JSON array (records) file"
    with pytest.raises(ConfigError, match="no test.jsonl"):
        tldr_rows("test", str(tmp_path))


def test_loader_errors_name_file_and_line(tmp_path):
    good = json.dumps(_official_rows(1)[0])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        load_tldr(str(bad))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(good + "\n" + json.dumps({"subreddit": "a", "title": "b", "summary": "c"}) + "\n")
    with pytest.raises(ConfigError, match=r"missing.jsonl:2: .*bad: post"):
        load_tldr(str(missing))
    with pytest.raises(ConfigError, match="not found"):
        load_tldr(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no TL;DR rows"):
        load_tldr(str(tmp_path / "empty.jsonl"))


def test_task_from_official_rows_truncates_to_max_tokens():
    tokenizer = _bpe_tokenizer([TLDR_PROMPT] + [r["post"] + r["summary"] for r in _official_rows(20, 1)])
    rows = _official_rows(6, long_post_every=2)
    task = TLDRTask.from_rows(rows, rows[:2], tokenizer, max_tokens=64)
    lengths = [len(tokenizer(p)["input_ids"]) for p in task.prompts]
    assert max(lengths) <= 64 and all(p.endswith("\n\nTL;DR:") for p in task.prompts)
    assert task.prompts[1] == tldr_query(rows[1], len), "short posts are untouched"
    assert "ate my 0 socks" in task.prompts[0] and "more socks" not in task.prompts[0], "cut at the last newline"
    assert task.metas[0] == {"reference": " my 0 cats ate socks"}, "the reference response has a leading space"


# -----------------------------------------------------------------------------
# Gold score, win rate, Bradley-Terry, KL and perplexity

META = {"facts": ["boss cut pay", "mom sold car", "dad lost job"], "distractors": ["we like tea", "i watched chess"]}


@pytest.mark.parametrize("summary,gold", [
    (" boss cut pay , mom sold car , dad lost job .", 3.0),
    (" boss cut pay , mom sold car .", 2.0),
    (" boss cut pay , we like tea , boss cut pay .", 1 - 1 - 0.5),
    (" boss cut car .", -1.0),  # garbled: not a fact of this post
    (" boss cut pay , mom sold car , dad lost job , dad lost job , dad lost job .", 3 - 2 * 0.5 - 0.25 * (20 - 14)),
    ("", 0.0),
])
def test_fact_score(summary, gold):
    assert fact_score([""], [summary], [META]) == [pytest.approx(gold)]


def test_win_rate_ties_lose():
    assert win_rate([1.0, 2.0, 3.0, 0.5], [1.0, 1.0, 4.0, 0.0]) == 0.5, "1 = 1 is a loss, 2 > 1 and 0.5 > 0 win"
    assert win_rate([1.0], [1.0]) == 0.0


def test_bradley_terry_loss_hand_computed():
    from run_tldr import bradley_terry_loss
    r_chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    r_rejected = torch.tensor([0.0, 0.0])
    loss = bradley_terry_loss(r_chosen, r_rejected)
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928, -log sigmoid(0) = log 2 = 0.693147
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-2)) + math.log(2)) / 2, abs=1e-6)
    loss.backward()  # d/dr_c = -(1 - sigmoid(r_c - r_r)) / N
    np.testing.assert_allclose(r_chosen.grad.numpy(), [-(1 - 1 / (1 + math.exp(-2))) / 2, -0.25], atol=1e-6)


class _TableLM(torch.nn.Module):
    """A 'model' whose logits at position t depend only on the token at t: easy to check by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return type("Out", (), {"logits": self.table[input_ids]})


def test_kl_and_perplexity_closed_forms():
    torch.manual_seed(0)
    V = 5
    policy, sft = _TableLM(torch.randn(V, V)), _TableLM(torch.randn(V, V))
    prompts, responses = [[1, 2], [3]], [[4, 0], [2, 2, 1]]
    kl, ppl = kl_and_perplexity(policy, policy, prompts, responses, pad_id=0, micro_batch=1)
    assert kl == pytest.approx([0.0, 0.0], abs=1e-6), "KL of a model with itself"
    _, ppl = kl_and_perplexity(policy, _TableLM(torch.zeros(V, V)), prompts, responses, pad_id=0, micro_batch=2)
    assert ppl == pytest.approx([V, V]), "a uniform SFT model has perplexity V"
    kl, ppl = kl_and_perplexity(policy, sft, prompts, responses, pad_id=0, micro_batch=2)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq, kls, nlls = p + r, [], []
        for t in range(len(p), len(seq)):  # the distribution after seq[t - 1] predicts seq[t]
            q, pi = torch.log_softmax(sft.table[seq[t - 1]], -1), torch.log_softmax(policy.table[seq[t - 1]], -1)
            kls.append((q.exp() * (q - pi)).sum().item())
            nlls.append(-q[seq[t]].item())
        assert kl[i] == pytest.approx(np.mean(kls), abs=1e-5) and ppl[i] == pytest.approx(math.exp(np.mean(nlls)), rel=1e-5)


# -----------------------------------------------------------------------------
# Reward models: where they score, and padding

def _bpe_tokenizer(texts, pad=None):
    """A small byte-level BPE tokenizer trained here, in GPT-NeoX's (Pythia's) tokenizer class."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = list(dict.fromkeys(["<|endoftext|>"] + ([pad] if pad else [])))
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    extra = {"pad_token": pad} if pad else {}
    return GPTNeoXTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", **extra)


def _save_gpt_neox(out_dir, tokenizer, classifier, seed=0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification
    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=1024, num_labels=1,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPTNeoXForSequenceClassification(config) if classifier else GPTNeoXForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def _texts():
    return [tldr_query(r, len) + " " + r["summary"] for r in _official_rows(30)]


@pytest.mark.parametrize("pad", ["<|padding|>", "<|endoftext|>"])
def test_reward_model_scores_at_eos(tmp_path, pad):
    """The score is read at the EOS appended to prompt + response, whether or not the tokenizer pads with
    EOS; batched scores equal one-at-a-time scores."""
    tokenizer = _bpe_tokenizer(_texts(), pad)
    rm = RewardModel(_save_gpt_neox(tmp_path / "rm", tokenizer, classifier=True))
    prompts, responses = ["SUBREDDIT: r/cats\n\nTL;DR:", "TITLE: My 3 cats\n\nTL;DR:"], [" cats ate socks", " socks"]
    batched = rm(prompts, responses)
    assert batched == pytest.approx([rm(prompts[:1], responses[:1])[0], rm(prompts[1:], responses[1:])[0]], abs=1e-5)
    with torch.no_grad():
        ids = tokenizer(prompts[0] + responses[0])["input_ids"] + [tokenizer.eos_token_id]
        hidden = rm.model.gpt_neox(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
        assert batched[0] == pytest.approx(rm.model.score(hidden[0, -1]).item(), abs=1e-5)
    input_ids, attention_mask = reward_inputs(rm.tokenizer, prompts, responses)
    assert (attention_mask.cummin(dim=1).values == attention_mask).all() and not attention_mask.all(), "right padding"
    pad = rm_pad_id(rm.tokenizer)
    assert (input_ids[attention_mask == 0] == pad).all() and pad != tokenizer.eos_token_id, "padded, never with EOS"


def test_no_eos_penalty_replaces_the_score():
    """The official trainer gives -1 to a response with no EOS (--no-eos-reward); the Searcher applies it."""
    import run_tldr
    from searcher import Searcher
    tokenizer = run_tldr.tiny_tokenizer()
    cfg = run_tldr.TLDRConfig(samples_per_prompt=2, no_eos_reward=-1.0)
    eos, word = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("boss")

    class Generator:
        stop_ids = (eos,)

        def sample(self, prompt_tokens, n, temperature, score_temperature):  # (no behaviour log-probs)
            return [[word, eos], [word, word]], None  # the second was cut at max_new_tokens

    task = TLDRTask(["TL;DR:"], [{}], ["TL;DR:"], [{}])
    searcher = Searcher(cfg, task, Generator(), tokenizer, lambda p, c, m, **context: [0.7] * len(c), seed=0)
    trajectories = searcher.search([0], policy_version=0, ref_version=-1).trajectories
    assert [t.reward for t in trajectories] == [0.7, -1.0]
    unscored = Searcher(cfg, task, Generator(), tokenizer, lambda p, c, m, **context: [math.nan] * len(c), seed=0)
    batch = unscored.search([0], policy_version=0, ref_version=-1)  # (no reward scored either: the cut one is kept)
    assert [t.reward for t in batch.trajectories] == [-1.0] and batch.report["unscored"] == 1, batch.report


# -----------------------------------------------------------------------------
# End to end: the paper preset's values and code path, the tiny preset

def _dry_run_values(*flags):
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_tldr.py"), *flags, "--dry-run", "--plan-for", "4x80"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pairs = (line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)
    return {k.strip(): v.strip() for k, v in pairs}, out.stdout


def test_paper_preset_dry_run_prints_paper_values():
    values, stdout = _dry_run_values("--preset", "paper")
    want = {"model": "mnoukhov/pythia1b-sft-tldr", "proxy_rm": "mnoukhov/pythia1b-rm-tldr6.9b",
            "gold_rm": "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr", "batch_size": "160",
            "responses_per_prompt": "20", "samples_per_prompt": "20", "steps": "256", "sync_every": "10", "m": "0.5",
            "capacity_per_prompt": "100", "prioritization": "softmax", "reward_temp": "1.0",
            "initial_completions": "10000", "lr": "3e-06", "warmup_steps": "0", "stable_steps": "0",
            "decay_steps": "256", "lr_decay": "linear", "lr_floor": "0.0", "grad_clip": "0.0", "temperature": "0.7",
            "loss_temperature": "0.7", "beta_start": "1.0", "beta_end": "0.05", "beta_decay_steps": "128",
            "beta_stop_step": "31", "max_new_tokens": "128", "no_eos_reward": "-1.0", "num_searchers": "3",
            "query_tokens": "512", "max_prompt_tokens": "512", "objective": "tb",
            "vllm_gpu_memory_utilization": "0.25", "trainer_dtype": "float32", "micro_batch_prompts": "1"}
    assert {k: values[k] for k in want} == want
    assert "searcher-2" in stdout
    from loss import beta_schedule
    betas = [beta_schedule(s, 1.0, 0.05, 128, 31) for s in (0, 1, 30, 31, 200)]  # official updates 1, 2, 31, 32, 201
    assert betas == pytest.approx([1.0, 0.992578, 0.777344, 0.05, 0.05], abs=1e-6)


def _read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


EVAL_KEYS = {"eval/win_rate", "eval/gold_reward", "eval/proxy_reward", "eval/kl", "eval/ppl", "eval/response_tokens"}


def test_paper_code_path_with_tiny_random_gpt_neox(tmp_path):
    """`--preset paper` end to end with tiny random GPT-NeoX models saved here and loaded by from_pretrained:
    policy, proxy RM (own pad token) and gold RM (no pad token), on data in the official schema."""
    rows = _official_rows(12, long_post_every=3)
    for split, part in (("train", rows), ("validation", rows[:4])):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in part) + "\n")
    texts = [tldr_query(r, len) + " " + r["summary"] for r in rows]
    policy = _save_gpt_neox(tmp_path / "policy", _bpe_tokenizer(texts), classifier=False)
    proxy = _save_gpt_neox(tmp_path / "proxy", _bpe_tokenizer(texts, pad="<|padding|>"), classifier=True, seed=1)
    gold = _save_gpt_neox(tmp_path / "gold", _bpe_tokenizer(texts), classifier=True, seed=2)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(HERE, "run_tldr.py"), "--preset", "paper", "--model", policy, "--proxy-rm", proxy,
           "--gold-rm", gold, "--data-dir", str(tmp_path), "--run-dir", str(run_dir), "--device", "cpu",
           "--searcher-device", "cpu", "--backend", "hf", "--num-searchers", "1", "--trainer-threads", "1",
           "--searcher-threads", "1", "--steps", "2", "--batch-size", "4", "--responses-per-prompt", "2",
           "--samples-per-prompt", "2", "--prompts-per-search", "2", "--initial-completions", "4",
           "--max-new-tokens", "6", "--query-tokens", "96", "--micro-batch", "4", "--eval-batch-size", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(np.isfinite(r["loss/train"]) for r in rows[:2])
    assert EVAL_KEYS <= set(rows[0]) and EVAL_KEYS <= set(rows[-1]), "evaluation before and after training"
    assert all(np.isfinite(rows[-1][k]) for k in EVAL_KEYS) and rows[0]["eval/kl"] == pytest.approx(0.0, abs=1e-5)
    assert re.fullmatch(r"win_rate: before [\d.]+% -> after [\d.]+%", out.stdout.splitlines()[-1])
    resolved = json.load(open(run_dir / "config.json"))
    assert resolved["beta_start"] == 1.0 and resolved["grad_clip"] == 0.0 and resolved["no_eos_reward"] == -1.0
    assert json.load(open(run_dir / "final" / "config.json"))["architectures"] == ["GPTNeoXForCausalLM"]


def test_paper_preset_needs_both_reward_models():
    import config
    import run_tldr
    cfg = config.parse_config(run_tldr.TLDRConfig, run_tldr.PRESETS, ["--preset", "paper", "--gold-rm", ""])
    with pytest.raises(ConfigError, match="--gold-rm"):
        run_tldr.make_task(cfg)  # before any data or model is loaded


def test_tiny_preset_async_run(tmp_path):
    """The tiny preset shrunk to seconds: SFT and proxy RM built (and cached), a short asynchronous run with
    evaluations at steps 0 and 4 and at the end."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, os.path.join(HERE, "run_tldr.py"), "--cache-dir", str(cache), "--run-dir", str(tmp_path / "run"),
           "--tiny-train-size", "200", "--tiny-eval-size", "16", "--tiny-sft-steps", "10", "--tiny-rm-steps", "10",
           "--tiny-rm-batch", "16", "--steps", "8", "--sync-every", "2", "--eval-every", "4", "--eval-size", "16",
           "--initial-completions", "32", "--max-new-tokens", "12"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _read_metrics(tmp_path / "run")
    evals = [r["step"] for r in rows if "eval/win_rate" in r]
    assert evals == [0, 4, 8], "evaluations at steps 0 and 4 and after the last step"
    assert all(0.0 <= r["eval/win_rate"] <= 1.0 and np.isfinite(r["eval/kl"]) and r["eval/ppl"] >= 1.0
               for r in rows if "eval/win_rate" in r)
    assert max(r["searcher/version"] for r in rows if "searcher/version" in r) > 0, "searchers got published weights"
    assert re.fullmatch(r"win_rate: before [\d.]+% -> after [\d.]+%", out.stdout.splitlines()[-1])
    rm_dirs = [d for d in os.listdir(cache) if d.startswith("tldr-tiny-rm-")]
    assert len(rm_dirs) == 1 and "heldout_pair_accuracy" in json.load(open(cache / rm_dirs[0] / "settings.json"))
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["proxy_rm"] == str(cache / rm_dirs[0]), "trained on the proxy RM built here"
    assert config["gold_rm"] == "", "judged by fact_score"
