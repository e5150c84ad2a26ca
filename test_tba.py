"""
Tests for TBA: the math against closed forms, the buffer against expected frequencies, the grader on real
GSM8K, and the processes end to end with the tiny preset. CPU only, no network.

Run: python -m pytest -q test_tba.py
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from buffer import ReplayBuffer, Trajectory
from loss import (beta_schedule, dr_grpo_loss, grpo_loss, make_batch, rloo_loss, sequence_logprobs,
                  vargrad_tb_loss, wsd_schedule)
from config import ConfigError
from rewards import GSM8KTask, extract_answer, gold_answer, gsm8k_reward, load_gsm8k

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K_DIR = os.path.join(HERE, "..", "shared", "data", "gsm8k")


# -----------------------------------------------------------------------------
# loss.py

def test_vargrad_loss_hand_computed():
    # one query, K = 2, beta = 0.5: r/beta = (2, 0); kl = (-1, 1); log_Z = mean(2 - -1, 0 - 1) = 1
    # residuals: log_Z + kl - r/beta = (1 - 1 - 2, 1 + 1 - 0) = (-2, 2) -> loss = mean(4, 4) = 4
    logp = torch.tensor([[-3.0, -1.0]])
    ref_logp = torch.tensor([[-2.0, -2.0]])
    reward = torch.tensor([[1.0, 0.0]])
    assert vargrad_tb_loss(logp, ref_logp, reward, beta=0.5).item() == pytest.approx(4.0)


def test_vargrad_loss_and_gradient_vanish_at_optimum():
    torch.manual_seed(0)
    Q, K, beta = 3, 6, 0.1
    ref_logp = -20 * torch.rand(Q, K, dtype=torch.float64)
    reward = torch.rand(Q, K, dtype=torch.float64)
    c = 5 * torch.randn(Q, 1, dtype=torch.float64)  # any per-query constant: log Z(x)
    logp = (ref_logp + reward / beta - c).requires_grad_()
    loss = vargrad_tb_loss(logp, ref_logp, reward, beta)
    loss.backward()
    assert loss.item() < 1e-20, f"loss at the optimum should be 0, got {loss.item()}"
    assert logp.grad.abs().max().item() < 1e-10, "gradient at the optimum should be 0"


def test_vargrad_gradient_matches_appendix_a():
    torch.manual_seed(1)
    Q, K, beta = 4, 5, 0.05
    logp = (-10 * torch.rand(Q, K, dtype=torch.float64)).requires_grad_()
    ref_logp = -10 * torch.rand(Q, K, dtype=torch.float64)
    reward = torch.randint(0, 2, (Q, K)).double()
    vargrad_tb_loss(logp, ref_logp, reward, beta).backward()
    # Appendix A, computed independently: A = (r - r_bar) - beta (kl - kl_bar); grad = -(2 / beta) A / (Q K)
    r, kl = reward.numpy(), (logp - ref_logp).detach().numpy()
    A = (r - r.mean(axis=1, keepdims=True)) - beta * (kl - kl.mean(axis=1, keepdims=True))
    np.testing.assert_allclose(logp.grad.numpy(), -(2 / beta) * A / (Q * K), rtol=1e-10, atol=1e-12)


def test_vargrad_log_Z_is_detached():
    # if log_Z carried gradient the per-query sum of gradients would be 0 only by accident; with it detached
    # the gradient is the Appendix A form, whose per-query sum is 0 (advantages are centred)
    logp = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    vargrad_tb_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]]), 1.0).backward()
    assert logp.grad.sum().abs().item() < 1e-6
    assert logp.grad.abs().sum().item() > 0.1


class _TableLM(torch.nn.Module):
    """A 'model' whose logits at position t depend only on the token at t: easy to score by hand."""

    def __init__(self, V=7):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(V, V))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return type("Out", (), {"logits": self.table[input_ids]})


def test_sequence_logprobs_matches_manual_sum_and_ignores_padding():
    model, pad = _TableLM(), 0
    prompts, responses = [[3, 1, 4], [1]], [[5, 2], [6, 2, 3, 4]]
    input_ids, attention_mask, response_mask = make_batch(prompts, responses, pad)
    assert input_ids.tolist() == [[3, 1, 4, 5, 2, 0, 0], [0, 0, 1, 6, 2, 3, 4]], "left-pad prompts, right-pad responses"
    assert response_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1]]
    for T in (1.0, 0.7):
        got = sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature=T)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seq = p + r
            want = sum(torch.log_softmax(model.table[seq[t - 1]] / T, -1)[seq[t]].item() for t in range(len(p), len(seq)))
            assert got[i].item() == pytest.approx(want, abs=1e-5)
    # padding contributes exactly 0, even where the model's logits there are garbage
    model.table.data[pad] = float("nan")
    got = sequence_logprobs(model, input_ids, attention_mask, response_mask)
    assert torch.isfinite(got).all(), "NaN logits at padded positions must not leak into the sum"


def test_sequence_logprobs_left_padding_invariant_on_real_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)).eval()
    prompt, response = [5, 6, 7, 8], [9, 10, 11]
    alone = sequence_logprobs(model, *make_batch([prompt], [response], 0))
    batched = sequence_logprobs(model, *make_batch([prompt, [1] * 9], [response, [2] * 6], 0))
    assert batched[0].item() == pytest.approx(alone[0].item(), abs=1e-4), "extra left/right padding changed the log-prob"


def test_beta_schedule():
    assert beta_schedule(0, 0.014, 0.004, 500) == pytest.approx(0.014)
    assert beta_schedule(250, 0.014, 0.004, 500) == pytest.approx(0.009)
    assert beta_schedule(500, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_schedule(900, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_schedule(100, 0.1, 0.1, 500) == pytest.approx(0.1), "constant when start == end"
    assert beta_schedule(199, 0.1, 0.01, 1000, stop_step=200) == pytest.approx(0.1 - 0.09 * 199 / 1000)
    assert beta_schedule(200, 0.1, 0.01, 1000, stop_step=200) == pytest.approx(0.01), "jumps to beta_end at stop_step"


def test_wsd_schedule_cosine_as_official_and_linear():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    # official GSM8K: warmup 50, stable 350, cosine decay over 600, stopped at step 700; update u uses lambda(u)
    lr = wsd_schedule(opt, warmup=50, stable=350, decay=600)
    assert lr(0) == pytest.approx(1 / 50) and lr(48) == pytest.approx(49 / 50) and lr(49) == 1.0
    assert lr(398) == 1.0 and lr(549) == pytest.approx(0.5 * (1 + math.cos(math.pi * 150 / 600)))
    assert lr(699) == pytest.approx(0.5), "the official 700-step run ends halfway down the cosine (lr 5e-6)"
    assert lr(999) == pytest.approx(0.0) and lr(5000) == 0.0
    linear = wsd_schedule(opt, warmup=0, stable=0, decay=256, decay_type="linear")  # TL;DR: linear, no warmup
    assert linear(0) == pytest.approx(255 / 256) and linear(127) == pytest.approx(0.5) and linear(255) == 0.0
    floored = wsd_schedule(opt, warmup=10, stable=10, decay=10, floor=0.1, decay_type="linear")
    assert floored(24) == pytest.approx(0.1 + 0.9 * 0.5) and floored(100) == pytest.approx(0.1)


def test_rloo_as_trl_hand_computed():
    # R = r - beta (behavior - ref) = (1 - 0.1, 0, 0 - 0.1 * 2) = (0.9, 0, -0.2); A = R - mean of the others
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    behavior = torch.tensor([[-1.0, -2.0, -3.0]])  # on-policy: ratios 1
    ref = torch.tensor([[-2.0, -2.0, -5.0]])
    reward = torch.tensor([[1.0, 0.0, 0.0]])
    loss = rloo_loss(logp, behavior, ref, reward, beta=0.1)
    A = torch.tensor([0.9 - (0 - 0.2) / 2, 0 - (0.9 - 0.2) / 2, -0.2 - (0.9 + 0) / 2])
    assert loss.item() == pytest.approx(-A.mean().item(), abs=1e-6)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [(-A / 3).numpy()], atol=1e-6)
    # a stale sample whose ratio left [0.8, 1.2] in the direction of its advantage gets no gradient
    logp = torch.tensor([[-0.5, -2.0, -3.0]], requires_grad=True)  # rho_0 = e^0.5 > 1.2, A_0 > 0
    rloo_loss(logp, behavior, ref, reward, beta=0.1).backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0


def test_tb_gradient_is_a_multiple_of_rloo_with_kl_in_the_reward():
    # on a real (tiny, random) Llama: same batch, TB vs on-policy RLOO, every parameter's gradient
    from transformers import LlamaConfig, LlamaForCausalLM
    from loss import tb_rloo_gradient_ratio
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    Q, K, beta = 2, 4, 0.3
    prompts = [[1, 5, 6], [1, 7, 8, 9]]
    responses = [[int(v) for v in torch.randint(10, 40, (int(n),))] for n in torch.randint(1, 6, (Q * K,))]
    batch = make_batch([prompts[i // K] for i in range(Q * K)], responses, 0)
    ref_logp = -5 * torch.rand(Q, K)
    reward = torch.randint(0, 2, (Q, K)).float()

    def grads(loss_fn):
        model.zero_grad()
        logp = sequence_logprobs(model, *batch).view(Q, K)
        loss_fn(logp).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    g_tb = grads(lambda logp: vargrad_tb_loss(logp, ref_logp, reward, beta))
    g_rloo = grads(lambda logp: rloo_loss(logp, logp.detach(), ref_logp, reward, beta))
    ratio = tb_rloo_gradient_ratio(K, beta)
    assert ratio == pytest.approx(2 * 3 / (0.3 * 4))
    worst = (g_tb - ratio * g_rloo).abs().max() / g_tb.abs().max()  # float32 rounding (Llama's RMSNorm is float32)
    assert worst < 1e-5, f"TB gradient != {ratio} x RLOO gradient (relative error {worst:.1e})"


def test_grpo_per_token_ratio_clipping_and_normalisations():
    # two responses of 2 and 1 tokens; rewards (1, 0): A = (0.5, -0.5) (/ std 0.7071 with scale_rewards)
    mask = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])  # (Q=1, K=2, T=2)
    behavior = torch.zeros(1, 2, 2)
    reward = torch.tensor([[1.0, 0.0]])
    token_logp = torch.zeros(1, 2, 2, requires_grad=True)  # on-policy: every ratio is 1
    A = 0.5 / (2 ** 0.5 / 2 + 1e-4)
    # per-token losses: -A, -A on response 0; +A on response 1 (its padding is masked out)
    assert grpo_loss(token_logp, behavior, mask, reward).item() == pytest.approx(-A / 3, abs=1e-6)  # dapo: / 3 tokens
    assert grpo_loss(token_logp, behavior, mask, reward, loss_type="grpo").item() == pytest.approx((-A + A) / 2, abs=1e-6)
    dr = dr_grpo_loss(token_logp, behavior, mask, reward, max_tokens=4)  # no std; / (2 sequences x 4 tokens)
    assert dr.item() == pytest.approx((-0.5 - 0.5 + 0.5) / 8, abs=1e-6)
    token_logp = torch.tensor([[[0.5, 0.0], [0.0, 0.0]]], requires_grad=True)  # token 0 of response 0: ratio e^0.5
    grpo_loss(token_logp, behavior, mask, reward).backward()
    assert token_logp.grad[0, 0, 0].item() == 0.0, "clipped, positive advantage: no gradient"
    assert token_logp.grad[0, 0, 1].item() == pytest.approx(-A / 3, abs=1e-6), "the other token still learns"


def test_online_dpo_best_vs_worst_and_ties():
    from loss import online_dpo_loss
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [0.0, 0.0, 0.0]])
    reward = torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]])  # query 1 is a tie: no pair
    beta = 0.5
    # query 0: winner is response 1 (margin 0), loser response 0 (margin 0.5): h = 0.5 * (0 - 0.5)
    want = -math.log(1 / (1 + math.exp(0.25))) / 2
    loss = online_dpo_loss(logp, ref, reward, beta)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    assert logp.grad[1].abs().sum().item() == 0.0 and logp.grad[0, 2].item() == 0.0


# -----------------------------------------------------------------------------
# buffer.py

def traj(q, resp, reward=0.0, version=0):
    return Trajectory(query_id=q, response_ids=tuple(resp), reward=reward, policy_version=version)


def test_buffer_dedup_keeps_newest():
    buf = ReplayBuffer(capacity_per_query=10, seed=0)
    buf.add([traj(0, [1, 2], reward=0.0, version=0), traj(0, [3], version=0)])
    buf.add([traj(0, [1, 2], reward=1.0, version=5)])
    assert len(buf) == 2
    held = {t.response_ids: t for t in buf.items[0].values()}
    assert held[(1, 2)].policy_version == 5 and held[(1, 2)].reward == 1.0
    buf.add([traj(0, [1, 2], version=3)])  # a late copy from older weights does not replace the newer one
    assert {t.response_ids: t.policy_version for t in buf.items[0].values()}[(1, 2)] == 5


def test_buffer_evicts_oldest_by_version():
    buf = ReplayBuffer(capacity_per_query=3, seed=0)
    buf.add([traj(0, [i], version=v) for i, v in enumerate([4, 1, 3, 0, 2])])
    assert sorted(t.policy_version for t in buf.items[0].values()) == [2, 3, 4]
    buf.add([traj(1, [9], version=0)])
    assert len(buf) == 4 and buf.num_queries == 2, "capacity is per query"


def test_buffer_m1_draws_only_latest_round():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(q, [q, i], version=0) for q in range(5) for i in range(4)])
    buf.add([traj(q, [q, 100 + i], version=2) for q in (7, 8) for i in range(4)])
    for group in buf.sample(200, 3, m=1.0):
        assert len({t.query_id for t in group}) == 1
        assert all(t.query_id in (7, 8) and t.policy_version == 2 for t in group)


def test_buffer_round_min_version_keeps_late_items_out_of_round():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(0, [1], version=4), traj(1, [2], version=2)], round_min_version=4)
    assert list(buf.latest) == [0] and len(buf) == 2
    assert all(t.query_id == 0 for g in buf.sample(50, 1, m=1.0) for t in g)


def test_buffer_m0_uniform_queries():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(q, [i], version=0) for q in range(4) for i in range(3)])
    buf.add([traj(9, [0], version=1)])
    counts = np.bincount([g[0].query_id for g in buf.sample(10000, 1, m=0.0)], minlength=10)
    np.testing.assert_allclose(counts[[0, 1, 2, 3, 9]] / 10000, 0.2, atol=0.02)


def test_buffer_queries_are_dealt_without_replacement():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(q, [i], version=0) for q in range(6) for i in range(3)])
    for _ in range(3):  # every 6 draws see each query once, for the latest round (m=1) and for all (m=0)
        assert sorted(g[0].query_id for g in buf.sample(6, 2, m=1.0)) == list(range(6))
        assert sorted(g[0].query_id for g in buf.sample(6, 2, m=0.0)) == list(range(6))


def test_buffer_empty_sync_keeps_the_last_online_round():
    # the official buffer: a sync that brings no new data leaves the last online prompt set in place,
    # and the next draws still come from it, without replacement
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(q, [q, i], version=0) for q in range(5) for i in range(4)])
    assert buf.add([traj(q, [q, 100 + i], version=2) for q in (7, 8, 9) for i in range(4)]) == 12
    assert buf.add([]) == 0, "an empty sync"
    assert buf.add([traj(0, [0, 50], version=1)], round_min_version=2) == 0, "only a late item: nothing new either"
    assert set(buf.latest) == {7, 8, 9}
    drawn = [g[0].query_id for g in buf.sample(6, 2, m=1.0)]
    assert sorted(drawn[:3]) == sorted(drawn[3:]) == [7, 8, 9]


def test_buffer_softmax_frequencies():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    rewards = [0.0, 0.5, 1.0, 2.0]
    buf.add([traj(0, [i], reward=r) for i, r in enumerate(rewards)])
    T, n = 0.5, 40000
    draws = [g[0].reward for g in buf.sample(n, 1, m=0.0, prioritization="softmax", reward_temp=T)]
    expected = np.exp(np.array(rewards) / T) / np.exp(np.array(rewards) / T).sum()
    observed = np.array([draws.count(r) for r in rewards]) / n
    np.testing.assert_allclose(observed, expected, atol=0.01)
    uniform = [g[0].reward for g in buf.sample(n, 1, m=0.0, prioritization="uniform")]
    np.testing.assert_allclose(np.array([uniform.count(r) for r in rewards]) / n, 0.25, atol=0.01)


def test_buffer_replacement_only_when_scarce():
    buf = ReplayBuffer(capacity_per_query=100, seed=0)
    buf.add([traj(0, [i]) for i in range(5)])
    for group in buf.sample(100, 5, m=1.0):
        assert len({t.response_ids for t in group}) == 5, "5 candidates, k=5: no repeats"
    groups = buf.sample(10, 8, m=1.0)
    assert all(len(g) == 8 for g in groups), "k larger than the candidates: drawn with replacement"


def test_buffer_staleness_and_sizes():
    buf = ReplayBuffer(capacity_per_query=10, seed=0)
    buf.add([traj(0, [1], version=3), traj(1, [2], version=5)])
    assert len(buf) == 2 and buf.num_queries == 2
    assert sorted(buf.staleness([[buf.items[0][(1,)]], [buf.items[1][(2,)]]], step=7).tolist()) == [2, 4]


# -----------------------------------------------------------------------------
# rewards.py

@pytest.mark.parametrize("text,value", [
    ("so she has 1,000 apples", 1000.0),
    ("The total is $1,000.00.", 1000.0),
    ("the temperature drops to -3 degrees", -3.0),
    ("half is 0.5 and a quarter .25", 0.25),
    ("it costs 7.", 7.0),
    ("She has 16 - 3 - 4 = 9 eggs.\n#### 9", 9.0),
    ("no number here", None),
    ("", None),
    ("#### 1,450,000", 1450000.0),
])
def test_extract_answer(text, value):
    assert extract_answer(text) == value


def test_gsm8k_reward():
    answer = "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18"
    assert gsm8k_reward("... 9 * 2 = 18 dollars\n#### 18", answer) == 1.0
    assert gsm8k_reward("#### 18.00", answer) == 1.0
    assert gsm8k_reward("#### 17", answer) == 0.0
    assert gsm8k_reward("I don't know", answer) == 0.0
    assert gsm8k_reward("#### -10", "#### -10") == 1.0
    assert gold_answer("x\n#### 2,125") == 2125.0


def test_load_gsm8k_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.jsonl"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_gsm8k(str(bad))
    missing = tmp_path / "missing_field.jsonl"
    missing.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"missing_field.jsonl:1: .*'answer'"):
        load_gsm8k(str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_gsm8k(str(empty))


@pytest.mark.skipif(not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")),
                    reason="real GSM8K not found at ../shared/data/gsm8k (it is never shipped with the project)")
def test_grader_on_all_gsm8k_test_gold_solutions():
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))
    assert len(rows) == 1319
    wrong = [r["answer"][-60:] for r in rows if gsm8k_reward(r["answer"], r["answer"]) != 1.0]
    assert not wrong, f"gold solutions graded wrong: {wrong[:5]}"


# -----------------------------------------------------------------------------
# tba.py, searcher.py, run_gsm8k.py: real processes with the tiny preset

def tiny_args(tmp_path, cache_dir, *extra):
    """A run of the tiny preset shrunk to seconds: a 20-step SFT on 400 problems, a short RL run."""
    return [sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "tiny", "--cache-dir", str(cache_dir),
            "--run-dir", str(tmp_path / "run"), "--tiny-train-size", "400", "--tiny-eval-size", "20",
            "--tiny-sft-steps", "20", "--eval-size", "20", "--initial-completions", "64", "--max-new-tokens", "24",
            "--log-every", "1", *extra]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tba-cache")


def read_metrics(tmp_path, evals=False):
    """The records of metrics.jsonl (strict JSON: no NaN): the training steps' only, or with the final
    evaluation's (evals=True)."""
    def no_nan(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [r for r in (json.loads(line, parse_constant=no_nan) for line in f) if evals or "loss/train" in r]


def test_smoke_run_writes_metrics(tmp_path, cache_dir):
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "12", "--sync-every", "2"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path, evals=True)
    assert [r["step"] for r in rows] == list(range(13)), "12 training records, then the final evaluation's"
    final = rows.pop()
    assert set(final) == {"step", "eval/accuracy", "eval/response_tokens", "time/eval_since_launch"}
    assert "eval/accuracy" in rows[0], "the evaluation before training is in the record of step 0"
    keys = {"loss/train", "loss/log_Z", "loss/kl", "reward/batch", "reward/fresh", "sched/beta", "sched/lr",
            "buffer/size", "staleness/mean", "staleness/max", "staleness/hist", "perf/samples_per_s", "perf/busy"}
    assert keys <= set(rows[0]), f"missing metrics: {keys - set(rows[0])}"
    assert all(np.isfinite(r["loss/train"]) for r in rows)
    assert re.fullmatch(r"accuracy: before [\d.]+% -> after [\d.]+%", out.stdout.splitlines()[-1])
    assert "\r" not in out.stdout + out.stderr, "a redirected log has no progress-bar carriage returns"
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    result = json.load(open(tmp_path / "run" / "result.json"))
    assert result["headline"] == "accuracy" and result["after"]["eval/accuracy"] == final["eval/accuracy"]
    assert result["before"]["eval/accuracy"] == rows[0]["eval/accuracy"]
    assert os.path.isfile(tmp_path / "run" / "final" / "model.safetensors")
    assert json.load(open(tmp_path / "run" / "config.json"))["steps"] == 12


