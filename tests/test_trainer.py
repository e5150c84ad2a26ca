"""
The trainer's steps (tba.py) on a tiny random Llama, without processes: train_step reports loss.py's loss and
log Z, accumulation over whole prompts equals the full batch's gradient (and the shared-prompt forward the
plain one's), refresh_ref_logp after a reference reset, merge's wait for a fresh round and how it ends.

Run: python -m pytest -q tests/test_trainer.py
"""

import pytest
import torch

from buffer import ReplayBuffer, Trajectory
from loss import make_batch, sequence_logprobs, vargrad_tb_loss
from tests.helpers import traj



WORDS = "a b c d e f".split()


def _step_run(**flags):
    """A trainer Run of tba.py's steps without processes: a tiny random Llama as the policy, a copy as the reference,
    and an optimiser that records the gradient of its step instead of taking it."""
    import copy
    import types
    import tiny
    from config import Config
    from ops.models import PromptTokens
    tokenizer = tiny.word_tokenizer(WORDS)
    policy = tiny.tiny_llama(tokenizer, 32, 1, 64, seed=0).eval()
    cfg = Config(**{"batch_size": 8, "responses_per_prompt": 2, "micro_batch_prompts": 4, "device": "cpu",
                    "trainer_dtype": "float32", "beta_start": 0.5, "beta_end": 0.5, "temperature": 1.0, **flags})
    grads = []
    opt = types.SimpleNamespace(param_groups=[{}], step=lambda: grads.append([p.grad.clone() for p in policy.parameters()]),
                                zero_grad=lambda set_to_none: policy.zero_grad(set_to_none=set_to_none))
    prompts = ["a b", "b c", "c d e", "d"]
    run = types.SimpleNamespace(cfg=cfg, policy=policy, ref=copy.deepcopy(policy).requires_grad_(False), tokenizer=tokenizer,
                                opt=opt, prompt_tokens=PromptTokens(tokenizer, prompts), ref_version=0)
    ids = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) + (tokenizer.eos_token_id,)
    groups = [[Trajectory(prompt_id=x, response_ids=ids(" ".join(WORDS[(x + k) % 6:(x + k) % 6 + 1 + k])), reward=float(k == x % 2),
                          policy_version=0) for k in range(2)] for x in range(4)]  # (ref_version -1: scored by the trainer)
    return run, groups, grads


def _plain_logprobs(model, run, groups):
    """(Q, K) log pi(y|x) by loss.py alone: make_batch + sequence_logprobs."""
    flat = [t for g in groups for t in g]
    batch = make_batch([run.prompt_tokens[t.prompt_id] for t in flat], [t.response_ids for t in flat], run.tokenizer.pad_token_id)
    with torch.no_grad():
        return sequence_logprobs(model, *batch).view(len(groups), -1)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_train_step_reports_loss_py_loss_and_log_Z(share_prompt):
    """train_step's loss and log Z are loss.py's vargrad_tb_loss and tb_log_Z on the same batch (log pi by
    make_batch + sequence_logprobs, the reference's scored by refresh_ref_logp, here equal to the policy's)."""
    import tba
    from loss import tb_log_Z
    run, groups, grads = _step_run(share_prompt=share_prompt)
    logp, ref_logp = _plain_logprobs(run.policy, run, groups), _plain_logprobs(run.ref, run, groups)
    reward = tba.per_response(groups, "reward")
    metrics = tba.train_step(run, groups, step=0)
    assert metrics["loss/train"] == pytest.approx(vargrad_tb_loss(logp, ref_logp, reward, 0.5).item(), rel=1e-5)
    assert metrics["loss/log_Z"] == pytest.approx(tb_log_Z(logp, ref_logp, reward, 0.5).mean().item(), rel=1e-5, abs=1e-6)
    assert metrics["loss/kl"] == pytest.approx(0.0, abs=1e-5), "the reference is the policy before the step"
    assert len(grads) == 1 and metrics["grad/skipped"] == 0 and all(t.ref_version == 0 for g in groups for t in g)


