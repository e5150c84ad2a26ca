"""
The algorithm's tests: the VarGrad TB loss and log Z against closed forms (Appendix A's gradient, the TB/RLOO
identity), sequence log-probs, the schedules, the buffer's semantics against expected frequencies, the GSM8K
grader (on real GSM8K when ../shared has it), and the tiny preset end to end: a smoke run, the staleness bound
of most-on-policy draws, the reference reset (TBA'). CPU only, no network. Operations (faults, resume, the
command line), the baselines, the other tasks and the backends are tested in tests/.

Run: python -m pytest -q test_tba.py        (the quick subset: python -m pytest -q -m quick)
"""

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from baselines import rloo_loss, tb_rloo_gradient_ratio
from buffer import ReplayBuffer
from loss import (beta_schedule, make_batch, offpolicy_metrics, sequence_logprobs, tb_trust_region_loss, vargrad_tb_loss,
                  wsd_schedule)
from rewards import GSM8KTask, extract_answer, gold_answer, gsm8k_reward, load_gsm8k
from tests.helpers import GSM8K_DIR, ROOT, _bpe_tokenizer, read_metrics, tiny_args, traj

quick = pytest.mark.quick  # no process, no training run: the whole of it runs in seconds


# -----------------------------------------------------------------------------
# loss.py

@quick
def test_vargrad_loss_hand_computed():
    # one prompt, K = 2, beta = 0.5: r/beta = (2, 0); kl = (-1, 1); log_Z = mean(2 - -1, 0 - 1) = 1
    # residuals: log_Z + kl - r/beta = (1 - 1 - 2, 1 + 1 - 0) = (-2, 2) -> loss = mean(4, 4) = 4
    logp = torch.tensor([[-3.0, -1.0]])
    ref_logp = torch.tensor([[-2.0, -2.0]])
    reward = torch.tensor([[1.0, 0.0]])
    assert vargrad_tb_loss(logp, ref_logp, reward, beta=0.5).item() == pytest.approx(4.0)


@quick
def test_vargrad_loss_and_gradient_vanish_at_optimum():
    torch.manual_seed(0)
    Q, K, beta = 3, 6, 0.1
    ref_logp = -20 * torch.rand(Q, K, dtype=torch.float64)
    reward = torch.rand(Q, K, dtype=torch.float64)
    c = 5 * torch.randn(Q, 1, dtype=torch.float64)  # any per-prompt constant: log Z(x)
    logp = (ref_logp + reward / beta - c).requires_grad_()
    loss = vargrad_tb_loss(logp, ref_logp, reward, beta)
    loss.backward()
    assert loss.item() < 1e-20, f"loss at the optimum should be 0, got {loss.item()}"
    assert logp.grad.abs().max().item() < 1e-10, "gradient at the optimum should be 0"


@quick
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


@quick
def test_offpolicy_metrics_on_a_hand_built_batch():
    mu = torch.tensor([[-3.0, -5.0], [-2.0, -7.0]])
    on = offpolicy_metrics(mu.clone(), mu, eps=0.2)
    assert on == {"offpolicy/drift": 0.0, "offpolicy/drift_p90": 0.0, "offpolicy/ratio_out": 0.0}, "on-policy: no drift"
    shift = torch.tensor([[0.1, -0.3], [0.0, 0.5]])  # log pi - log mu; the band is [log 0.8, log 1.2] = [-0.223, 0.182]
    off = offpolicy_metrics(mu + shift, mu, eps=0.2)
    assert off["offpolicy/drift"] == pytest.approx(0.225, abs=1e-6)  # (0.1 + 0.3 + 0 + 0.5) / 4
    assert off["offpolicy/drift_p90"] == pytest.approx(0.44, abs=1e-6)  # linear interpolation: 0.3 + 0.7 * 0.2
    assert off["offpolicy/ratio_out"] == 0.5, "-0.3 and +0.5 are outside"
    unknown = offpolicy_metrics(mu + shift, torch.tensor([[math.nan, -5.0], [-2.0, math.nan]]), eps=0.2)
    assert unknown["offpolicy/drift"] == pytest.approx(0.15, abs=1e-6), "responses without mu are left out"
    assert math.isnan(offpolicy_metrics(mu, torch.full_like(mu, math.nan), 0.2)["offpolicy/drift"])


