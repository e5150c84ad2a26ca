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


def response_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0):
    """
    log pi(token) of every response token: (N, R), R the longest response, 0 at padding.

    input_ids, attention_mask, response_mask: (N, T), rows as `make_batch` builds them:
    [left pad][prompt][response][right pad], so the responses fill the last R columns. attention_mask is
    1 on prompt and response, response_mask on response tokens only. Position ids are counted from the
    first real token so left padding does not shift them. Padded positions are masked out with
    torch.where, so they contribute exactly 0 (and cannot leak NaN into a sum).
    """
    R = int(response_mask.sum(dim=1).max())
    if R == 0:
        return torch.zeros(input_ids.shape[0], 0)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -R - 1:-1]  # (N, R, V): the positions that predict the response tokens
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # at least float32
    targets = input_ids[:, -R:]  # (N, R)
    token_logp = torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)  # (N, R)
    return torch.where(response_mask[:, -R:].bool(), token_logp, torch.zeros_like(token_logp))


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
    if stop_step is not None and step >= stop_step:
        return beta_end
    if decay_steps <= 0 or step >= decay_steps:
        return beta_end
    return beta_start + (beta_end - beta_start) * step / decay_steps


def wsd_schedule(optimizer, warmup, stable, decay, floor=0.0, decay_type="cosine"):
    """
    Warmup-stable-decay learning-rate multiplier as a function of the trainer step, from transformers'
    `get_wsd_schedule` (the official code's scheduler): linear warmup to 1 over `warmup` steps, 1 for
    `stable` steps, then a cosine (official) or linear decay to `floor` over `decay` steps, `floor` after.
    The official trainer steps the scheduler before each update, so step s (0-based) gets the multiplier
    of s + 1: the first update uses 1/warmup of the peak. Official GSM8K: warmup 50, stable 350, decay 600,
    cosine, with the run stopped at step 700 (multiplier 0.5 there).
    """
    from transformers import get_wsd_schedule
    scheduler = get_wsd_schedule(optimizer, warmup, decay, num_stable_steps=stable, decay_type=decay_type,
                                 min_lr_ratio=floor)
    return lambda step: scheduler.lr_lambdas[0](step + 1)


# -----------------------------------------------------------------------------
# Comparison objectives, as Hugging Face TRL defines them (read from TRL 1.10.0.dev0, July 2026), run in the
# same asynchronous system: the behaviour policy is the searcher's stale copy that sampled y.

def rloo_loss(logp, behavior_logp, ref_logp, reward, beta, eps=0.2):
    """
    RLOO as TRL's RLOOTrainer (trl/trainer/rloo_trainer.py): the KL penalty folded into the reward, a
    leave-one-out baseline, a sequence-level importance ratio clipped PPO-style:
        R_k   = r_k - beta * (behavior_logp_k - ref_logp_k)
        A_k   = R_k - mean_{j != k} R_j
        rho_k = exp(logp_k - behavior_logp_k)
        L     = -mean_{x,k} min(rho_k A_k, clip(rho_k, 1 - eps, 1 + eps) A_k)
    On-policy (rho = 1) its gradient is exactly beta K / (2 (K - 1)) times TB's: see `tb_rloo_gradient_ratio`.
    All arguments (Q, K); TRL's defaults: beta 0.05, eps 0.2, no advantage normalisation.
    """
    K = logp.shape[1]
    assert K > 1, "RLOO needs K >= 2 responses per query"
    R = reward - beta * (behavior_logp - ref_logp)  # (Q, K)
    A = R - (R.sum(dim=1, keepdim=True) - R) / (K - 1)  # (Q, K)
    rho = torch.exp(logp - behavior_logp)  # (Q, K)
    return -torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A).mean()


def tb_rloo_gradient_ratio(K, beta):
    """
    With log Z detached, d(TB)/d logp_k = -(2 / beta) (R_k - mean R) / (Q K) with R = r - beta (logp - ref_logp)
    (Appendix A), and d(RLOO)/d logp_k = -(K / (K - 1)) (R_k - mean R) / (Q K) on-policy. So the TB gradient
    is exactly 2 (K - 1) / (beta K) times RLOO's whose reward includes the KL term. Under Adam, which is
    nearly invariant to the gradient's scale, "TB vs RLOO" therefore compares how each handles the KL
    term, clipping and stale data, not two different learning signals.
    """
    return 2 * (K - 1) / (beta * K)