def test_most_on_policy_staleness_bound_and_weights_reach_searchers(tmp_path, cache_dir):
    k = 2
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "24", "--sync-every", str(k), "--m", "1.0"),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    # the latest round was formed round_age steps ago from items at most k steps older than that sync:
    # k - 1 + k = 2k - 1 when every sync brings data, k more for each sync in a row that brought none
    for r in rows:
        assert r["staleness/latest_max"] <= r["buffer/round_age"] + k, r
    assert all(r["staleness/latest_max"] <= 2 * k - 1 for r in rows if r["buffer/round_age"] < k)
    assert max(r["searcher/version"] for r in rows) > 0, "searchers never generated with published weights"


def test_reference_reset_makes_kl_zero(tmp_path, cache_dir):
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "9", "--ref-reset-every", "4", "--lr", "1e-3"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    for r in rows:
        if r["step"] in (4, 8):
            assert r["ref/version"] == r["step"]
            assert abs(r["loss/kl"]) < 1e-4, f"right after a reset pi_ref == pi, but kl = {r['loss/kl']}"
    assert any(abs(r["loss/kl"]) > 1e-3 for r in rows if r["step"] in (3, 7)), "the policy should move away between resets"


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


def test_killed_searcher_ends_run_nonzero_without_orphans(tmp_path, cache_dir):
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    children = _children(proc.pid)
    searchers = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert searchers, "no searcher process found"
    t0 = time.time()
    os.kill(searchers[0], signal.SIGKILL)
    rest, _ = proc.communicate(timeout=30)
    rc = proc.returncode
    assert rc != 0
    assert time.time() - t0 < 10, "the run should stop within 10 s of a searcher dying"
    assert "searcher-0" in rest and "died" in rest, rest[-2000:]
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)], "processes outlived the run"


