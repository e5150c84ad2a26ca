"""
The policy as a task's evaluation sees it: text in, text out (`EvalPolicy`), for ops/bookkeeping.py's evaluations
and the tasks' `evaluate` (rewards.py, tasks/). Generation is the searchers' own (searcher.HFGenerator).
"""

from ops.models import completions, encode_prompts, score_logprobs
from searcher import HFGenerator


class EvalPolicy:
    """The trained policy and its reference, text in and out: what `Task.evaluate` works with."""

    def __init__(self, cfg, model, ref, tokenizer, step=0):
        self.cfg, self.model, self.ref, self.tokenizer, self.step = cfg, model, ref, tokenizer, step  # (after `step` steps)
        self.generator = HFGenerator(model, tokenizer, cfg.max_new_tokens)  # (searcher.py's generation)

    def generate(self, prompts, n=1, temperature=1.0, greedy=False):
        """n completions per prompt (prompt-major), eval_batch_size rows per generate call."""
        rows = [ids for ids in encode_prompts(self.tokenizer, prompts) for _ in range(n)]
        out = []
        for i in range(0, len(rows), self.cfg.eval_batch_size):
            out += self.generator.generate(rows[i:i + self.cfg.eval_batch_size], 1, temperature, greedy)
        return completions(self.tokenizer, out, self.generator.stop_ids)

    def logprobs(self, prompts, completions, model="policy"):
        """Sequence log-probs (at the loss temperature) of completions of prompts under the policy or the reference."""
        prompt_tokens = encode_prompts(self.tokenizer, prompts)
        net = self.model if model == "policy" else self.ref
        return score_logprobs(net, prompt_tokens, [c.token_ids for c in completions], self.tokenizer.pad_token_id,
                              self.cfg.score_temperature, self.cfg.micro_batch)
