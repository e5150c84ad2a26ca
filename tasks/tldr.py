"""
TL;DR summarisation as a TBA task (paper Sec. 5.2, Table 1): data, prompt, reward models, evaluation.

The task (Stiennon et al. 2020, "Learning to summarize from human feedback", on the filtered Reddit TL;DR
set of Huang et al. 2024). A row of the official data set
`vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144` has, among other columns,
    {"subreddit": "relationships", "title": "My bf forgot ...", "post": "So we have been ...", "summary": "bf forgot ..."}
The prompt is that data set's `query` column, rebuilt here from the four fields:
    "SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:"
where the post is cut at its last newline (by one character when it has none) until the prompt fits in
512 tokens, and the reference response is f" {summary}" (then EOS), as in the script that built the set.

Rewards. The policy is trained on a *proxy* reward model and judged by a *gold* one:
    win rate = mean_x [ gold(x, y_policy(x)) > gold(x, y_reference(x)) ]      (ties lose)
A reward model is an AutoModelForSequenceClassification with one label (`RewardModel`). It reads the text
prompt + response, then EOS, and its score is read at that EOS token, where TRL's get_reward reads the
official proxy RM. The official trainer replaces the score of a response with no EOS by -1
(`--no-eos-reward -1`, applied by the searchers); the official evaluation applies no such penalty.
In the tiny preset the gold is a program, `fact_score` (see run_tldr.py for the corpus it grades).

Evaluation (`TLDRTask.evaluate`), on the first n validation prompts, one greedy response each:
    win_rate        as above
    gold_reward     mean gold(x, y);  proxy_reward: mean proxy(x, y), no EOS penalty
    kl              the exact KL(pi_sft || pi) per response token, at temperature 1, teacher-forced on y:
                    mean over the tokens t of y of  sum_v pi_sft(v|x,y_<t) [log pi_sft(v|x,y_<t) - log pi(v|x,y_<t)],
                    then mean over prompts: the official src/kl.py's quantity (same direction, the whole
                    vocabulary, no sampling estimator), not the sampled log pi - log pi_ref of loss/kl
    ppl             exp(mean over the tokens of y of -log pi_sft(y_t | x, y_<t)), then mean over prompts
    response_tokens mean response length, EOS included
pi_sft is the initial policy (--ref-model, else --model), loaded once in the trainer process by evaluate.

Departures from the official code (bbartoldson/TBA and its evaluation scripts from mnoukhov/async_rlhf):
  1. Evaluation decodes greedily; the official code samples at temperature 0.01 (the same but for near-ties).
  2. KL and perplexity use exactly the positions that predict response tokens. The official kl.py mask is
     shifted by one token, and its perplexity divides the response NLL by the whole length, prompt included.
  3. The reward models score the decoded text, re-tokenised; the official trainer scores the policy's ids.
  4. The gold RM is read at the EOS token. The official evaluation pipeline (transformers 4.43.3, pad := EOS
     since the Pythia-6.9B tokenizer had none) read it at the token before the EOS; HF's head reads the last
     token that is not padding, which depends on the pad token (transformers 5 gives Pythia's tokenizer a
     pad token by default), so we choose the pad id ourselves (`rm_pad_id`).
  5. Parquet files need pyarrow, and loading by hub name needs the `datasets` library; neither is required
     for the tiny preset or for JSON-lines files.
  6. Searchers run in float32 like the trainer (officially vLLM ran in fp16).
  7. The prompt is rebuilt from subreddit, title and post with the policy's tokenizer (the official script
     used the same procedure with the Pythia tokenizer to make the `query` column).

Run: python run_tldr.py (this module is the task; run_tldr.py builds it and trains).
"""

import glob
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from config import ConfigError
from loss import make_batch
from rewards import Task, samples

TLDR_PROMPT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
TLDR_FIELDS = ("subreddit", "title", "post", "summary")
TLDR_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"


