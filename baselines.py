"""
The BASELINES TBA is compared against, run in the same system so that a comparison isolates one thing:

    objectives   RLOO, GRPO, Dr. GRPO (as Hugging Face TRL defines them, read from TRL 1.10.0.dev0, July
                 2026) and Online DPO (the paper's strongest asynchronous baseline), trained on the same
                 searchers' data; the behaviour policy of a ratio objective is the searcher's stale copy
                 that sampled y. `--objective rloo|grpo|dr_grpo|online_dpo`; `--clip-eps` sets the ratio
                 clip (TRL's 0.2), `--no-ratio-clip` removes it (an ablation); each step logs the fraction
                 of ratios clipped (`clipped_fraction`).
    identity     on-policy, TB's gradient is exactly 2 (K - 1) / (beta K) times RLOO's with the KL term in
                 the reward (`tb_rloo_gradient_ratio`): under Adam, "TB vs RLOO" compares how each handles
                 the KL term, clipping and stale data, not two different learning signals.
    --sync       the synchronous on-policy system: no searcher processes; every step the trainer generates a
                 fresh batch with its own weights, then trains on exactly that batch (searcher.SyncSearch). Same
                 loss, batch and model as the asynchronous run, so it measures what asynchrony buys.

The trainer (tba.train_step) calls the TB loss itself (with --tb-correction's weight, loss.py) and hands over to
`baseline_loss` in one line.

Run: python run_gsm8k.py --objective rloo     (or --sync; python -m bench compares them)
"""

import math

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# The objectives, as pure functions of (Q, K) or (Q, K, T) tensors

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
    A = rloo_advantage(behavior_logp, ref_logp, reward, beta)  # (Q, K)
    rho = torch.exp(logp - behavior_logp)  # (Q, K)
    return -torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A).mean()


def rloo_advantage(behavior_logp, ref_logp, reward, beta):
    """RLOO's A_k = R_k - mean_{j != k} R_j with the KL-shaped reward R = r - beta (behavior_logp - ref_logp)."""
    K = reward.shape[1]
    assert K > 1, "RLOO needs K >= 2 responses per prompt"
    R = reward - beta * (behavior_logp - ref_logp)  # (Q, K)
    return R - (R.sum(dim=1, keepdim=True) - R) / (K - 1)


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


def clipped_fraction(rho, A, eps, mask=None):
    """The fraction of ratios (sequences for RLOO, tokens for GRPO) whose clipped term is the active one in
    min(rho A, clip(rho) A), i.e. that get no gradient: rho > 1 + eps with A > 0, or rho < 1 - eps with A < 0."""
    clipped = (((rho > 1 + eps) & (A > 0)) | ((rho < 1 - eps) & (A < 0))).float()
    if mask is None:
        return clipped.mean().item()
    return ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()


def online_dpo_loss(logp, ref_logp, reward, beta):
    """
    Online DPO (Guo et al. 2024; TRL's OnlineDPOTrainer, sigmoid loss) on the best and the worst of each
    prompt's K responses, the paper's strongest asynchronous baseline:
        h = beta * [(logp_w - ref_logp_w) - (logp_l - ref_logp_l)],   L = -mean_x log sigmoid(h)
    A prompt whose K responses all have the same reward has no preference and adds nothing. (Q, K) inputs.
    """
    w, l = reward.argmax(dim=1, keepdim=True), reward.argmin(dim=1, keepdim=True)  # (Q, 1)
    margin = (logp - ref_logp).gather(1, w) - (logp - ref_logp).gather(1, l)  # (Q, 1)
    has_pair = (reward.gather(1, w) > reward.gather(1, l)).float()  # (Q, 1)
    return -(F.logsigmoid(beta * margin) * has_pair).sum() / logp.shape[0]


# -----------------------------------------------------------------------------
# The hand-over from the trainer

def baseline_loss(cfg, groups, token_logp, beta):
    """The loss of comparison objective cfg.objective on n groups of K
    trajectories (a micro-batch of n prompts), token_logp being the policy's log-probs of their response tokens
    (n K, R) with grad, and the fraction of its ratios clipped (NaN for an objective without ratios). Behaviour
    log-probs come from the searchers (on-policy under --sync: the ratios are 1). --clip-eps sets eps;
    --no-ratio-clip makes it infinite (no clip)."""
    n, K, R = len(groups), len(groups[0]), token_logp.shape[1]
    flat, device = [t for g in groups for t in g], token_logp.device
    grid = lambda values: torch.tensor(values, dtype=torch.float32, device=device).view(n, K)  # (n, K)
    padded = lambda rows: torch.tensor([list(r) + [0.0] * (R - len(r)) for r in rows], dtype=torch.float32,
                                       device=device).view(n, K, R)  # (n, K, R)
    token_logp = token_logp.view(n, K, R)
    logp, mask = token_logp.sum(dim=2), padded([[1.0] * len(t.response_ids) for t in flat])  # (n, K), (n, K, R)
    ref_logp, reward = grid([t.ref_logp for t in flat]), grid([t.reward for t in flat])
    if cfg.objective == "online_dpo":
        return online_dpo_loss(logp, ref_logp, reward, beta), math.nan
    if cfg.sync:  # the policy that sampled the batch is the current one
        behavior_logp, behavior_token_logp = logp.detach(), token_logp.detach()
    else:
        behavior_logp, behavior_token_logp = grid([t.behavior_logp for t in flat]), padded([t.behavior_token_logp for t in flat])
    eps = cfg.clip_eps if cfg.ratio_clip else math.inf
    if cfg.objective == "rloo":
        A = rloo_advantage(behavior_logp, ref_logp, reward, beta)
        return (rloo_loss(logp, behavior_logp, ref_logp, reward, beta, eps),
                clipped_fraction(torch.exp(logp.detach() - behavior_logp), A, eps))
    A = reward - reward.mean(dim=1, keepdim=True)  # (the sign of GRPO's advantage: all the clip fraction needs)
    rho = torch.exp(token_logp.detach() - behavior_token_logp)
    clipped = clipped_fraction(rho, A.unsqueeze(-1), eps, mask)
    if cfg.objective == "grpo":
        return grpo_loss(token_logp, behavior_token_logp, mask, reward, eps), clipped
    if cfg.objective == "dr_grpo":
        return dr_grpo_loss(token_logp, behavior_token_logp, mask, reward, cfg.max_new_tokens, eps), clipped
    raise ValueError(f"unknown baseline objective {cfg.objective!r}")
