"""
The objectives of TBA, as pure functions of tensors, plus the schedules that feed them.

Everything here works on a (Q, K) grid: Q queries (prompts) x K responses to each. Nothing here knows
about models, processes or buffers except `sequence_logprobs`, which turns a batch of token ids into the
per-response log-probabilities the objectives consume.

VarGrad trajectory balance (paper Eq. 4-5). For a query x with K responses y_k, reward r_k, policy
log-prob logp_k = log pi(y_k|x) and reference log-prob ref_logp_k = log pi_ref(y_k|x):

    log_Z(x) = mean_k [ r_k / beta - (logp_k - ref_logp_k) ]               (detached, Eq. 5)
    L        = mean_{x,k} [ (log_Z(x) + logp_k - ref_logp_k - r_k / beta)^2 ]  (Eq. 4)

The loss is zero exactly when logp - ref_logp = r/beta - c(x) for every response, i.e. when
pi(y|x) ∝ pi_ref(y|x) exp(r(x, y)/beta): the KL-regularised optimum. Because log_Z is detached, the
gradient w.r.t. logp_k is (Appendix A)

    dL/dlogp_k = -(2 / beta) * A_k / (Q K),   A_k = (r_k - r_bar) - beta * (kl_k - kl_bar)

with kl = logp - ref_logp and bars the per-query means: a leave-mean-out, KL-shaped advantage, which is
why TB behaves like a well-baselined policy gradient on-policy and stays valid off-policy.

Departures from the paper / official code:
  1. Padding contributes exactly 0 to sequence log-probs via a mask; the official code fills padded
     positions with INVALID_LOGPROB=1.0 and relies on later masking. Same numbers, less to get wrong.
  2. As in the official code, logits are divided by the sampling temperature before the log-softmax for
     both the policy and the reference (`temperature` argument, default = the sampling temperature
     chosen by the caller). Set it to 1.0 to score under the raw model instead.

The comparison objectives (RLOO, GRPO, Dr. GRPO) share the (Q, K) interface so the benchmarks can swap
them in; see each docstring for its formula.

Run `python loss.py` to check the loss at its optimum and the Appendix A gradient on random numbers.
"""

import math

import torch
import torch.nn.functional as F

from config import OBJECTIVES


# -----------------------------------------------------------------------------
# Trajectory balance

def vargrad_tb_loss(logp, ref_logp, reward, beta):
    """VarGrad TB loss (Eq. 4-5). logp, ref_logp, reward: (Q, K); logp carries grad. Returns a scalar."""
    assert logp.dim() == 2 and logp.shape == ref_logp.shape == reward.shape, "expected (Q, K) tensors"
    kl = logp - ref_logp  # (Q, K) log pi - log pi_ref per response
    log_Z = (reward / beta - kl).mean(dim=1, keepdim=True).detach()  # (Q, 1) Eq. 5
    return (log_Z + kl - reward / beta).pow(2).mean()


def tb_log_Z(logp, ref_logp, reward, beta):
    """The per-query VarGrad log Z estimate (Q,), for logging."""
    return (reward / beta - (logp - ref_logp)).mean(dim=1).detach()


# -----------------------------------------------------------------------------
# Sequence log-probs

def make_batch(prompts, responses, pad_id):
    """
    Token-id lists -> (input_ids, attention_mask, response_mask), each (N, T) long tensors.
    Prompts are left-padded and responses right-padded, so every prompt ends at the same column:
        [pad pad p1 p2 p3 | r1 r2 pad]     attention 0 0 1 1 1 1 1 0, response 0 0 0 0 0 1 1 0
    """
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    rows, attn, resp = [], [], []
    for p, r in zip(prompts, responses):
        rows.append([pad_id] * (P - len(p)) + list(p) + list(r) + [pad_id] * (R - len(r)))
        attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)))
        resp.append([0] * P + [1] * len(r) + [0] * (R - len(r)))
    return torch.tensor(rows), torch.tensor(attn), torch.tensor(resp)


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0):
    """
    Sum of log pi(token) over the response tokens of each row. Returns (N,).

    input_ids, attention_mask, response_mask: (N, T). A row is [left pad][prompt][response][right pad];
    attention_mask is 1 on prompt and response, response_mask is 1 on response tokens only. Position ids
    are counted from the first real token so left padding does not shift them. Padded positions are
    masked out with torch.where, so they contribute exactly 0 (and cannot leak NaN into the sum).
    """
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature  # (N, T-1, V) predicts tokens 1..T-1
    targets = input_ids[:, 1:]  # (N, T-1)
    token_logp = torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)  # (N, T-1)
    mask = response_mask[:, 1:].bool()  # (N, T-1) the first token can never be a response token
    return torch.where(mask, token_logp, torch.zeros_like(token_logp)).sum(dim=1)


# -----------------------------------------------------------------------------
# Schedules

def beta_schedule(step, beta_start, beta_end, decay_steps, stop_step=None):
    """
    KL coefficient at `step`: linear from beta_start (step 0) to beta_end (step decay_steps), then flat.
    With stop_step set, beta jumps to beta_end at stop_step even if the line has not reached it (the
    paper's TL;DR schedule). Constant when beta_start == beta_end.
    Paper GSM8K: 0.014 -> 0.004 by step 500 (Table 2).
    """
    if stop_step is not None and step >= stop_step:
        return beta_end
    if decay_steps <= 0 or step >= decay_steps:
        return beta_end
    return beta_start + (beta_end - beta_start) * step / decay_steps