def grpo_loss(token_logp, behavior_token_logp, mask, reward, eps=0.2, scale_rewards=True, loss_type="dapo",
              max_tokens=None):
    """
    GRPO as TRL's GRPOTrainer (trl/trainer/grpo_trainer.py, defaults beta 0 (no KL), eps 0.2,
    scale_rewards "group", loss_type "dapo"): a group-normalised advantage and a per-token clipped ratio:
        A_k      = (r_k - mean_k r) / (std_k r + 1e-4)          (std only with scale_rewards)
        rho_k,t  = exp(token_logp_k,t - behavior_token_logp_k,t)
        l_k,t    = -min(rho_k,t A_k, clip(rho_k,t, 1 - eps, 1 + eps) A_k)
        L        = sum_{k,t} l_k,t / N, where N is
                   "dapo":    the number of response tokens in the batch
                   "grpo":    per sequence, its length (then the mean over sequences)
                   "dr_grpo": number of sequences x max_tokens (Dr. GRPO: no length bias)
    token_logp, behavior_token_logp, mask: (Q, K, T) with mask 1 on response tokens; reward: (Q, K).
    """
    A = reward - reward.mean(dim=1, keepdim=True)  # (Q, K)
    if scale_rewards:
        A = A / (reward.std(dim=1, keepdim=True) + 1e-4)
    rho = torch.exp(token_logp - behavior_token_logp)  # (Q, K, T)
    A = A.unsqueeze(-1)  # (Q, K, 1)
    per_token = -torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A) * mask  # (Q, K, T)
    if loss_type == "dapo":
        return per_token.sum() / mask.sum().clamp(min=1)
    if loss_type == "grpo":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "dr_grpo":
        return per_token.sum() / (mask.shape[0] * mask.shape[1] * max_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def dr_grpo_loss(token_logp, behavior_token_logp, mask, reward, max_tokens, eps=0.2):
    """Dr. GRPO (Liu et al. 2025) as TRL runs it: loss_type "dr_grpo", scale_rewards "none"."""
    return grpo_loss(token_logp, behavior_token_logp, mask, reward, eps, scale_rewards=False, loss_type="dr_grpo",
                     max_tokens=max_tokens)


def online_dpo_loss(logp, ref_logp, reward, beta):
    """
    Online DPO (Guo et al. 2024; TRL's OnlineDPOTrainer, sigmoid loss) on the best and the worst of each
    query's K responses, the paper's strongest asynchronous baseline:
        h = beta * [(logp_w - ref_logp_w) - (logp_l - ref_logp_l)],   L = -mean_x log sigmoid(h)
    A query whose K responses all have the same reward has no preference and adds nothing. (Q, K) inputs.
    """
    w, l = reward.argmax(dim=1, keepdim=True), reward.argmin(dim=1, keepdim=True)  # (Q, 1)
    margin = (logp - ref_logp).gather(1, w) - (logp - ref_logp).gather(1, l)  # (Q, 1)
    has_pair = (reward.gather(1, w) > reward.gather(1, l)).float()  # (Q, 1)
    return -(F.logsigmoid(beta * margin) * has_pair).sum() / logp.shape[0]


# What each objective reads besides logp and reward; searchers compute only these (searcher.py).
OBJECTIVE_INPUTS = {"tb": ("ref_logp",), "rloo": ("ref_logp", "behavior_logp"), "grpo": ("behavior_logp",),
                    "dr_grpo": ("behavior_logp",), "online_dpo": ("ref_logp",)}
assert tuple(OBJECTIVE_INPUTS) == OBJECTIVES, "config.OBJECTIVES lists the objectives implemented here"


def objective_loss(name, x, beta, max_tokens):
    """The loss of objective `name` on a batch `x`: (Q, K) tensors logp, ref_logp, behavior_logp, reward, and
    (Q, K, T) token_logp, behavior_token_logp, mask for the per-token objectives."""
    if name == "tb":
        return vargrad_tb_loss(x["logp"], x["ref_logp"], x["reward"], beta)
    if name == "rloo":
        return rloo_loss(x["logp"], x["behavior_logp"], x["ref_logp"], x["reward"], beta)
    if name == "grpo":
        return grpo_loss(x["token_logp"], x["behavior_token_logp"], x["mask"], x["reward"])
    if name == "dr_grpo":
        return dr_grpo_loss(x["token_logp"], x["behavior_token_logp"], x["mask"], x["reward"], max_tokens)
    if name == "online_dpo":
        return online_dpo_loss(x["logp"], x["ref_logp"], x["reward"], beta)
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
    lr_at = wsd_schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 50, 350, 600)
    print("lr multiplier at steps 0, 49, 200, 699, 1000:", [round(lr_at(s), 3) for s in (0, 49, 200, 699, 1000)])
    assert math.isclose(beta_schedule(0, 0.014, 0.004, 500), 0.014)