# -----------------------------------------------------------------------------
# Data: the official schema, the prompt and its truncation

def tldr_query(row, count_tokens, max_tokens=512):
    """The prompt of a row; the post is cut at its last newline (else by one character) until it fits."""
    post = row["post"]
    query = TLDR_PROMPT.format(subreddit=row["subreddit"], title=row["title"], post=post)
    while count_tokens(query) > max_tokens:
        if not post:
            raise ValueError(f"the prompt without its post is still over {max_tokens} tokens: {query[:80]!r}")
        cut = post.rfind("\n")
        post = post[:cut] if cut >= 0 else post[:-1]
        query = TLDR_PROMPT.format(subreddit=row["subreddit"], title=row["title"], post=post)
    return query


def load_tldr(path):
    """Rows with string fields subreddit, title, post, summary from a .jsonl, .json or .parquet file (other
    columns are kept); errors name file:line (file:row for parquet)."""
    if not os.path.isfile(path):
        raise ConfigError(f"TL;DR file not found: {path}")
    rows = []
    for where, row in _records(path):
        missing = [k for k in TLDR_FIELDS if not isinstance(row, dict) or not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{where}: a TL;DR row needs string fields {', '.join(TLDR_FIELDS)} "
                              f"(bad: {', '.join(missing)})")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no TL;DR rows")
    return rows


def _records(path):
    """(location, record) pairs of a JSON-lines file, a JSON array, or a parquet file."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or give JSON lines") from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    with open(path, encoding="utf-8") as f:
        if f.read(1) == "[":  # one JSON array (records orient)
            f.seek(0)
            try:
                for i, row in enumerate(json.load(f)):
                    yield f"{path}:item {i}", row
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            return
        f.seek(0)
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def tldr_rows(split, data_dir):
    """The rows of a split: from data_dir ({split}.jsonl, .json, .parquet, or the hub's {split}-*.parquet
    shards), else from the hub with the `datasets` library."""
    if data_dir:
        for name in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet"):
            if os.path.isfile(os.path.join(data_dir, name)):
                return load_tldr(os.path.join(data_dir, name))
        shards = sorted(glob.glob(os.path.join(data_dir, "**", f"{split}-*.parquet"), recursive=True))
        if not shards:
            raise ConfigError(f"--data-dir {data_dir}: no {split}.jsonl, {split}.json, {split}.parquet or {split}-*.parquet")
        return [row for shard in shards for row in load_tldr(shard)]
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"no --data-dir and no `datasets` library to download {TLDR_DATASET}: pip install datasets, "
                          f"or pass --data-dir with {split}.jsonl (fields {', '.join(TLDR_FIELDS)})") from None
    return [dict(r) for r in datasets.load_dataset(TLDR_DATASET, split=split)]


# -----------------------------------------------------------------------------
# Reward models

def rm_pad_id(tokenizer):
    """The id that pads reward-model inputs: any id but EOS, so that the last token that is not padding, where
    HF's sequence-classification head reads the score, is each row's EOS (padding is masked anyway)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    return pad if pad is not None and pad != eos else int(eos == 0)