@quick
def test_tb_trust_region_is_plain_tb_on_policy():
    torch.manual_seed(0)
    ref_logp, reward, beta = -5 * torch.rand(3, 4), torch.randint(0, 2, (3, 4)).float(), 0.1
    logp = (-5 * torch.rand(3, 4)).requires_grad_()
    plain = logp.detach().clone().requires_grad_()
    loss, dropped = tb_trust_region_loss(logp, ref_logp, reward, beta, logp.detach(), eps=0.2)  # mu = pi: every ratio 1
    loss.backward()
    vargrad_tb_loss(plain, ref_logp, reward, beta).backward()
    assert loss.item() == pytest.approx(vargrad_tb_loss(plain, ref_logp, reward, beta).item()) and dropped == 0.0
    assert torch.allclose(logp.grad, plain.grad), "on-policy, the trust region's gradient is Eq. 4's"
    unknown, _ = tb_trust_region_loss(plain, ref_logp, reward, beta, torch.full_like(plain, math.nan), eps=0.2)
    assert unknown.item() == pytest.approx(loss.item()), "a response without a behaviour log-prob counts on-policy"


@quick
def test_tb_trust_region_drops_a_residual_once_its_ratio_left_the_band():
    mu = torch.full((1, 4), -2.0)
    ref_logp, reward, beta = mu.clone(), torch.tensor([[1.0, 0.0, 0.0, 1.0]]), 0.5
    logp = (mu + torch.tensor([[0.5, 0.5, -0.5, 0.0]])).requires_grad_()  # ratios e^0.5, e^0.5, e^-0.5, 1
    kl = logp.detach() - ref_logp
    delta = (reward / beta - kl).mean() + kl - reward / beta  # log_Z + kl - r / beta = [-0.625, 1.375, 0.375, -1.125]
    assert delta[0].tolist() == pytest.approx([-0.625, 1.375, 0.375, -1.125])
    loss, dropped = tb_trust_region_loss(logp, ref_logp, reward, beta, mu, eps=0.2)
    loss.backward()
    # descent moves logp against delta: 0 is pushed up with its ratio above 1.2 -> dropped; 1 is above but
    # pushed down -> kept; 2 is pushed down with its ratio below 0.8 -> dropped; 3 is on-policy -> kept
    assert dropped == 0.5 and logp.grad[0].tolist() == pytest.approx([0.0, 2 * 1.375 / 4, 0.0, 2 * -1.125 / 4])


@quick
def test_vargrad_log_Z_is_detached():
    # if log_Z carried gradient the per-prompt sum of gradients would be 0 only by accident; with it detached
    # the gradient is the Appendix A form, whose per-prompt sum is 0 (advantages are centred)
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


@quick
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


@quick
def test_sequence_logprobs_left_padding_invariant_on_real_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)).eval()
    prompt, response = [5, 6, 7, 8], [9, 10, 11]
    alone = sequence_logprobs(model, *make_batch([prompt], [response], 0))
    batched = sequence_logprobs(model, *make_batch([prompt, [1] * 9], [response, [2] * 6], 0))
    assert batched[0].item() == pytest.approx(alone[0].item(), abs=1e-4), "extra left/right padding changed the log-prob"


