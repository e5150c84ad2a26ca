"""
The comparison objectives of baselines.py against hand-computed cases, as TRL defines them. (The TB/RLOO
identity is one of the algorithm's tests, in test_tba.py.)

Run: python -m pytest -q tests/test_baselines.py
"""

import math

import numpy as np
import pytest
import torch

from baselines import dr_grpo_loss, grpo_loss, online_dpo_loss, rloo_loss

pytestmark = pytest.mark.quick


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
