"""
The Task interface, and GSM8K: data, prompt format, reward. Training reward and evaluation share a scorer.

A task (class `Task` below) owns its prompts, its scorer and its evaluation. GSM8K implements it here;
TL;DR and red-teaming implement it in their own modules. The trainer and the searchers see only this
interface.

GSM8K (Cobbe et al. 2021; official files openai/grade-school-math, MIT licence). A row is
    {"question": "Janet's ducks lay 16 eggs per day. ...",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\\n... \\n#### 18"}
The prompt is the official TBA code's format:
    "[MATH TASK] Problem:\\n{question}\\n\\nSolution:\\n"
and the reward is 1.0 when the last number in the completion equals the gold number after "####",
else 0.0. Example: completion "... 9 * 2 = 18 dollars.\\n#### 18" -> 18.0 == 18.0 -> reward 1.0.

How numbers are read (`extract_answer`), following the official TBA grader (last number, commas removed):
  - a number is an optional minus sign, digits possibly grouped with commas, an optional decimal part:
    "$1,000.00" -> 1000.0, "-3" -> -3.0, "0.5" -> 0.5, "7." -> 7.0 (a full stop is not a decimal part);
  - the *last* such number in the text is the answer; no number -> None (reward 0).
Known failure cases, kept on purpose because they are what the grader we mirror does:
  - a completion that keeps talking after its answer ("#### 18. Next problem: 3 apples") grades its
    last number (3), not 18;
  - "12-5" at the very end reads as -5 (the minus of a subtraction is taken as a sign);
  - a list "5,6" reads as 56 (commas are always taken as thousands separators);
  - fractions "1/2" read as 2; units are ignored ("18 dollars" -> 18).

Run `python rewards.py PATH/test.jsonl` to grade the gold solutions against themselves (all must pass).
"""

import dataclasses
import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from config import ConfigError

GSM8K_PROMPT = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text):
    """The last number in `text` as a float (commas removed), or None if there is none."""
    for match in reversed(NUMBER_RE.findall(text)):
        digits = match.replace(",", "")
        if digits not in ("", "-"):
            return float(digits)
    return None


def gold_answer(answer_field):
    """The number after '####' in a GSM8K answer field."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer field has no '####': {answer_field[-80:]!r}")
    value = extract_answer(answer_field.split("####")[-1])
    if value is None:
        raise ValueError(f"no number after '####' in GSM8K answer field: {answer_field[-80:]!r}")
    return value


def gsm8k_reward(completion, answer_field):
    """1.0 if the completion's last number equals the gold answer, else 0.0."""
    pred = extract_answer(completion)
    return float(pred is not None and math.isclose(pred, gold_answer(answer_field), rel_tol=0, abs_tol=1e-6))


MAX_LINE_BYTES = 1 << 20  # a data line longer than this is an error, not a memory blow-up