@quick
def test_beta_schedule():
    assert beta_schedule(0, 0.014, 0.004, 500) == pytest.approx(0.014)
    assert beta_schedule(250, 0.014, 0.004, 500) == pytest.approx(0.009)
    assert beta_schedule(500, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_schedule(900, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_schedule(100, 0.1, 0.1, 500) == pytest.approx(0.1), "constant when start == end"
    assert beta_schedule(199, 0.1, 0.01, 1000, stop_step=200) == pytest.approx(0.1 - 0.09 * 199 / 1000)
    assert beta_schedule(200, 0.1, 0.01, 1000, stop_step=200) == pytest.approx(0.01), "jumps to beta_end at stop_step"


@quick
def test_wsd_schedule_cosine_as_official_and_linear():
    # official GSM8K: warmup 50, stable 350, cosine decay over 600, stopped at step 700; update u uses lambda(u)
    lr = functools.partial(wsd_schedule, warmup=50, stable=350, decay=600)
    assert lr(0) == pytest.approx(1 / 50) and lr(48) == pytest.approx(49 / 50) and lr(49) == 1.0
    assert lr(398) == 1.0 and lr(549) == pytest.approx(0.5 * (1 + math.cos(math.pi * 150 / 600)))
    assert lr(699) == pytest.approx(0.5), "the official 700-step run ends halfway down the cosine (lr 5e-6)"
    assert lr(999) == pytest.approx(0.0) and lr(5000) == 0.0
    linear = functools.partial(wsd_schedule, warmup=0, stable=0, decay=256, decay_type="linear")  # TL;DR: linear, no warmup
    assert linear(0) == pytest.approx(255 / 256) and linear(127) == pytest.approx(0.5) and linear(255) == 0.0
    floored = functools.partial(wsd_schedule, warmup=10, stable=10, decay=10, floor=0.1, decay_type="linear")
    assert floored(24) == pytest.approx(0.1 + 0.9 * 0.5) and floored(100) == pytest.approx(0.1)
    from transformers import get_wsd_schedule  # the official code's scheduler, which loss.py writes out
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    for warmup, stable, decay, floor, kind in [(50, 350, 600, 0.0, "cosine"), (20, 180, 100, 0.1, "linear"),
                                               (0, 0, 256, 0.0, "linear"), (5, 30, 15, 0.1, "cosine")]:
        theirs = get_wsd_schedule(opt, warmup, decay, num_stable_steps=stable, decay_type=kind, min_lr_ratio=floor)
        assert all(wsd_schedule(s, warmup, stable, decay, floor, kind) == pytest.approx(theirs.lr_lambdas[0](s + 1), abs=1e-12) for s in range(1200))


@quick
def test_tb_gradient_is_a_multiple_of_rloo_with_kl_in_the_reward():
    # on a real (tiny, random) Llama: same batch, TB vs on-policy RLOO, every parameter's gradient
    from transformers import LlamaConfig, LlamaForCausalLM
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


# -----------------------------------------------------------------------------
# buffer.py

@quick
def test_buffer_dedup_keeps_newest():
    buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
    buf.add([traj(0, [1, 2], reward=0.0, version=0), traj(0, [3], version=0)])
    buf.add([traj(0, [1, 2], reward=1.0, version=5)])
    assert len(buf) == 2
    held = {t.response_ids: t for t in buf.items[0].values()}
    assert held[(1, 2)].policy_version == 5 and held[(1, 2)].reward == 1.0
    buf.add([traj(0, [1, 2], version=3)])  # a late copy from older weights does not replace the newer one
    assert {t.response_ids: t.policy_version for t in buf.items[0].values()}[(1, 2)] == 5


@quick
def test_buffer_without_dedup_keeps_every_copy_and_resumes_exactly():
    buf = ReplayBuffer(capacity_per_prompt=3, seed=0, dedup=False)
    buf.add([traj(0, [1, 2], version=0), traj(0, [1, 2], version=0)])
    buf.add([traj(0, [1, 2], version=1), traj(0, [7], version=1), traj(1, [7], version=1)])
    assert len(buf) == 4 and [t.policy_version for t in buf.items[0].values()] == [0, 1, 1], "capacity 3: oldest out"
    assert len(buf.latest[0]) == 2, "the latest round holds both new copies"
    copy = ReplayBuffer(capacity_per_prompt=1)
    copy.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert copy.dedup is False and copy.serial == buf.serial and len(copy) == 4
    draws = [[[(t.prompt_id, t.response_ids, t.policy_version) for t in g] for g in b.sample(2, 3, m=0.5)] for b in (buf, copy)]
    assert draws[0] == draws[1], "a resumed buffer draws what the original would have"


@quick
def test_buffer_evicts_oldest_by_version():
    buf = ReplayBuffer(capacity_per_prompt=3, seed=0)
    buf.add([traj(0, [i], version=v) for i, v in enumerate([4, 1, 3, 0, 2])])
    assert sorted(t.policy_version for t in buf.items[0].values()) == [2, 3, 4]
    buf.add([traj(1, [9], version=0)])
    assert len(buf) == 4 and buf.num_prompts == 2, "capacity is per prompt"


@quick
def test_buffer_m1_draws_only_latest_round():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(q, [q, i], version=0) for q in range(5) for i in range(4)])
    buf.add([traj(q, [q, 100 + i], version=2) for q in (7, 8) for i in range(4)])
    for group in buf.sample(200, 3, m=1.0):
        assert len({t.prompt_id for t in group}) == 1
        assert all(t.prompt_id in (7, 8) and t.policy_version == 2 for t in group)