@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)])
def test_stop_signal_checkpoints_and_stops_everything(tmp_path, cache_dir, signum, group):
    # Ctrl-C reaches the whole process group; Slurm, Docker and systemd send SIGTERM to the trainer
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    children = _children(proc.pid)
    t0 = time.time()
    os.killpg(proc.pid, signum) if group else os.kill(proc.pid, signum)
    rest, _ = proc.communicate(timeout=60)
    seconds = time.time() - t0
    assert proc.returncode == 128 + signum, rest[-2000:]
    name = signal.Signals(signum).name
    last = rest.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {name}; checkpoint ") and "continue with --resume" in last, last
    assert "Traceback" not in rest
    assert seconds < 20, f"stopping took {seconds:.1f} s"
    step = int(re.search(r"step-(\d+)", last).group(1))
    assert json.load(open(tmp_path / "run" / "checkpoints" / f"step-{step:06d}" / "state.json"))["step"] == step
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)], "processes outlived the run"


@pytest.mark.parametrize("flags,message", [
    (["--m", "1.5"], "--m must be in"),
    (["--responses-per-query", "9", "--samples-per-prompt", "8"], "must be <= --samples-per-prompt"),
    (["--batch-size", "60", "--responses-per-query", "8"], "multiple of --responses-per-query"),
])
def test_config_errors_before_spawn(tmp_path, flags, message, capsys):
    import run_gsm8k
    assert run_gsm8k.cli(["--preset", "tiny", "--run-dir", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


def test_unknown_flag_is_an_error():
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--no-such-flag", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --no-such-flag" in out.stderr


def test_shared_weights_reach_a_spawned_process():
    import torch.multiprocessing as mp
    from rollout import SharedWeights
    ctx = mp.get_context("spawn")
    model = torch.nn.Linear(3, 2)
    shared = SharedWeights(ctx)
    shared.allocate(model, version=0)
    with torch.no_grad():
        model.weight.fill_(7.0)
    shared.publish(model, version=5)
    results = ctx.Queue()
    child = ctx.Process(target=_pull_in_child, args=(shared, results))
    child.start()
    version, total = results.get(timeout=60)
    child.join(timeout=30)
    assert version == 5 and total == pytest.approx(7.0 * 6 + model.bias.sum().item(), abs=1e-5)


def _pull_in_child(shared, results):
    model = torch.nn.Linear(3, 2)
    version = shared.pull(model, have_version=-1)
    results.put((version, sum(p.sum().item() for p in model.parameters())))


# -----------------------------------------------------------------------------
# The paper preset's code path with tiny random models of real architectures

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


@pytest.mark.parametrize("arch,cls", [("gpt_neox", "GPTNeoXForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_paper_preset_code_path_with_tiny_random_models(tmp_path, arch, cls):
    data_dir = _gsm8k_dir(tmp_path)
    rows = load_gsm8k(os.path.join(data_dir, "train.jsonl"))
    model_dir = _tiny_random_hf_model(arch, tmp_path / "model", [r["question"] + " " + r["answer"] for r in rows[:2000]])
    cmd = [sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "paper", "--model", model_dir,
           "--data-dir", data_dir, "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--searcher-device", "cpu",
           "--backend", "hf", "--num-searchers", "1", "--trainer-threads", "1", "--searcher-threads", "1",
           "--steps", "3", "--batch-size", "4", "--responses-per-query", "2", "--samples-per-prompt", "2",
           "--prompts-per-search", "2", "--micro-batch-queries", "1", "--initial-completions", "4",
           "--max-new-tokens", "8", "--eval-size", "6", "--warmup-steps", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [0, 1, 2] and all(np.isfinite(r["loss/train"]) for r in metrics)
    config = json.load(open(tmp_path / "run" / "final" / "config.json"))
    assert config["architectures"] == [cls]
    resolved = json.load(open(tmp_path / "run" / "config.json"))
    assert resolved["dtype"] == "float32" and resolved["beta_start"] == 0.014 and resolved["m"] == 0.95


class _GoldPolicy:
    """A stand-in policy that 'generates' the gold solution of each prompt, through a real tokenizer."""

    def __init__(self, tokenizer, solutions):
        self.tokenizer, self.solutions = tokenizer, solutions

    def generate(self, prompts, n=1, temperature=1.0, greedy=False):
        from searcher import completions
        ids = [self.tokenizer(s, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
               for s in self.solutions[:len(prompts)]]
        return completions(self.tokenizer, ids)


@pytest.mark.skipif(not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")), reason="real GSM8K not found at ../shared/data/gsm8k")
def test_eval_routine_scores_gold_solutions_100_percent():
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))
    task = GSM8KTask.from_rows(rows[:1], rows)
    tokenizer = _bpe_tokenizer("gpt_neox", [r["answer"] for r in rows[:500]])
    metrics = task.evaluate(_GoldPolicy(tokenizer, [m["answer"] for m in task.eval_metas]), len(rows))
    assert metrics["accuracy"] == 1.0 and len(task.eval_prompts) == 1319


def test_paper_preset_dry_run_prints_paper_values():
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "paper", "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    values = {k.strip(): v for k, v in (line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)}
    # the official GSM8K run (bbartoldson/TBA launch script, config and trainer), value for value
    want = {"model": "realtreetune/rho-1b-sft-GSM8K", "lr": "1e-05", "warmup_steps": "50", "stable_steps": "350",
            "decay_steps": "600", "lr_decay": "cosine", "grad_clip": "0.0", "temperature": "0.7",
            "max_new_tokens": "512", "batch_size": "140", "responses_per_query": "20", "samples_per_prompt": "24",
            "m": "0.95", "sync_every": "2", "beta_start": "0.014", "beta_end": "0.004", "beta_decay_steps": "500",
            "beta_stop_step": "None", "num_searchers": "3", "initial_completions": "500", "steps": "700",
            "max_prompt_tokens": "256", "capacity_per_query": "100", "prioritization": "uniform", "seed": "42",
            "loss_temperature": "None", "eval_every": "0", "prompts_per_search": "3", "weight_decay": "0.0"}
    assert {k: values[k].strip() for k in want} == want
    assert "process-to-device plan" in out.stdout and "searcher-2" in out.stdout


# -----------------------------------------------------------------------------
# Runs that survive: checkpoints, resume, searcher failures, non-finite steps, bad input

def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _weights(model_dir):
    """The tensors of a save_pretrained directory."""
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_resume_in_sync_mode_reproduces_the_uninterrupted_run(tmp_path, cache_dir):
    common = ["--sync", "--trainer-threads", "1", "--eval-every", "0", "--lr", "1e-4"]
    straight = subprocess.run(tiny_args(tmp_path / "a", cache_dir, "--steps", "20", *common),
                              capture_output=True, text=True, timeout=180)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = subprocess.run(tiny_args(tmp_path / "b", cache_dir, "--steps", "10", *common),
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert open(tmp_path / "b" / "run" / "checkpoints" / "latest").read().strip() == "step-000010"
    resumed = subprocess.run(tiny_args(tmp_path / "b", cache_dir, "--steps", "20", *common,
                                       "--resume", str(tmp_path / "b" / "run")),
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "at step 10" in resumed.stdout
    a, b = _weights(tmp_path / "a" / "run" / "final"), _weights(tmp_path / "b" / "run" / "final")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from the straight run by {worst}"
    sft = _weights(json.load(open(tmp_path / "a" / "run" / "config.json"))["model"])
    moved = max((a[k] - sft[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the runs should have changed the weights at all"
    steps = [r["step"] for r in read_metrics(tmp_path / "b")]
    assert steps == list(range(20)), "metrics.jsonl continues across the resume"


def test_checkpoint_files_load_without_pickle(tmp_path, cache_dir):
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "6", "--checkpoint-every", "2", "--sync"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step-000004", "step-000006"], "the two newest are kept"
    for folder in (root / "step-000006" / "policy", tmp_path / "run" / "final"):
        mode = os.stat(folder / "model.safetensors").st_mode & 0o777
        assert mode == 0o666 & ~_umask(), f"{folder}/model.safetensors has mode {oct(mode)}"
    ckpt = root / "step-000006"
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    torch.load(ckpt / "rng.pt", weights_only=True)
    state = json.load(open(ckpt / "state.json"))
    assert state["step"] == 6 and json.load(open(ckpt / "buffer.json"))["items"]
    assert os.path.isfile(ckpt / "policy" / "model.safetensors") and os.path.isfile(ckpt / "ref" / "model.safetensors")


@pytest.mark.parametrize("policy", ["restart", "abort"])
def test_killed_searcher_restart_or_abort(tmp_path, cache_dir, policy):
    args = tiny_args(tmp_path, cache_dir, "--steps", "100000", "--on-searcher-failure", policy, "--num-searchers", "2")
    proc = _popen(args)
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"step\s+\d+ \| loss", line):
            break
    searchers = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert len(searchers) == 2
    os.kill(searchers[0], signal.SIGKILL)
    if policy == "abort":
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "searcher-0" in rest and "died with exit code -9" in rest
    else:
        for line in proc.stdout:  # the run goes on: wait for the restart and a few more steps
            lines.append(line)
            if "restarting it (1/3)" in line:
                break
        steps_after = 0
        for line in proc.stdout:
            if re.search(r"step\s+\d+ \| loss", line):
                steps_after += 1
                if steps_after == 3:
                    break
        assert steps_after == 3, "the run should continue after the restart"
        new = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(new) == 2 and searchers[0] not in new
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
        searchers = searchers + new
    watchdog.cancel()
    time.sleep(0.5)
    assert not [p for p in searchers if _alive(p)], "processes outlived the run"


def test_nonfinite_steps_are_skipped_then_abort(tmp_path, cache_dir):
    import config
    import run_gsm8k
    import tba
    cfg, _ = config.parse_config(run_gsm8k.GSM8KConfig, run_gsm8k.PRESETS, [
        "--preset", "tiny", "--cache-dir", str(cache_dir), "--run-dir", str(tmp_path / "run"), "--sync",
        "--tiny-train-size", "400", "--tiny-eval-size", "20", "--tiny-sft-steps", "20", "--eval-size", "4",
        "--max-new-tokens", "8", "--steps", "50", "--max-nonfinite-steps", "3"])
    os.makedirs(cfg.run_dir)
    task = run_gsm8k.make_task(cfg, "tiny")
    before = _weights(cfg.model)
    with pytest.raises(tba.NonFiniteError, match="3 steps in a row"):
        tba.train(cfg, _NaNTask(task.prompts, task.metas, task.eval_prompts, task.eval_metas))
    rows = read_metrics(tmp_path)
    assert [r["grad/skipped"] for r in rows] == [1, 1], "the two logged steps were skipped"
    assert not os.path.exists(tmp_path / "run" / "checkpoints"), "no checkpoint written from a failing run"
    assert before.keys() and all(torch.isfinite(t).all() for t in before.values())


class _NaNTask(GSM8KTask):
    def make_scorer(self, device="cpu"):
        return lambda prompts, completions, metas: [float("nan")] * len(completions)


def test_unwritable_run_dir_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--run-dir", str(blocker / "run")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--run-dir" in out.stderr and "not writable" in out.stderr
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--resume", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no checkpoint there" in out.stderr


def test_tokenizer_without_pad_or_eos(tmp_path):
    from searcher import load_model
    from transformers import GPT2Config, GPT2LMHeadModel
    tokenizer = _bpe_tokenizer("gpt_neox", ["one two three four five six seven"] * 20)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "m")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "m")
    _, loaded = load_model(str(tmp_path / "m"))
    assert loaded.pad_token_id == loaded.eos_token_id, "no pad token: EOS pads (padding is masked anyway)"
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="has no EOS token"):
        load_model(str(tmp_path / "m"))


def test_long_prompts_are_skipped_and_counted(capsys):
    from tba import drop_long_prompts
    tokenizer = _bpe_tokenizer("gpt_neox", ["short words and a much longer question here"] * 20)
    rows = [{"question": q, "answer": "#### 1"} for q in ("short", "a much longer question here " * 20, "words")]
    task = drop_long_prompts(GSM8KTask.from_rows(rows, rows), tokenizer, max_tokens=40)
    assert len(task.prompts) == 2 and len(task.metas) == 2 and len(task.eval_prompts) == 2
    assert "skipped 1 of 3 training" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="leaves no training"):
        drop_long_prompts(GSM8KTask.from_rows(rows, rows), tokenizer, max_tokens=2)


def test_gsm8k_download_error_when_offline(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request
    from rewards import gsm8k_path

    def offline(url, filename):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlretrieve", offline)
    with pytest.raises(ConfigError, match="could not download GSM8K train .*pass --data-dir"):
        gsm8k_path("train", "", str(tmp_path))
    assert gsm8k_path("test", "/some/dir", str(tmp_path)) == "/some/dir/test.jsonl", "--data-dir wins, no download"


# -----------------------------------------------------------------------------
# Runs that never lose work (issue 11): bad flags, run directories, resume, dead and stuck processes

def _cli(tmp_path, *flags):
    """run_gsm8k's entry point in this process: (exit code, stderr lines)."""
    import run_gsm8k
    import multiprocessing
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        old, sys.stderr = sys.stderr, f
        try:
            rc = run_gsm8k.cli(list(flags))
        finally:
            sys.stderr = old
    assert not multiprocessing.active_children(), "a refused run spawned processes"
    return rc, err.read_text().strip().splitlines()


@pytest.mark.parametrize("flags,message", [
    (["--responses-per-query", "0"], "--responses-per-query must be > 0"),
    (["--micro-batch-queries", "0"], "--micro-batch-queries must be > 0"),
    (["--log-every", "0"], "--log-every must be > 0"),
    (["--reward-temp", "0"], "--reward-temp must be a finite number > 0"),
    (["--prompts-per-search", "0"], "--prompts-per-search must be > 0"),
    (["--micro-batch", "0"], "--micro-batch must be > 0"),
    (["--searcher-device", "cuda:0"], "--searcher-device cuda:0: 0 CUDA device(s) visible"),
    (["--device", "cuda:0"], "--device cuda:0: 0 CUDA device(s) visible"),
    (["--device", "gpu"], "--device gpu: expected auto, cpu or cuda:N"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--capacity-per-query", "0"], "--capacity-per-query must be > 0"),
    (["--trainer-threads", "0"], "--trainer-threads must be > 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be > 0"),
    (["--objective", "ppo"], "--objective must be one of tb, rloo, grpo, dr_grpo"),
    (["--lr-decay", "step"], "--lr-decay must be cosine or linear"),
    (["--model", "does-not-exist"], "--model does-not-exist: no such directory, and not a hub id"),
])
def test_every_bad_flag_is_one_line_before_anything_starts(tmp_path, flags, message):
    rc, err = _cli(tmp_path, "--run-dir", str(tmp_path / "run"), *flags)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not os.path.exists(tmp_path / "run"), "nothing is written for a refused run"


def test_model_directory_without_config_is_named(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    rc, err = _cli(tmp_path, "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path / "not-a-model"))
    assert rc == 2 and err == [f"error: --model {tmp_path / 'not-a-model'} is a directory without config.json; "
                               "expected a save_pretrained directory or a hub id"]


def test_data_files_utf8_bom_nonutf8_and_long_lines(tmp_path):
    from rewards import MAX_LINE_BYTES
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "q", "answer": "#### 1"}).encode() + b"\n")
    assert load_gsm8k(str(bom)) == [{"question": "q", "answer": "#### 1"}], "a UTF-8 byte-order mark is fine"
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(ConfigError, match=r"latin1.jsonl:2: not UTF-8"):
        load_gsm8k(str(latin))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "x" * (MAX_LINE_BYTES + 10), "answer": "#### 1"}) + "\n")
    with pytest.raises(ConfigError, match=r"long.jsonl:1: line longer than"):
        load_gsm8k(str(long))


def test_bad_data_dir_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "paper", "--device", "cpu",
                          "--searcher-device", "cpu", "--data-dir", str(bad), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == f"error: {bad / 'train.jsonl'}:2: not valid JSON " \
                                                         "(Expecting property name enclosed in double quotes)"


def test_run_dir_belongs_to_one_run(tmp_path, cache_dir):
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    try:
        second = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "2"), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip() == f"error: --run-dir {tmp_path / 'run'} is in use by another run (pid {proc.pid})"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "the first run was not disturbed by the second"
    # the directory now holds a run: a new one needs --resume or --overwrite
    rc, err = _cli(tmp_path, *tiny_args(tmp_path, cache_dir)[2:])
    assert rc == 2 and err[0].startswith(f"error: --run-dir {tmp_path / 'run'} holds an earlier run (config.json, "
                                          "metrics.jsonl, checkpoints); continue it with --resume")
    rc, err = _cli(tmp_path, "--resume", str(tmp_path / "run"), "--run-dir", str(tmp_path / "elsewhere"))
    assert rc == 2 and err == [f"error: --resume {tmp_path / 'run'} continues that run in its own directory; "
                               f"drop --run-dir {tmp_path / 'elsewhere'}"]


def test_resume_refuses_a_changed_run_accepts_harmless_changes_and_falls_back(tmp_path, cache_dir):
    run = tmp_path / "run"
    first = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "6", "--checkpoint-every", "2", "--eval-every", "0"),
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    resume = ["--resume", str(run), *tiny_args(tmp_path, cache_dir)[4:6], *tiny_args(tmp_path, cache_dir)[8:]]
    rc, err = _cli(tmp_path, *resume, "--lr", "1e-4", "--objective", "rloo")
    assert rc == 2 and err == [f"error: --resume {run}: the run was saved with --objective tb --lr 2e-05, "
                               "now --objective rloo --lr 0.0001; pass --allow-config-change to continue anyway"]
    rc, err = _cli(tmp_path, *resume, "--sync")
    assert rc == 2 and "the run was saved with --sync False, now --sync True" in err[0]
    # the newest checkpoint is corrupt: resume names the file and uses the one before; --steps may change
    (run / "checkpoints" / "step-000006" / "policy" / "model.safetensors").write_bytes(b"not a safetensors file")
    out = subprocess.run([sys.executable, os.path.join(HERE, "run_gsm8k.py"), *resume, "--steps", "8", "--log-every", "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"cannot resume from {run / 'checkpoints' / 'step-000006' / 'policy' / 'model.safetensors'}" in out.stdout
    assert "resuming from" in out.stdout and "step-000004 at step 4" in out.stdout
    changes = next(line for line in out.stdout.splitlines() if line.startswith("resume: changed since the checkpoint: "))
    assert "--steps 6 -> 8" in changes and "--log-every 1 -> 2" in changes, changes
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7], "the metrics continue from the checkpoint that was used"
    names = sorted(os.listdir(run / "checkpoints"))
    assert names == ["latest", "step-000006", "step-000008"], "the newest two by time: the rewritten 6 and 8"
    assert open(run / "checkpoints" / "latest").read().strip() == "step-000008"


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


def test_searchers_exit_when_the_trainer_is_killed_with_a_full_queue(tmp_path, cache_dir):
    # merging only at step 0 leaves the searcher blocked on a full queue of 2 batches
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "100000", "--sync-every", "100000", "--queue-size", "2"))
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    for line in proc.stdout:
        if re.search(r"step\s+5 \| loss", line):
            break
    watchdog.cancel()
    time.sleep(3)  # the searcher fills its queue and waits on put()
    family = _descendants(proc.pid)
    assert len(family) >= 2, "a searcher and multiprocessing's resource tracker"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    left = _wait_gone(family, 15)
    assert not left, f"processes outlived the trainer: {left}"


def _start_in_the_warm_start(tmp_path):
    """A run with a fresh cache, returned once the trainer is busy with a (long) SFT warm start while the
    searchers wait for their job; and the process family at that moment."""
    proc = _popen([sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--cache-dir", str(tmp_path / "cache"),
                   "--run-dir", str(tmp_path / "run"), "--tiny-train-size", "400", "--tiny-sft-steps", "100000"])
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    for line in proc.stdout:
        if "SFT of a" in line:
            break
    watchdog.cancel()
    return proc, _descendants(proc.pid)


def test_searchers_exit_when_the_trainer_is_killed_before_their_job(tmp_path):
    proc, family = _start_in_the_warm_start(tmp_path)
    assert family, "the searcher starts before the warm start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not _wait_gone(family, 15), "processes outlived the trainer"


def test_ctrl_c_during_the_sft_warm_start_exits_cleanly(tmp_path):
    proc, family = _start_in_the_warm_start(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in rest, rest[-2000:]
    assert rest.strip().splitlines()[-1] == "stopped by SIGINT; before training started: nothing to resume; all processes stopped"
    left = os.listdir(tmp_path / "cache") if os.path.exists(tmp_path / "cache") else []
    assert not [n for n in left if ".tmp" in n], "no half-written warm start is left"
    assert not _wait_gone(family, 15)


def test_a_stopped_searcher_ends_the_run_naming_it(tmp_path, cache_dir):
    # SIGSTOP the searcher as soon as it exists: the initial fill never completes
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "50", "--searcher-timeout", "15"))
    family = []
    deadline = time.time() + 60
    while not family and time.time() < deadline:
        family = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        time.sleep(0.05)
    os.kill(family[0], signal.SIGSTOP)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, rest[-2000:]
    assert re.search(r"error: searcher-0 \(pid \d+\) sent nothing for \d+ s \(--searcher-timeout 15.0\)", rest), rest[-2000:]
    assert not _wait_gone(family, 15), "the stopped searcher was not cleaned up"


