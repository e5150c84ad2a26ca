"""
The objective of TBA, the VarGrad trajectory-balance loss, as a pure function of tensors; the sequence
log-probs it consumes; the beta and learning-rate schedules that feed it.

Everything here works on a (Q, K) grid: Q prompts x K responses to each. Nothing here knows
about processes or buffers; `response_logprobs` turns a batch of token ids and a model into the
per-token log-probabilities the loss sums (ops/models.py computes the same numbers faster, each prompt run once
for its K responses: --share-prompt, tested equal).

VarGrad trajectory balance (paper Eq. 4-5). For a prompt x with K responses y_k, reward r_k, policy
log-prob logp_k = log pi(y_k|x) and reference log-prob ref_logp_k = log pi_ref(y_k|x):

    log_Z(x) = mean_k [ r_k / beta - (logp_k - ref_logp_k) ]               (detached, Eq. 5)
    L        = mean_{x,k} [ (log_Z(x) + logp_k - ref_logp_k - r_k / beta)^2 ]  (Eq. 4)

The loss is zero exactly when logp - ref_logp = r/beta - c(x) for every response, i.e. when
pi(y|x) ∝ pi_ref(y|x) exp(r(x, y)/beta): the KL-regularised optimum. Because log_Z is detached, the
gradient w.r.t. logp_k is (Appendix A)

    dL/dlogp_k = -(2 / beta) * A_k / (Q K),   A_k = (r_k - r_bar) - beta * (kl_k - kl_bar)

with kl = logp - ref_logp and bars the per-prompt means: a leave-mean-out, KL-shaped advantage, which is
why TB behaves like a well-baselined policy gradient on-policy and stays valid off-policy.

Departures from the paper / official code:
  1. Padding contributes exactly 0 to sequence log-probs via a mask; the official code fills padded
     positions with INVALID_LOGPROB=1.0 and relies on later masking. Same numbers, less to get wrong.
  2. EOS counts in the sequence log-prob. The official code masks the EOS token out of log pi(y|x) (its pad
     token is EOS); here the probability of stopping is part of the trajectory, as trajectory balance
     assumes of a complete trajectory.
  3. As in the official code, logits are divided by the sampling temperature before the log-softmax for
     both the policy and the reference (`temperature` argument, default = the sampling temperature
     chosen by the caller). Set it to 1.0 to score under the raw model instead.
  4. `tb_trust_region_loss` (--tb-correction trust-region, the tiny presets' TB) is ours: TB with PPO's clip,
     plain TB on-policy; chosen over a clamped and a truncated importance ratio on the staleness grid, where plain
     TB trails the clipped baselines at large k (docs/results.md, "A recommended TB").

The comparison objectives (RLOO, GRPO, Dr. GRPO, Online DPO) live in baselines.py. This file imports nothing
from the project: copy it alone.

Run `python loss.py` to check the loss at its optimum and the Appendix A gradient on random numbers.
"""

import inspect
import math

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# Trajectory balance

def vargrad_tb_loss(logp, ref_logp, reward, beta):
    """VarGrad TB loss (Eq. 4-5). logp, ref_logp, reward: (Q, K); logp carries grad. Returns a scalar."""
    assert logp.dim() == 2 and logp.shape == ref_logp.shape == reward.shape, "expected (Q, K) tensors"
    kl = logp - ref_logp  # (Q, K) log pi - log pi_ref per response
    log_Z = (reward / beta - kl).mean(dim=1, keepdim=True).detach()  # (Q, 1) Eq. 5
    return (log_Z + kl - reward / beta).pow(2).mean()


def tb_log_Z(logp, ref_logp, reward, beta):
    """The per-prompt VarGrad log Z estimate (Q,), for logging."""
    return (reward / beta - (logp - ref_logp)).mean(dim=1).detach()


def tb_trust_region_loss(logp, ref_logp, reward, beta, behavior_logp, eps):
    """
    Departure 4 (ours): Eq. 4 with a trust region around the policy mu that sampled each response, PPO's clip for
    TB: a response's squared residual delta_k^2 is dropped once its ratio pi(y_k|x) / mu(y_k|x) has left
    [1 - eps, 1 + eps] the way descent on delta_k^2 pushes it (delta_k = log_Z + logp_k - ref_logp_k - r_k / beta).
    On-policy, Eq. 4. Returns (loss, fraction of responses dropped). (Q, K) inputs; behavior_logp = log mu(y_k|x),
    NaN where unknown (counted on-policy).
    """
    log_Z = tb_log_Z(logp, ref_logp, reward, beta).unsqueeze(1)  # (Q, 1) over all K, detached, as Eq. 5
    delta = log_Z + logp - ref_logp - reward / beta  # (Q, K)
    log_rho = (logp - behavior_logp).detach().nan_to_num(nan=0.0)  # (Q, K) log pi/mu
    dropped = ((delta > 0) & (log_rho < math.log(1 - eps))) | ((delta < 0) & (log_rho > math.log(1 + eps)))
    return (delta.pow(2) * ~dropped).mean(), dropped.float().mean().item()