@quick
def test_buffer_round_min_version_keeps_late_items_out_of_round():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(0, [1], version=4), traj(1, [2], version=2)], round_min_version=4)
    assert list(buf.latest) == [0] and len(buf) == 2
    assert all(t.prompt_id == 0 for g in buf.sample(50, 1, m=1.0) for t in g)


@quick
def test_buffer_m0_uniform_prompts():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(q, [i], version=0) for q in range(4) for i in range(3)])
    buf.add([traj(9, [0], version=1)])
    counts = np.bincount([g[0].prompt_id for g in buf.sample(10000, 1, m=0.0)], minlength=10)
    np.testing.assert_allclose(counts[[0, 1, 2, 3, 9]] / 10000, 0.2, atol=0.02)


@quick
def test_buffer_prompts_are_dealt_without_replacement():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(q, [i], version=0) for q in range(6) for i in range(3)])
    for _ in range(3):  # every 6 draws see each prompt once, for the latest round (m=1) and for all (m=0)
        assert sorted(g[0].prompt_id for g in buf.sample(6, 2, m=1.0)) == list(range(6))
        assert sorted(g[0].prompt_id for g in buf.sample(6, 2, m=0.0)) == list(range(6))


@quick
def test_buffer_empty_sync_keeps_the_last_online_round():
    # the official buffer: a sync that brings no new data leaves the last online prompt set in place,
    # and the next draws still come from it, without replacement
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(q, [q, i], version=0) for q in range(5) for i in range(4)])
    assert buf.add([traj(q, [q, 100 + i], version=2) for q in (7, 8, 9) for i in range(4)]) == 12
    assert buf.add([]) == 0, "an empty sync"
    assert buf.add([traj(0, [0, 50], version=1)], round_min_version=2) == 0, "only a late item: nothing new either"
    assert set(buf.latest) == {7, 8, 9}
    drawn = [g[0].prompt_id for g in buf.sample(6, 2, m=1.0)]
    assert sorted(drawn[:3]) == sorted(drawn[3:]) == [7, 8, 9]


@quick
def test_buffer_kept_round_never_holds_a_dropped_duplicate():
    # issue 30's crash: a sync that forms no round keeps the last one, while a newer copy (dedup) replaces one of
    # its trajectories; the kept round must not point at the dropped object (state_dict raised KeyError)
    buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
    buf.add([traj(0, [1, 2], version=4), traj(0, [3, 4], version=4)], round_min_version=0)
    buf.add([traj(0, [1, 2], version=6)], round_min_version=8)
    assert buf.state_dict()["latest"] == [[0, [[3, 4]]]]