def test_an_empty_sync_is_logged(capsys):
    import metrics
    import tba
    from types import SimpleNamespace

    class Silent:
        received = 64

        def merge(self, buffer, step):
            return []
    run = SimpleNamespace(rollout=Silent(), buffer=ReplayBuffer(4), start=0, meter=metrics.Meter(),
                          state={"fresh_reward": 0.5, "searcher_version": 0})
    tba.merge(run, 8)
    assert "sync at step 8: no new trajectories from the searchers" in capsys.readouterr().out
    assert run.state["fresh_count"] == 0


# A bench run's metrics.jsonl: an evaluation before training, three training steps, three evaluations after.
BENCH_RECORDS = [{"step": 0, "eval/accuracy": 0.2, "time/eval_since_launch": 5.0},
                 *({"step": s, "loss/train": 1.0, "time/since_launch": 6.0 + s, "time/train": 0.3, "perf/busy": 0.9,
                    "perf/tokens_per_s": 100.0, "buffer/latest_frac": 1.0, "staleness/mean": 1.0, "staleness/max": 3,
                    "grad/norm": 2.0, "loss/kl": 0.1, "loss/log_Z_std": 0.5} for s in range(3)),
                 {"step": 10, "eval/accuracy": 0.75, "time/eval_since_launch": 9.0},
                 {"step": 20, "eval/accuracy": 0.65, "time/eval_since_launch": 12.0},
                 {"step": 30, "eval/accuracy": 0.8, "time/eval_since_launch": 15.0}]