def reward_inputs(tokenizer, prompts, responses):
    """Right-padded (input_ids, attention_mask) of prompt + response + EOS, each (N, T)."""
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer([p + r for p, r in zip(prompts, responses)])["input_ids"]]
    T = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [rm_pad_id(tokenizer)] * (T - len(r)) for r in rows])  # (N, T)
    attention_mask = (torch.arange(T)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()  # (N, T)
    return input_ids, attention_mask


class RewardModel:
    """A scalar reward model (AutoModelForSequenceClassification, num_labels=1) as a batched scorer
    score(prompts, responses, metas) -> list[float]. Load it once per process."""

    def __init__(self, path, device="cpu", dtype=torch.float32, batch_size=16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging
        logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
        model.config.pad_token_id = rm_pad_id(self.tokenizer)  # HF reads the last token that is not padding: the EOS
        self.model, self.batch_size = model.to(device).eval(), batch_size

    @torch.no_grad()
    def __call__(self, prompts, responses, metas=None, **context):  # (what else a scorer is passed: rewards.Task)
        scores = []
        for i in range(0, len(prompts), self.batch_size):
            batch = reward_inputs(self.tokenizer, prompts[i:i + self.batch_size], responses[i:i + self.batch_size])
            input_ids, attention_mask = (t.to(self.model.device) for t in batch)
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # (n, 1)
            scores += logits[:, 0].float().tolist()
        return scores


def fact_score(prompts, responses, metas, **context):
    """The tiny preset's gold score of each response, from its post's key facts and distractors (in metas).

    A summary is read as phrases split at "," and "."; each phrase is a tuple of words. Then
        gold = (# distinct key facts stated)
               - 1.0 per phrase that is a distractor of the post  (irrelevant detail)
               - 1.0 per phrase that is neither a fact nor a distractor of the post  (garbled or invented)
               - 0.5 per repeat of a phrase already stated
               - 0.25 per word beyond 14  (a perfect three-fact summary has 12)
    e.g. facts {boss cut pay, mom sold car, dad lost job}, distractors {we like tea, i watched chess}:
        "boss cut pay , mom sold car ."                -> 2
        "boss cut pay , we like tea , boss cut pay ." -> 1 - 1 - 0.5 = -0.5
    """
    return [_fact_score(r, m) for r, m in zip(responses, metas)]


def _fact_score(response, meta):
    facts, distractors = {tuple(f.split()) for f in meta["facts"]}, {tuple(d.split()) for d in meta["distractors"]}
    words = re.findall(r"\w+|[^\w\s]+", response)
    phrases = [tuple(p.split()) for p in re.split(r"[,.]", " ".join(words)) if p.strip()]
    stated = [p for i, p in enumerate(phrases) if p not in phrases[:i]]
    score = len(facts & set(phrases))
    score -= sum(1.0 for p in phrases if p in distractors) + sum(1.0 for p in phrases if p not in facts | distractors)
    score -= 0.5 * (len(phrases) - len(stated)) + 0.25 * max(0, len(words) - 14)
    return score


# -----------------------------------------------------------------------------
# Evaluation quantities

def win_rate(gold_policy, gold_reference):
    """Fraction of prompts where the policy's response beats the reference by the gold score (ties lose)."""
    return sum(g > r for g, r in zip(gold_policy, gold_reference)) / len(gold_policy)


def next_token_logprobs(model, input_ids, attention_mask, response_mask):
    """log pi(. | x, y_<t) over the vocabulary at each response position t, temperature 1: (N, R, V)."""
    R = int(response_mask.sum(dim=1).max())
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, T) left padding does not shift positions
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return F.log_softmax(logits[:, -R - 1:-1].float(), dim=-1)  # (N, R, V) position t-1 predicts token t


@torch.no_grad()
def kl_and_perplexity(policy, sft, prompt_tokens, responses, pad_id, micro_batch):
    """Per response: exact KL(pi_sft || pi) per token, and perplexity under pi_sft (temperature 1). Two (N,) lists."""
    kl, ppl = [], []
    device = next(policy.parameters()).device
    for i in range(0, len(responses), micro_batch):
        batch = [t.to(device) for t in make_batch(prompt_tokens[i:i + micro_batch], responses[i:i + micro_batch], pad_id)]
        logp, sft_logp = next_token_logprobs(policy, *batch), next_token_logprobs(sft, *batch)  # (n, R, V)
        R = logp.shape[1]
        mask, tokens = batch[2][:, -R:].float(), batch[0][:, -R:]  # (n, R)
        kl_t = (sft_logp.exp() * (sft_logp - logp)).sum(dim=-1)  # (n, R) KL of the next-token distributions
        nll_t = -sft_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (n, R)
        n_tokens = mask.sum(dim=1).clamp(min=1)  # (n,)
        kl += ((kl_t * mask).sum(dim=1) / n_tokens).tolist()
        ppl += torch.exp((nll_t * mask).sum(dim=1) / n_tokens).tolist()
    return kl, ppl


# -----------------------------------------------------------------------------
# The task

@dataclass
class TLDRTask(Task):
    """TL;DR: train on the proxy RM, judge by the gold RM (or the tiny preset's `fact_score`) against references.

    metas: {"reference": " summary"} per prompt; the tiny preset's also hold "facts" and "distractors"."""
    proxy_rm: str = ""  # the training reward model: hub name or local directory
    gold_rm: str = ""  # the evaluation reward model; empty: fact_score
    dtype: str = "float32"  # of the reward models (the run's --searcher-dtype: they only score)
    rm_batch_size: int = 16  # rows per reward-model forward
    name = "tldr"
    headline = "win_rate"

    @classmethod
    def from_rows(cls, train_rows, eval_rows, tokenizer, max_tokens=512, **fields):
        """Prompts in the official format, truncated for `tokenizer`; references (and facts) in the metas."""
        count = lambda text: len(tokenizer(text)["input_ids"])
        prompts = lambda rows: [tldr_query(r, count, max_tokens) for r in rows]
        metas = lambda rows: [{"reference": " " + r["summary"], **{k: r[k] for k in ("facts", "distractors") if k in r}}
                              for r in rows]
        return cls(prompts(train_rows), metas(train_rows), prompts(eval_rows), metas(eval_rows), **fields)

    def make_scorer(self, device="cpu"):
        from ops.models import dtype_of
        return RewardModel(self.proxy_rm, device, dtype_of(self.dtype), self.rm_batch_size)

    def make_gold(self, device="cpu"):
        """The gold scorer: the gold reward model, or fact_score when there is none."""
        from ops.models import dtype_of
        return RewardModel(self.gold_rm, device, dtype_of(self.dtype), self.rm_batch_size) if self.gold_rm else fact_score

    def evaluate(self, policy, n):
        cfg = policy.cfg
        prompts, metas = self.eval_prompts[:n], self.eval_metas[:n]
        done = policy.generate(prompts, greedy=True)
        responses = [c.text for c in done]
        # the evaluation's models are loaded for it and freed after it (the memory plan counts them so: ops/memory.py)
        gold, proxy, sft = self.make_gold(cfg.device), self.make_scorer(cfg.device), _load_sft(cfg)
        references = self._load(f"_reference_gold_{n}", lambda: gold(prompts, [m["reference"] for m in metas], metas))
        gold_policy = gold(prompts, responses, metas)
        kl, ppl = kl_and_perplexity(policy.model, sft, policy.tokenizer(list(prompts))["input_ids"],
                                    [c.token_ids for c in done], policy.tokenizer.pad_token_id, cfg.micro_batch)
        mean = lambda xs: sum(xs) / len(xs)
        return {"win_rate": win_rate(gold_policy, references), "gold_reward": mean(gold_policy),
                "proxy_reward": mean(proxy(prompts, responses, metas)), "kl": mean(kl), "ppl": mean(ppl),
                "response_tokens": mean([len(c.token_ids) for c in done]), "example": responses[0],
                "samples": samples(prompts, done, gold_reward=gold_policy, kl=kl)}

    def _load(self, name, load):
        """A value computed once per process (the references' gold scores); `_` attributes are never pickled."""
        if name not in self.__dict__:
            self.__dict__[name] = load()
        return self.__dict__[name]


def _load_sft(cfg):
    from ops.models import dtype_of, load_model
    model, _ = load_model(cfg.ref_model or cfg.model, cfg.device, dtype_of(cfg.searcher_dtype), cfg.trust_remote_code)
    return model.requires_grad_(False)