# -----------------------------------------------------------------------------
# How off-policy a batch is (every objective)

def offpolicy_metrics(logp, behavior_logp, eps):
    """
    The drift between the trainer's policy pi and the behaviour policy mu that sampled each response, from
    sequence log-probs: mean and 90th percentile of |log pi(y|x) - log mu(y|x)|, and the fraction of ratios
    pi/mu outside [1 - eps, 1 + eps]. All 0 on-policy. Responses without a behaviour log-prob (NaN) are
    left out; none: NaN. logp, behavior_logp: (Q, K) or flat, detached.
    """
    known = ~torch.isnan(behavior_logp)
    if not known.any():
        return {"offpolicy/drift": math.nan, "offpolicy/drift_p90": math.nan, "offpolicy/ratio_out": math.nan}
    log_ratio = (logp - behavior_logp)[known].double()
    drift = log_ratio.abs()
    out = (log_ratio < math.log(1 - eps)) | (log_ratio > math.log(1 + eps))
    return {"offpolicy/drift": drift.mean().item(), "offpolicy/drift_p90": torch.quantile(drift, 0.9).item(),
            "offpolicy/ratio_out": out.double().mean().item()}


# -----------------------------------------------------------------------------
# Sequence log-probs

def make_batch(prompts, responses, pad_id):
    """
    Token-id lists -> (input_ids, attention_mask, response_mask), each (N, T) long tensors.
    Prompts are left-padded and responses right-padded, so every prompt ends at the same column:
        [pad pad p1 p2 p3 | r1 r2 pad]     attention 0 0 1 1 1 1 1 0, response 0 0 0 0 0 1 1 0
    """
    P, R = max(map(len, prompts)), max(map(len, responses))  # the longest prompt, the longest response
    rows, attn, resp = [], [], []
    for p, r in zip(prompts, responses):
        rows.append([pad_id] * (P - len(p)) + list(p) + list(r) + [pad_id] * (R - len(r)))
        attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)))
        resp.append([0] * P + [1] * len(r) + [0] * (R - len(r)))
    return torch.tensor(rows), torch.tensor(attn), torch.tensor(resp)


def response_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0):
    """
    log pi(token) of every response token: (N, R), R the longest response, 0 at padding.

    input_ids, attention_mask, response_mask: (N, T), rows as `make_batch` builds them:
    [left pad][prompt][response][right pad], so the responses fill the last R columns. attention_mask is
    1 on prompt and response, response_mask on response tokens only. Position ids are counted from the
    first real token so left padding does not shift them. Only the last R + 1 positions' logits are computed
    (transformers' `logits_to_keep`): for a 150k vocabulary the prompt's would dominate the memory. Padded positions are masked out with
    torch.where, so they contribute exactly 0 (and cannot leak NaN into a sum).
    """
    R = int(response_mask.sum(dim=1).max())
    if R == 0:
        return torch.zeros(input_ids.shape[0], 0)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, T)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    keep = {"logits_to_keep": R + 1} if takes_logits_to_keep(model) else {}  # (transformers' causal LMs)
    logits = model(**inputs, **keep).logits[:, -R - 1:]  # (N, R + 1, V): no logits over the prompt where kept
    token_logp = token_logprobs(logits[:, :-1], input_ids[:, -R:], temperature)  # (N, R): predict the response tokens
    return torch.where(response_mask[:, -R:].bool(), token_logp, torch.zeros_like(token_logp))


NO_GRAD_ROWS = 8  # rows whose float32 log-softmax a forward without grad holds at once


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T) at the targets, in at least float32: (N, R) from (N, R, V) logits of any dtype and (N, R)
    targets. Without grad, NO_GRAD_ROWS rows at a time, so that no float32 copy of all the logits is ever held (with
    grad, the backward keeps each row's log-softmax anyway)."""
    rows = logits.shape[0] if torch.is_grad_enabled() else NO_GRAD_ROWS
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.cat([torch.gather(F.log_softmax(logits[i:i + rows].to(dtype) / temperature, dim=-1), 2,
                                   targets[i:i + rows].unsqueeze(-1)).squeeze(-1) for i in range(0, len(logits), rows)])


def takes_logits_to_keep(model):
    """Whether the model's forward takes transformers' `logits_to_keep` (its causal LMs do; a PEFT model's base)."""
    forward = (model.get_base_model() if hasattr(model, "get_base_model") else model).forward
    return "logits_to_keep" in inspect.signature(forward).parameters


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0):
    """Sum of log pi(token) over the response tokens of each row, log pi(y|x): (N,)."""
    return response_logprobs(model, input_ids, attention_mask, response_mask, temperature).sum(dim=1)