@quick
def test_buffer_invariants_hold_for_random_rounds_duplicates_and_capacities():
    """After every add: each latest-round trajectory is stored (check()), state_dict round-trips exactly and the
    copy draws what the original draws, and sampling returns stored trajectories only."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        buf, step = ReplayBuffer(int(rng.integers(1, 5)), seed=trial, dedup=bool(rng.random() < 0.8)), 0
        for _ in range(int(rng.integers(1, 12))):
            step += int(rng.integers(0, 4))
            items = [traj(int(rng.integers(0, 4)), rng.integers(0, 3, size=2).tolist(),
                          version=int(rng.integers(max(0, step - 8), step + 1))) for _ in range(int(rng.integers(0, 9)))]
            buf.add(items, round_min_version=step - int(rng.integers(0, 5)) if rng.random() < 0.8 else 0)
            buf.check()
            if not len(buf):
                continue
            stored = {id(t) for per_query in buf.items.values() for t in per_query.values()}
            groups = buf.sample(int(rng.integers(1, 4)), int(rng.integers(1, 4)), m=float(rng.random()))
            assert all(id(t) in stored for g in groups for t in g), "a draw returned a trajectory the buffer dropped"
            copy = ReplayBuffer(1)
            copy.load_state_dict(json.loads(json.dumps(buf.state_dict())))
            copy.check()
            assert json.dumps(copy.state_dict()) == json.dumps(buf.state_dict())
            draw = lambda b: [[(t.prompt_id, t.response_ids, t.policy_version) for t in g] for g in b.sample(3, 2, m=0.5)]
            assert draw(copy) == draw(buf), "a resumed buffer draws what the original would have"


@quick
def test_buffer_check_names_the_broken_invariant():
    from buffer import InconsistentBuffer
    buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
    buf.add([traj(0, [1], version=0)])
    buf.latest[0] = [traj(0, [1], version=0)]  # a copy, not the stored object
    with pytest.raises(InconsistentBuffer, match="every latest-round trajectory is stored"):
        buf.check()


@quick
def test_buffer_softmax_frequencies():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    rewards = [0.0, 0.5, 1.0, 2.0]
    buf.add([traj(0, [i], reward=r) for i, r in enumerate(rewards)])
    T, n = 0.5, 40000
    draws = [g[0].reward for g in buf.sample(n, 1, m=0.0, prioritization="softmax", reward_temp=T)]
    expected = np.exp(np.array(rewards) / T) / np.exp(np.array(rewards) / T).sum()
    observed = np.array([draws.count(r) for r in rewards]) / n
    np.testing.assert_allclose(observed, expected, atol=0.01)
    uniform = [g[0].reward for g in buf.sample(n, 1, m=0.0, prioritization="uniform")]
    np.testing.assert_allclose(np.array([uniform.count(r) for r in rewards]) / n, 0.25, atol=0.01)


@quick
def test_buffer_softmax_draws_never_raise_for_far_apart_rewards():
    """Rewards 800 apart (exp underflows to 0 for all but one) and random finite scales: every draw of K = 2 without
    replacement succeeds, the best response first in probability."""
    buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
    buf.add([traj(0, (1,), reward=0.0), traj(0, (2,), reward=-800.0)])
    groups = buf.sample(50, 2, m=0.0, prioritization="softmax")
    assert all(sorted(t.response_ids for t in g) == [(1,), (2,)] for g in groups)
    rng = np.random.default_rng(0)
    for scale in (1.0, 1e3, 1e6, 1e300):
        buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
        buf.add([traj(0, (i,), reward=float(r)) for i, r in enumerate(rng.normal(0, scale, size=5))])
        assert all(len(g) == 4 for g in buf.sample(20, 4, m=0.0, prioritization="softmax", reward_temp=0.1))


@quick
def test_buffer_kept_round_emptied_by_drops_sends_m1_draws_to_all_prompts():
    """The rule the docstring states: a kept round (no new one formed) whose items were all replaced by newer copies
    holds nothing, and m = 1 then draws from all prompts: the newer copy, not nothing and not an error."""
    buf = ReplayBuffer(capacity_per_prompt=4, seed=0)
    buf.add([traj(0, (1,), version=4)], round_min_version=4)
    assert buf.add([traj(0, (1,), version=6), traj(1, (2,), version=6)], round_min_version=8) == 0  # (no new round)
    buf.check()
    assert not buf.latest, "every item of the kept round was replaced"
    drawn = {(t.prompt_id, t.policy_version) for g in buf.sample(10, 1, m=1.0) for t in g}
    assert drawn == {(0, 6), (1, 6)}


@quick
def test_buffer_replacement_only_when_scarce():
    buf = ReplayBuffer(capacity_per_prompt=100, seed=0)
    buf.add([traj(0, [i]) for i in range(5)])
    for group in buf.sample(100, 5, m=1.0):
        assert len({t.response_ids for t in group}) == 5, "5 candidates, k=5: no repeats"
    groups = buf.sample(10, 8, m=1.0)
    assert all(len(g) == 8 for g in groups), "k larger than the candidates: drawn with replacement"


@quick
def test_buffer_staleness_and_sizes():
    buf = ReplayBuffer(capacity_per_prompt=10, seed=0)
    buf.add([traj(0, [1], version=3), traj(1, [2], version=5)])
    assert len(buf) == 2 and buf.num_prompts == 2
    assert sorted(buf.staleness([[buf.items[0][(1,)]], [buf.items[1][(2,)]]], step=7).tolist()) == [2, 4]


# -----------------------------------------------------------------------------
# Copied alone

HIDDEN = ("transformers", "tqdm", "datasets", "peft", "vllm", "safetensors", "config", "models", "buffer", "loss")


@quick
@pytest.mark.parametrize("name,libraries", [("loss.py", ("torch",)), ("buffer.py", ("numpy",))])
def test_copied_alone_into_an_empty_folder_it_runs_with_torch_and_numpy_only(tmp_path, name, libraries):
    """loss.py and buffer.py, copied into an empty folder, run their self-checks with every other library and every
    project module hidden (an import of any of them raises ImportError)."""
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    hidden = [m for m in HIDDEN + ("numpy", "torch") if m not in libraries and m != name[:-3]]
    code = (f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); import runpy; "
            f"runpy.run_path({name!r}, run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{name}: self-check passed" in out.stdout


# -----------------------------------------------------------------------------
# rewards.py

@quick
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


@quick
def test_gsm8k_reward():
    answer = "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18"
    assert gsm8k_reward("... 9 * 2 = 18 dollars\n#### 18", answer) == 1.0
    assert gsm8k_reward("#### 18.00", answer) == 1.0
    assert gsm8k_reward("#### 17", answer) == 0.0
    assert gsm8k_reward("I don't know", answer) == 0.0
    assert gsm8k_reward("#### -10", "#### -10") == 1.0
    assert gold_answer("x\n#### 2,125") == 2125.0


@quick
@pytest.mark.skipif(not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")),
                    reason="real GSM8K not found at ../shared/data/gsm8k (it is never shipped with the project)")
def test_grader_on_all_gsm8k_test_gold_solutions():
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))
    assert len(rows) == 1319
    wrong = [r["answer"][-60:] for r in rows if gsm8k_reward(r["answer"], r["answer"]) != 1.0]
    assert not wrong, f"gold solutions graded wrong: {wrong[:5]}"


# -----------------------------------------------------------------------------
# tba.py, searcher.py, run_gsm8k.py: real processes with the tiny preset

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
    keys |= {"offpolicy/drift", "offpolicy/drift_p90", "offpolicy/ratio_out", "offpolicy/clip_frac", "grad/norm"}
    assert keys <= set(rows[0]), f"missing metrics: {keys - set(rows[0])}"
    assert rows[0]["offpolicy/drift"] < 1e-4, "step 0 trains on data of its own weights: pi = mu"
    assert max(r["offpolicy/drift"] for r in rows) > 1e-3, "later steps train on data of older weights"
    assert all(np.isfinite(r["loss/train"]) for r in rows)
    assert re.fullmatch(r"accuracy: before [\d.]+% -> after [\d.]+%", out.stdout.splitlines()[-1])
    assert "\r" not in out.stdout + out.stderr, "a redirected log has no progress-bar carriage returns"
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    result = json.load(open(tmp_path / "run" / "result.json"))
    assert result["headline"] == "accuracy" and result["after"]["eval/accuracy"] == final["eval/accuracy"]
    assert result["before"]["eval/accuracy"] == rows[0]["eval/accuracy"]
    assert os.path.isfile(tmp_path / "run" / "final" / "model.safetensors")
    assert json.load(open(tmp_path / "run" / "config.json"))["steps"] == 12


@pytest.mark.parametrize("fresh_rounds", [True, False])
def test_most_on_policy_staleness_bound_and_weights_reach_searchers(tmp_path, cache_dir, fresh_rounds):
    k = 2
    flags = ["--steps", "24", "--sync-every", str(k), "--m", "1.0"] + ([] if fresh_rounds else ["--no-fresh-rounds"])
    out = subprocess.run(tiny_args(tmp_path, cache_dir, *flags), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    # the latest round was formed round_age steps ago from items at most k steps older than that sync:
    # k - 1 + k = 2k - 1 when every sync brings data, k more for each sync in a row that brought none
    for r in rows:
        assert r["staleness/latest_max"] <= r["buffer/round_age"] + k, r
    assert all(r["staleness/latest_max"] <= 2 * k - 1 for r in rows if r["buffer/round_age"] < k)
    assert max(r["searcher/version"] for r in rows) > 0, "searchers never generated with published weights"
    if fresh_rounds:  # every sync formed a new round (the trainer waited for it where need be): the barrier's bound
        assert [r["buffer/round_age"] for r in rows] == [r["step"] % k for r in rows]
        assert max(r["staleness/latest_max"] for r in rows) <= 2 * k - 1
        assert "no new trajectories" not in out.stdout


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_weights_reach_a_spawned_process_in_the_searchers_dtype(dtype):
    """A searcher spawned after the copies were allocated (as a restarted one is) receives SharedWeights without
    them (its own device's copy comes with its job) and pulls the published weights in its dtype."""
    import torch.multiprocessing as mp
    from ops.weights import SharedWeights
    ctx = mp.get_context("spawn")
    model = torch.nn.Linear(3, 2)
    shared = SharedWeights(ctx)
    shared.allocate(model, version=0, devices=["cpu"], dtype=dtype)
    with torch.no_grad():
        model.weight.fill_(7.0)
    shared.publish(model, version=5)
    results = ctx.Queue()
    child = ctx.Process(target=_pull_in_child, args=(shared, shared.tensors["cpu"], dtype, results))
    child.start()
    version, total, dtypes, copies = results.get(timeout=60)
    child.join(timeout=30)
    assert version == 5 and total == pytest.approx(7.0 * 6 + model.bias.sum().item(), abs=1e-2)
    assert dtypes == {dtype} and shared.tensors["cpu"]["weight"].is_shared()
    assert copies == 0, "a searcher spawned after allocation maps no device's copy through SharedWeights"


def _pull_in_child(shared, tensors, dtype, results):
    model = torch.nn.Linear(3, 2).to(dtype)  # (a searcher's model, in the searchers' dtype)
    version = shared.pull(model, tensors, have_version=-1)
    results.put((version, sum(p.float().sum().item() for p in model.parameters()), {p.dtype for p in model.parameters()},
                 len(shared.tensors)))


# -----------------------------------------------------------------------------
# The evaluation routine


class _GoldPolicy:
    """A stand-in policy that 'generates' the gold solution of each prompt, through a real tokenizer."""

    def __init__(self, tokenizer, solutions):
        self.tokenizer, self.solutions, self.step = tokenizer, solutions, 0

    def generate(self, prompts, n=1, temperature=1.0, greedy=False):
        from ops.models import completions
        ids = [self.tokenizer(s, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
               for s in self.solutions[:len(prompts)]]
        return completions(self.tokenizer, ids)


@quick
@pytest.mark.skipif(not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")), reason="real GSM8K not found at ../shared/data/gsm8k")
def test_eval_routine_scores_gold_solutions_100_percent():
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))
    task = GSM8KTask.from_rows(rows[:1], rows)
    tokenizer = _bpe_tokenizer("gpt_neox", [r["answer"] for r in rows[:500]])
    metrics = task.evaluate(_GoldPolicy(tokenizer, [m["answer"] for m in task.eval_metas]), len(rows))
    assert metrics["accuracy"] == 1.0 and len(task.eval_prompts) == 1319