def test_bench_interval_and_run_summary():
    import bench
    mean, half = bench.interval([1.0, 2.0, 3.0])  # sd 1, t(2 dof) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert bench.interval([5.0])[0] == 5.0 and math.isnan(bench.interval([5.0])[1])
    assert bench.fmt([0.5, 0.7, None], 100) == f"60.0 ± {100 * 12.706 * math.sqrt(0.02) / math.sqrt(2):.1f}"
    row = bench.summarise(BENCH_RECORDS, "eval/accuracy", target=0.7)
    assert row["score"] == pytest.approx((0.75 + 0.65 + 0.8) / 3), "the mean of the last three evaluations"
    assert row["time_to_target_s"] == 9.0 and row["startup_s"] == pytest.approx(5.7) and row["staleness_max"] == 3
    short = bench.summarise(BENCH_RECORDS[:-2], "eval/accuracy", target=0.7)  # evaluations at steps 0 and 10 only
    assert short["score"] == 0.75, "the evaluation before training never counts in the score"


def test_bench_reuse_reads_finished_runs_back(tmp_path, monkeypatch):
    import bench
    cfg = bench.BenchConfig(out=str(tmp_path), reuse=True, target=0.7)
    run_dir = tmp_path / "runs" / "stale-tb-k8-seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BENCH_RECORDS))
    (run_dir / "result.json").write_text(json.dumps({"headline": "accuracy"}))
    bench.write_runs(str(tmp_path / "runs.csv"), [{"name": "stale-tb-k8-seed1", "seed": 1, "flags": "--sync-every 8",
                                                   "run_wall_s": 170.5, "score": 0.0}])
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    row = bench.run(cfg, "run_gsm8k.py", "stale-tb-k8-seed1", ["--sync-every", "8"], 1)
    assert row["score"] == pytest.approx(0.733333, abs=1e-6) and row["run_wall_s"] == 170.5 and row["seed"] == 1
    assert row["curve"][-1] == (30, 0.8), "summarised again from the run's own files, not copied from runs.csv"
    assert bench.reused(cfg, str(run_dir), "stale-tb-k8-seed1", ["--sync-every", "4"]) is None, "other flags"
    assert bench.reused(cfg, str(tmp_path / "runs" / "x"), "x", []) is None, "never finished"


def test_bench_runs_csv_keeps_earlier_runs(tmp_path):
    import bench
    path = str(tmp_path / "runs.csv")
    bench.write_runs(path, [{"name": "a", "score": 0.1, "curve": [(0, 0.1)]}, {"name": "b", "score": 0.2}])
    bench.write_runs(path, [{"name": "b", "score": 0.3, "eval_kl": 0.05}])  # b again, with a new column
    with open(path) as f:
        assert f.read().splitlines() == ["name,score,eval_kl", "a,0.1,", "b,0.3,0.05"]
