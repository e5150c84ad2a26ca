"""
The comparison objectives of baselines.py against hand-computed cases, as TRL defines them. (The TB/RLOO
identity is one of the algorithm's tests, in test_tba.py.)

The off-policy diagnostics (drift, ratios out of the band, clip fraction) in the metrics and step line of TB,
RLOO and GRPO runs of the tiny preset.

Run: python -m pytest -q tests/test_baselines.py
"""

import math
import re
import subprocess

import numpy as np
import pytest
import torch

from baselines import baseline_loss, clipped_fraction, dr_grpo_loss, grpo_loss, online_dpo_loss, rloo_loss

from tests.helpers import read_metrics, tiny_args

quick = pytest.mark.quick  # (the hand-computed cases; the runs at the end take seconds each)


@quick
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


@quick
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


@quick
def test_clip_fraction_and_no_ratio_clip():
    rho, A = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0]]), torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    assert clipped_fraction(rho, A, 0.2) == pytest.approx(2 / 5), "above with A > 0, below with A < 0: no gradient"
    assert clipped_fraction(rho, A, 0.2, mask=torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]])) == 0.5, "padding left out"
    assert clipped_fraction(rho, A, math.inf) == 0.0
    # baseline_loss reads --clip-eps and --no-ratio-clip: without the clip, RLOO is plain importance weighting
    from buffer import Trajectory
    from config import Config
    group = [Trajectory(prompt_id=0, response_ids=(5,), reward=r, policy_version=0, behavior_logp=-1.0, ref_logp=-1.0,
                        behavior_token_logp=(-1.0,)) for r in (1.0, 0.0)]
    token_logp = torch.tensor([[-0.5], [-1.0]], requires_grad=True)  # response 0: ratio e^0.5, advantage +1
    for ratio_clip, want_grad, want_clip in ((True, 0.0, 0.5), (False, -math.exp(0.5) / 2, 0.0)):
        token_logp.grad = None
        loss, clip = baseline_loss(Config(objective="rloo", ratio_clip=ratio_clip), [group], token_logp, beta=0.1)
        loss.backward()
        assert token_logp.grad[0, 0].item() == pytest.approx(want_grad, abs=1e-6) and clip == want_clip
    loss, clip = baseline_loss(Config(objective="grpo", clip_eps=0.7), [group], token_logp, beta=0.1)
    assert clip == 0.0, "e^0.5 = 1.65 is inside [0.3, 1.7]"


@quick
def test_online_dpo_best_vs_worst_and_ties():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [0.0, 0.0, 0.0]])
    reward = torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]])  # prompt 1 is a tie: no pair
    beta = 0.5
    # prompt 0: winner is response 1 (margin 0), loser response 0 (margin 0.5): h = 0.5 * (0 - 0.5)
    want = -math.log(1 / (1 + math.exp(0.25))) / 2
    loss = online_dpo_loss(logp, ref, reward, beta)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    assert logp.grad[1].abs().sum().item() == 0.0 and logp.grad[0, 2].item() == 0.0


@pytest.mark.parametrize("objective", ["tb", "tb none", "rloo", "grpo"])  # (tb: the preset's, with its trust region)
def test_offpolicy_diagnostics_in_every_objectives_metrics_and_step_line(tmp_path, cache_dir, objective):
    objective, _, correction = objective.partition(" ")
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "8", "--sync-every", "4", "--objective", objective,
                                   *(["--tb-correction", correction] if correction else []), "--eval-every", "0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["offpolicy/drift"] < 1e-4 and rows[0]["offpolicy/ratio_out"] == 0, "step 0: pi = mu"
    assert all(r["offpolicy/drift"] >= 0 and r["offpolicy/drift_p90"] >= 0 for r in rows)
    assert max(r["offpolicy/drift"] for r in rows[1:4]) > 0, "steps 1-3 train on data of step 0's weights"
    clip = [r["offpolicy/clip_frac"] for r in rows]
    assert all(c is None for c in clip) if correction == "none" else all(0 <= c <= 1 for c in clip), clip
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 8 and all(re.search(r"\| drift [\d.]+ out [\d.]+ clip (nan|[\d.]+) \| grad [\d.e+-]+ \|", line)
                                   for line in lines), lines[:2]