def wsd_lr_multiplier(step, warmup, stable, decay, floor=0.0):
    """
    Warmup-stable-decay multiplier on the base learning rate:
      step <  warmup                 : (step + 1) / warmup            (linear warmup)
      step <  warmup + stable        : 1                              (stable)
      step <  warmup + stable + decay: linear from 1 down to `floor`  (decay)
      afterwards                     : floor
    Official GSM8K launch script: warmup 50, stable 350, decay 600, base lr 1e-5.
    """
    if step < warmup:
        return (step + 1) / warmup
    step -= warmup
    if step < stable:
        return 1.0
    step -= stable
    if step < decay:
        return 1.0 - (1.0 - floor) * step / decay
    return floor


# -----------------------------------------------------------------------------
# Comparison objectives (for the benchmarks)

def rloo_loss(logp, ref_logp, reward, beta):
    """
    RLOO (REINFORCE leave-one-out) with a KL-regularised reward, the official code's base trainer:
        R_k = r_k - beta * (logp_k - ref_logp_k)        (KL penalty folded into the reward, no grad)
        A_k = R_k - mean_{j != k} R_j                    (leave-one-out baseline)
        L   = -mean(A_k * logp_k)
    """
    K = logp.shape[1]
    assert K > 1, "RLOO needs K >= 2 responses per query"
    R = (reward - beta * (logp - ref_logp)).detach()  # (Q, K)
    A = R - (R.sum(dim=1, keepdim=True) - R) / (K - 1)  # (Q, K)
    return -(A * logp).mean()


def grpo_loss(logp, behavior_logp, reward, clip_eps=0.2, num_tokens=None, std_normalise=True):
    """
    GRPO with sequence-level ratios, clipped against the behaviour policy that sampled y:
        A_k   = (r_k - mean_k r) / (std_k r + 1e-4)     (group-normalised advantage)
        rho_k = exp(logp_k - behavior_logp_k)
        L     = -mean( min(rho_k A_k, clip(rho_k, 1-eps, 1+eps) A_k) / |y_k| )
    `num_tokens` (Q, K) gives |y_k| for GRPO's length normalisation; None means no length normalisation.
    No KL term (as in DAPO and most recent GRPO practice).
    """
    A = reward - reward.mean(dim=1, keepdim=True)  # (Q, K)
    if std_normalise:
        A = A / (reward.std(dim=1, keepdim=True) + 1e-4)
    rho = torch.exp(logp - behavior_logp)  # (Q, K)
    surrogate = torch.minimum(rho * A, rho.clamp(1 - clip_eps, 1 + clip_eps) * A)  # (Q, K)
    if num_tokens is not None:
        surrogate = surrogate / num_tokens.clamp(min=1)
    return -surrogate.mean()


def dr_grpo_loss(logp, behavior_logp, reward, clip_eps=0.2):
    """Dr. GRPO (Liu et al. 2025): GRPO without the std normalisation and without the 1/|y| factor."""
    return grpo_loss(logp, behavior_logp, reward, clip_eps=clip_eps, num_tokens=None, std_normalise=False)


# what each objective reads besides logp and reward: searchers compute only these (searcher.py)
OBJECTIVE_INPUTS = {"tb": ("ref_logp",), "rloo": ("ref_logp",), "grpo": ("behavior_logp",), "dr_grpo": ("behavior_logp",)}
assert tuple(OBJECTIVE_INPUTS) == OBJECTIVES, "config.OBJECTIVES lists the objectives implemented here"


def objective_loss(name, logp, ref_logp, behavior_logp, reward, beta, num_tokens):
    """Dispatch on the objective name; every argument is (Q, K) except the scalar beta."""
    if name == "tb":
        return vargrad_tb_loss(logp, ref_logp, reward, beta)
    if name == "rloo":
        return rloo_loss(logp, ref_logp, reward, beta)
    if name == "grpo":
        return grpo_loss(logp, behavior_logp, reward, num_tokens=num_tokens)
    if name == "dr_grpo":
        return dr_grpo_loss(logp, behavior_logp, reward)
    raise ValueError(f"unknown objective {name!r}; choose one of {OBJECTIVES}")


if __name__ == "__main__":
    torch.manual_seed(0)
    Q, K, beta = 4, 5, 0.05
    ref_logp = -10 * torch.rand(Q, K)
    reward = torch.randint(0, 2, (Q, K)).float()
    c = torch.randn(Q, 1)  # any per-query constant
    logp_opt = (ref_logp + reward / beta - c).requires_grad_()
    loss = vargrad_tb_loss(logp_opt, ref_logp, reward, beta)
    loss.backward()
    print(f"loss at the optimum: {loss.item():.2e}, max |grad|: {logp_opt.grad.abs().max().item():.2e}")
    logp = (-10 * torch.rand(Q, K)).requires_grad_()
    vargrad_tb_loss(logp, ref_logp, reward, beta).backward()
    kl = (logp - ref_logp).detach()
    A = (reward - reward.mean(1, keepdim=True)) - beta * (kl - kl.mean(1, keepdim=True))
    print(f"Appendix A gradient, max abs error: {(logp.grad + 2 / beta * A / (Q * K)).abs().max().item():.2e}")
    print("beta at steps 0, 250, 500, 700:", [round(beta_schedule(s, 0.014, 0.004, 500), 4) for s in (0, 250, 500, 700)])
    print("lr multiplier at 0, 49, 200, 700, 1000:", [round(wsd_lr_multiplier(s, 50, 350, 600), 3) for s in (0, 49, 200, 700, 1000)])
    assert math.isclose(beta_schedule(0, 0.014, 0.004, 500), 0.014)
