"""
Tasks' data and rewards. Training reward and evaluation call the same functions.

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

import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

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


def load_gsm8k(path):
    """Rows of a GSM8K-format jsonl file as a list of {"question", "answer"} dicts; errors name file:line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise ValueError(f"{path}:{lineno}: a GSM8K row needs string fields 'question' and 'answer'")
            try:
                gold_answer(row["answer"])
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise ValueError(f"{path}: no GSM8K rows")
    return rows


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
            raise RuntimeError(f"could not download GSM8K {split} from {url} ({e}); offline? pass --data-dir "
                               f"with train.jsonl and test.jsonl from github.com/openai/grade-school-math") from None
        os.replace(path + ".tmp", path)
    return path


@dataclass
class Task:
    """What the trainer and searchers need to know about a task; plain data, so it pickles to children."""
    name: str
    prompts: list  # training prompts (str), indexed by Trajectory.query_id
    answers: list  # what reward() compares a completion with, one per prompt
    eval_prompts: list  # held-out prompts for greedy evaluation
    eval_answers: list
    reward: Callable  # reward(completion, answer) -> float; a module-level function


def gsm8k_task(train_rows, eval_rows, name="gsm8k"):
    return Task(name, [gsm8k_prompt(r["question"]) for r in train_rows], [r["answer"] for r in train_rows],
                [gsm8k_prompt(r["question"]) for r in eval_rows], [r["answer"] for r in eval_rows], gsm8k_reward)


if __name__ == "__main__":
    rows = load_gsm8k(sys.argv[1])
    solved = sum(gsm8k_reward(r["answer"], r["answer"]) for r in rows)
    print(f"{sys.argv[1]}: gold solutions graded correct: {solved:.0f}/{len(rows)}")