# -----------------------------------------------------------------------------
# Schedules

def beta_schedule(step, beta_start, beta_end, decay_steps, stop_step=None):
    """
    KL coefficient at `step`: linear from beta_start (step 0) to beta_end (step decay_steps), then flat.
    With stop_step set, beta jumps to beta_end at stop_step even if the line has not reached it (the
    paper's TL;DR schedule). Constant when beta_start == beta_end.
    Paper GSM8K: 0.014 -> 0.004 by step 500 (Table 2).
    """
    if decay_steps <= 0 or step >= decay_steps or (stop_step is not None and step >= stop_step):
        return beta_end
    return beta_start + (beta_end - beta_start) * step / decay_steps


def wsd_schedule(step, warmup, stable, decay, floor=0.0, decay_type="cosine"):
    """
    Warmup-stable-decay learning-rate multiplier at the trainer step `step`: transformers'
    `get_wsd_schedule` (the official code's scheduler) written out, so that this file needs torch alone. Linear
    warmup from `floor` to 1 over `warmup` steps, 1 for `stable` steps, then a cosine (official) or linear decay
    to `floor` over `decay` steps, `floor` after. The official trainer steps the scheduler before each update,
    so step s (0-based) gets the multiplier of s + 1: the first update uses 1/warmup of the peak. Official
    GSM8K: warmup 50, stable 350, decay 600, cosine, with the run stopped at step 700 (multiplier 0.5 there).
    """
    s = step + 1
    if s < warmup:
        return floor + (1 - floor) * s / warmup
    after = s - warmup - stable  # steps into the decay (< 0: still stable)
    progress = min(max(after, 0) / decay, 1.0) if decay else float(after >= 0)  # 0 while stable, 1 after the decay
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay_type == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


class _ToyLM(torch.nn.Module):
    """A bigram language model with a transformers-style forward, for the self-check: logits from the token alone."""

    def __init__(self, vocab=7):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return type("Out", (), {"logits": self.table(input_ids)})


if __name__ == "__main__":  # the self-check: python loss.py (torch alone)
    torch.manual_seed(0)
    Q, K, beta = 4, 5, 0.05
    ref_logp = -10 * torch.rand(Q, K)
    reward = torch.randint(0, 2, (Q, K)).float()
    c = torch.randn(Q, 1)  # any per-prompt constant
    logp_opt = (ref_logp + reward / beta - c).requires_grad_()
    loss = vargrad_tb_loss(logp_opt, ref_logp, reward, beta)
    loss.backward()
    print(f"loss at the optimum: {loss.item():.2e}, max |grad|: {logp_opt.grad.abs().max().item():.2e}")
    assert loss.item() < 1e-9 and logp_opt.grad.abs().max().item() < 1e-6, "TB's optimum is pi ∝ pi_ref exp(r / beta)"
    logp = (-10 * torch.rand(Q, K)).requires_grad_()
    vargrad_tb_loss(logp, ref_logp, reward, beta).backward()
    kl = (logp - ref_logp).detach()
    A = (reward - reward.mean(1, keepdim=True)) - beta * (kl - kl.mean(1, keepdim=True))
    error = (logp.grad + 2 / beta * A / (Q * K)).abs().max().item()
    print(f"Appendix A gradient, max abs error: {error:.2e}")
    assert error < 1e-4, "the gradient is the KL-shaped advantage of Appendix A"
    model, prompts, responses = _ToyLM(), [[1, 2, 3], [4]], [[5, 6], [2]]
    padded = sequence_logprobs(model, *make_batch(prompts, responses, pad_id=0))
    alone = torch.cat([sequence_logprobs(model, *make_batch([p], [r], pad_id=0)) for p, r in zip(prompts, responses)])
    print(f"sequence log-probs with and without padding: {padded.tolist()} {alone.tolist()}")
    assert torch.allclose(padded, alone), "padding adds nothing to log pi(y|x)"
    print("beta at steps 0, 250, 500, 700:", [round(beta_schedule(s, 0.014, 0.004, 500), 4) for s in (0, 250, 500, 700)])
    multipliers = [wsd_schedule(s, 50, 350, 600) for s in (0, 49, 200, 699, 1000)]
    print("lr multiplier at steps 0, 49, 200, 699, 1000:", [round(m, 3) for m in multipliers])
    assert math.isclose(beta_schedule(0, 0.014, 0.004, 500), 0.014) and math.isclose(multipliers[3], 0.5)
    print("loss.py: self-check passed")