def test_accumulation_over_whole_prompts_equals_the_full_batch_gradient():
    """Departure 3 of tba.py: micro-batches of whole prompts (log Z sees all K responses) give the full batch's
    gradient; and the shared-prompt forward (ops/models.py) gives the plain one's (1e-5)."""
    import tba
    runs = [_step_run(micro_batch_prompts=mb, share_prompt=share) for mb, share in [(4, False), (1, False), (2, True)]]
    for run, groups, grads in runs:
        tba.train_step(run, groups, step=0)
    full = runs[0][2][0]
    for _, _, grads in runs[1:]:
        assert max((a - b).abs().max().item() for a, b in zip(full, grads[0])) < 1e-5


def test_refresh_ref_logp_rescores_after_a_reference_reset():
    """After reset_reference (TBA'), trajectories scored by the old reference get log pi_ref of the new one (the
    policy at the reset) and its version; the searchers are sent it."""
    import tba
    run, groups, _ = _step_run()
    sent = []
    run.searchers = __import__("types").SimpleNamespace(publish=lambda kind, ref, version: sent.append((kind, version)))
    tba.refresh_ref_logp(run, [t for g in groups for t in g])
    old = tba.per_response(groups, "ref_logp")
    with torch.no_grad():
        for p in run.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tba.reset_reference(run, 3)
    tba.refresh_ref_logp(run, [t for g in groups for t in g])
    new = tba.per_response(groups, "ref_logp")
    assert sent == [("ref", 3)] and all(t.ref_version == 3 for g in groups for t in g)
    assert torch.allclose(new, _plain_logprobs(run.policy, run, groups), atol=1e-5) and not torch.allclose(new, old, atol=1e-3)


def test_merge_waits_while_a_poll_brings_only_stale_trajectories(tmp_path):
    """With fresh rounds, a merge at step 8 (k = 4) that polls only trajectories older than the previous sync (step 4)
    waits for the searchers; what then arrives forms the round, the stale ones stay in the buffer, and the
    wait is logged (time/wait)."""
    import types
    import tba
    from config import Config
    from ops.bookkeeping import Bookkeeping
    stale = [traj(0, (1,), version=2), traj(1, (2,), version=3)]
    polls = [(stale, []), ([], []), ([traj(2, (3,), version=4)], [{"rank": 0}])]
    searchers = types.SimpleNamespace(poll=lambda: (__import__("time").sleep(0.05), polls.pop(0))[1], check_alive=lambda: None,
                                      restarts=0)
    run = types.SimpleNamespace(cfg=Config(sync_every=4, run_dir=str(tmp_path)), searchers=searchers, start=0, ref_version=0,
                                buffer=ReplayBuffer(capacity_per_prompt=5, seed=0))
    run.books = Bookkeeping(run)
    run.books.t_merge = __import__("time").time()
    tba.merge(run, 8)
    assert not polls, "it polled until a fresh trajectory came"
    assert set(run.buffer.latest) == {2} and len(run.buffer) == 3
    assert run.books.waited >= 0.05, "the wait is measured, and logged as time/wait"


def test_merge_ends_when_only_unscored_completions_follow_a_stale_batch(tmp_path):
    """A stale, scored batch first, then only completions that every reward scored None (each searcher batch
    empty): the wait for a fresh round ends with one line naming the cause (it waited forever: the stale batch
    made `have` non-zero, and the empty batches kept the searchers from looking silent)."""
    import types
    import tba
    from config import Config, RunError
    from ops.bookkeeping import Bookkeeping
    polls = iter([([traj(0, (1,), version=2)], [{"unscored": 0, "sent": 1}])] + [([], [{"unscored": 16, "sent": 0}])] * 100)

    def poll():
        try:
            return next(polls)
        except StopIteration:
            raise AssertionError("the wait never ended") from None
    searchers = types.SimpleNamespace(poll=poll, check_alive=lambda: None, restarts=0)
    run = types.SimpleNamespace(cfg=Config(sync_every=4, batch_size=16, run_dir=str(tmp_path)), searchers=searchers,
                                start=0, ref_version=0, buffer=ReplayBuffer(capacity_per_prompt=5, seed=0))
    run.books = Bookkeeping(run)
    with pytest.raises(RunError, match=r"no reward scored any of the last 64 completions"):
        tba.merge(run, 8)