def read_jsonl(path, fields):
    """Rows of a JSON-lines file, each a dict with string `fields` (UTF-8, a BOM allowed, blank lines skipped).
    Every problem is a ConfigError naming file:line."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise ConfigError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in fields):
                raise ConfigError(f"{path}:{lineno}: a row needs string fields {', '.join(map(repr, fields))}")
            rows.append((lineno, {k: row[k] for k in fields}))
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def load_gsm8k(path):
    """Rows of a GSM8K-format jsonl file as a list of {"question", "answer"} dicts; errors name file:line."""
    rows = read_jsonl(path, ("question", "answer"))
    for lineno, row in rows:
        try:
            gold_answer(row["answer"])
        except ValueError as e:
            raise ConfigError(f"{path}:{lineno}: {e}") from None
    return [row for _, row in rows]


def gsm8k_prompt(question):
    return GSM8K_PROMPT.format(question=question)


GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"


def gsm8k_path(split, data_dir, cache_dir):
    """Path of GSM8K's `split` file: from data_dir if given, else downloaded once into cache_dir/gsm8k."""
    if data_dir:
        return os.path.join(data_dir, f"{split}.jsonl")
    path = os.path.join(os.path.expanduser(cache_dir), "gsm8k", f"{split}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        url = GSM8K_URL.format(split=split)
        try:
            urllib.request.urlretrieve(url, path + ".tmp")
        except (urllib.error.URLError, OSError) as e:
            raise ConfigError(f"could not download GSM8K {split} from {url} ({e}); offline? pass --data-dir "
                               f"with train.jsonl and test.jsonl from github.com/openai/grade-school-math") from None
        os.replace(path + ".tmp", path)
    return path


# -----------------------------------------------------------------------------
# The Task interface: what the trainer and the searchers know about a task

@dataclass
class Task:
    """
    A task, as the trainer and the searchers see it. Subclasses fill in `make_scorer` and `evaluate`.

      prompts, metas            training prompts (str) and their metadata (dict each: answer, reference, ...),
                                indexed by Trajectory.prompt_id
      eval_prompts, eval_metas  held-out prompts for evaluation, likewise
      headline                  the eval metric of the run's closing line
      percent                   True: the headline is a fraction, printed as a percentage
      make_scorer(device)       called once in each process that scores (every searcher; the trainer for
                                --sync and evaluation): loads whatever the reward needs and returns a batched
                                score(prompts, completions, metas, **context) -> list[float], completions being
                                texts; context: completion_ids (their token ids), step (the trainer step whose
                                weights generated them), log ({"metrics": {}, "extra": {}}: what the scorer
                                wants logged, tasks/dataset.py); a reward of NaN skips the completion
      evaluate(policy, n)       every eval metric of `policy` (an ops.evaluation.EvalPolicy: generate and score
                                log-probs) on the first n held-out prompts, as a dict of numbers; the dict may
                                also hold an "example" completion (a string) for the log and "samples" (a
                                dict per prompt: prompt, completion, scores) for samples.jsonl

    A Task travels to the searcher processes as plain data: models are loaded by make_scorer (or by
    evaluate) in the process that uses them, never at import time, and attributes whose name starts with
    an underscore (models loaded for evaluation, say) are never pickled.
    """
    prompts: list
    metas: list
    eval_prompts: list
    eval_metas: list
    name = "task"
    headline = "accuracy"
    percent = True

    def make_scorer(self, device="cpu"):
        raise NotImplementedError

    def evaluate(self, policy, n):
        raise NotImplementedError

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def select(self, train_ids, eval_ids):
        """A copy holding only the given training and held-out prompts (e.g. without over-long ones)."""
        pick = lambda xs, ids: [xs[i] for i in ids]
        return dataclasses.replace(self, prompts=pick(self.prompts, train_ids), metas=pick(self.metas, train_ids),
                                   eval_prompts=pick(self.eval_prompts, eval_ids), eval_metas=pick(self.eval_metas, eval_ids))


def greedy_evaluation(policy, prompts, metas, score, name):
    """Greedy completions of held-out prompts scored by `score`: their mean (as `name`; NaN scores, unscored, left
    out), their mean length, the scorer's logged metrics, an example and the samples (with its logged columns)."""
    completions, log = policy.generate(prompts, greedy=True), {"metrics": {}, "extra": {}}
    rewards = score(prompts, [c.text for c in completions], metas, completion_ids=[list(c.token_ids) for c in completions],
                    step=policy.step, log=log)
    scored = [r for r in rewards if not math.isnan(r)]
    return {name: sum(scored) / len(scored) if scored else math.nan,
            **{k: sum(v) / len(v) for k, v in log["metrics"].items()},
            "response_tokens": sum(len(c.token_ids) for c in completions) / len(completions),
            "example": completions[0].text, "samples": samples(prompts, completions, reward=rewards, **log["extra"])}


def samples(prompts, completions, **scores):
    """What samples.jsonl keeps of an evaluation: per held-out prompt its completion and scores (lists)."""
    return [{"prompt": p, "completion": c.text, **{k: v[i] for k, v in scores.items()}}
            for i, (p, c) in enumerate(zip(prompts, completions))]


def gsm8k_score(prompts, completions, metas, **context):
    """The batched GSM8K scorer: gsm8k_reward of each completion against its prompt's answer field."""
    return [gsm8k_reward(c, m["answer"]) for c, m in zip(completions, metas)]


@dataclass
class GSM8KTask(Task):
    """GSM8K: reward 1 for the right final number; evaluation is greedy pass@1 with the same scorer."""
    name = "gsm8k"
    headline = "accuracy"

    @classmethod
    def from_rows(cls, train_rows, eval_rows):
        """From GSM8K rows ({"question", "answer"}), in the official TBA prompt format."""
        prompts = lambda rows: [gsm8k_prompt(r["question"]) for r in rows]
        metas = lambda rows: [{"answer": r["answer"]} for r in rows]
        return cls(prompts(train_rows), metas(train_rows), prompts(eval_rows), metas(eval_rows))

    def make_scorer(self, device="cpu"):
        return gsm8k_score  # a pure function: nothing to load

    def evaluate(self, policy, n):
        return greedy_evaluation(policy, self.eval_prompts[:n], self.eval_metas[:n], gsm8k_score, "accuracy")


if __name__ == "__main__":
    rows = load_gsm8k(sys.argv[1])
    solved = sum(gsm8k_reward(r["answer"], r["answer"]) for r in rows)
    print(f"{sys.argv[1]}: gold solutions graded correct: {solved:.0f}/{len(rows)}")
