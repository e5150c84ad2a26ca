"""
Your own model, data and reward (tasks/dataset.py, `python tba.py`): datasets read through HF `datasets`, chat
prompts through the chat template with one BOS, a TRL-style reward called as TRL calls it, every bad input one
line before anything starts, a bad reward ending the run with a line naming it, and a run that learns.

Run: python -m pytest -q tests/test_dataset_task.py
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from config import ConfigError
from tasks.dataset import DEFAULTS, DatasetConfig, RewardError, RewardScorer, load_reward, make_task, read_rows
from tests.helpers import ROOT, _tiny_qwen2, read_metrics

REWARDS = '''
import asyncio

def says_yes(prompts, completions, target, **kwargs):
    return [1.0 if t in c[0]["content"] else 0.0 for c, t in zip(completions, target)]

def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def short(prompts, completions, **kwargs):
    return [1.0]

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def words(prompts, completions, **kwargs):
    return ["yes"] * len(completions)

def boom(prompts, completions, **kwargs):
    raise KeyError("target")

async def async_yes(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0 if "yes" in c[0]["content"] else 0.0 for c in completions]

def half_none(prompts, completions, completion_ids, **kwargs):
    return [None if len(ids) % 2 else 1.0 for ids in completion_ids]

def old_style(prompts, completions, target):
    return [0.0] * len(completions)

NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A tiny random Qwen2 chat model, chat-prompt datasets with an extra column, and a file of rewards."""
    root = tmp_path_factory.mktemp("own")
    texts = ["yes no maybe yes", "the cat says yes", "hello world, hello you", "no, never", "maybe later"] * 20
    _tiny_qwen2(root / "qwen", texts)
    for name, lo, hi in (("train", 0, 96), ("eval", 96, 128)):
        with open(root / f"{name}.jsonl", "w") as f:
            for i in range(lo, hi):
                f.write(json.dumps({"prompt": [{"role": "user", "content": f"do you like tea {i}?"}], "target": "yes"}) + "\n")
    (root / "rewards.py").write_text(REWARDS)
    return root


def _cfg(own, **fields):
    return DatasetConfig(**{**DEFAULTS, "model": str(own / "qwen"), "dataset": str(own / "train.jsonl"),
                            "eval_dataset": str(own / "eval.jsonl"), "reward": [f"{own / 'rewards.py'}:says_yes"], **fields})


def test_chat_prompts_go_through_the_template_and_the_reward_is_called_as_trl_calls_it(own):
    task = make_task(_cfg(own))
    assert len(task.prompts) == 96 and len(task.eval_prompts) == 32 and task.chat
    assert task.prompts[0] == "<|im_start|>user\ndo you like tea 0?<|im_end|>\n<|im_start|>assistant\n"
    assert task.metas[0] == {"prompt": [{"role": "user", "content": "do you like tea 0?"}], "target": "yes"}
    score = task.make_scorer()
    assert score(task.prompts[:2], ["oh yes", "no"], task.metas[:2]) == [1.0, 0.0], "chat completions, extra column"
    text = RewardScorer([f"{own / 'rewards.py'}:text_length"], [1.0], "prompt", chat=False, steps=10)
    assert text(["p"], ["four"], [{"prompt": "p"}]) == [4.0], "text prompts get text completions"


def test_one_bos_when_the_template_renders_it():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from ops.models import encode_prompts
    tok = Tokenizer(models.WordLevel({"<s>": 0, "hello": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # adds a BOS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")
    assert tokenizer("<s>hello")["input_ids"] == [0, 0, 1], "a rendered chat prompt, tokenized plainly: two BOS"
    assert encode_prompts(tokenizer, ["hello", "<s>hello"]) == [[0, 1], [0, 1]]


@pytest.mark.parametrize("name,message", [
    ("short", "returned 1 values for 2 completions; expected a list of 2 finite numbers"),
    ("nan", "returned 2 values with nan for 2 completions"),
    ("words", "returned 2 values with 'yes' for 2 completions"),
    ("boom", "raised KeyError: 'target'"),
])
def test_a_bad_reward_is_named_with_what_it_did(own, name, message):
    score = RewardScorer([f"{own / 'rewards.py'}:{name}"], [1.0], "prompt", chat=False, steps=10)
    with pytest.raises(RewardError, match=re.escape(f"--reward {own / 'rewards.py'}:{name} {message}")):
        score(["p", "q"], ["a", "b"], [{"prompt": "p"}, {"prompt": "q"}])


def test_bad_inputs_are_one_line_naming_the_flag(own, tmp_path):
    rewards = own / "rewards.py"
    cases = [(lambda: load_reward(f"{tmp_path / 'none.py'}:f"), f"--reward {tmp_path / 'none.py'}:f: no such file"),
             (lambda: load_reward(f"{rewards}:missing"), f"--reward {rewards}:missing: {rewards} has no missing"),
             (lambda: load_reward(f"{rewards}:NOT_A_FUNCTION"), "NOT_A_FUNCTION is a int, not a function"),
             (lambda: load_reward("says_yes"), "--reward says_yes: expected FILE.py:NAME or module:NAME"),
             (lambda: make_task(_cfg(own, prompt_column="question")), "--prompt-column question: not a column"),
             (lambda: make_task(_cfg(own, dataset=str(tmp_path / "no.jsonl"))), "no such file"),
             (lambda: make_task(_cfg(own, reward=[])), "--reward is required"),
             (lambda: make_task(_cfg(own, reward_weights=[1.0, 2.0])), "--reward-weights: 2 weights for 1 rewards"),
             (lambda: make_task(_cfg(own, reward=[f"{rewards}:old_style"])),
              f"--reward {rewards}:old_style: old_style() takes no keyword argument 'completion_ids', which every "
              f"reward is passed (TRL's reward interface: give it **kwargs)")]
    (tmp_path / "empty.jsonl").write_text("")
    cases.append((lambda: make_task(_cfg(own, dataset=str(tmp_path / "empty.jsonl"))), "empty.jsonl"))
    for call, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()


def test_csv_parquet_and_save_to_disk_read_alike(own, tmp_path):
    import datasets
    rows = [{"prompt": f"say {i}", "target": "yes"} for i in range(5)]
    data = datasets.Dataset.from_list(rows)
    data.to_csv(tmp_path / "d.csv")
    data.to_parquet(tmp_path / "d.parquet")
    data.save_to_disk(tmp_path / "saved")
    for path in ("d.csv", "d.parquet", "saved"):
        assert read_rows(str(tmp_path / path), "", "train", "dataset", "prompt") == rows, path


def _run(own, tmp_path, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), "--model", str(own / "qwen"), "--dataset", str(own / "train.jsonl"),
           "--eval-dataset", str(own / "eval.jsonl"), "--run-dir", str(tmp_path / "run"), "--device", "cpu",
           "--max-new-tokens", "6", "--batch-size", "32", "--responses-per-prompt", "8", "--samples-per-prompt", "8",
           "--initial-completions", "32", "--eval-every", "0", "--log-every", "10", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_your_own_model_data_and_reward_learn_from_the_command_line(own, tmp_path):
    out = _run(own, tmp_path, "--reward", f"{own / 'rewards.py'}:says_yes", "--steps", "40", "--lr", "3e-3")
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(float, re.fullmatch(r"reward: before ([\d.]+) -> after ([\d.]+)", out.stdout.splitlines()[-1]).groups())
    assert after - before >= 0.2, out.stdout[-2000:]
    result = json.load(open(tmp_path / "run" / "result.json"))
    assert result["headline"] == "reward" and math.isclose(result["after"]["eval/reward"], after, abs_tol=1e-3)


def test_a_reward_that_fails_ends_the_run_naming_it(own, tmp_path):
    out = _run(own, tmp_path, "--reward", f"{own / 'rewards.py'}:nan", "--steps", "40")
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"error: --reward {own / 'rewards.py'}:nan returned 32 values with nan for 32 completions" in out.stderr
    again = _run(own, tmp_path, "--reward", f"{own / 'rewards.py'}:nan", "--steps", "40")  # the same command again
    assert again.returncode == 1 and "error: --reward" in again.stderr, again.stderr[-3000:]
    assert f"--run-dir {tmp_path / 'run'}: an earlier start ended before its first step" in again.stdout, "not refused"
    out = _run(own, tmp_path / "second", "--reward", f"{own / 'rewards.py'}:missing", "--steps", "40")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: --reward {own / 'rewards.py'}:missing: {own / 'rewards.py'} has no missing"]
    assert not os.path.exists(tmp_path / "second"), "a refused run writes nothing"


def test_lora_learns_resumes_and_saves_a_model_from_pretrained_loads(own, tmp_path):
    pytest.importorskip("peft")
    reward = ["--reward", f"{own / 'rewards.py'}:says_yes", "--lr", "3e-3", "--lora-rank", "4"]
    out = _run(own, tmp_path, *reward, "--steps", "40", "--checkpoint-every", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(float, re.fullmatch(r"reward: before ([\d.]+) -> after ([\d.]+)", out.stdout.splitlines()[-1]).groups())
    assert after - before >= 0.1, out.stdout[-2000:]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "step-000040" / "policy" / "adapter_model.safetensors")
    resumed = _run(own, tmp_path, *reward, "--steps", "44", "--resume", str(tmp_path / "run"))  # the same flags
    assert resumed.returncode == 0 and "at step 40" in resumed.stdout, resumed.stderr[-3000:]
    from ops.models import load_model
    final, _ = load_model(str(tmp_path / "run" / "final"))  # the merged policy, a plain model
    assert type(final).__name__ == "Qwen2ForCausalLM"


def test_the_readme_examples_run_as_written(own, tmp_path):
    """The README's reward file and Python example, with the tiny model and data in place of the hub's."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Your own model, data and reward"):readme.index("## Reading the code")]
    reward, _, script = re.findall(r"```(?:python|bash)\n(.*?)```", section, re.S)
    (tmp_path / "my_reward.py").write_text(reward)
    rows = [{"prompt": [{"role": "user", "content": f"Do you like tea {i}?"}], "topic": "tea"} for i in range(80)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = script.replace("Qwen/Qwen2.5-0.5B-Instruct", str(own / "qwen")).replace(
        '"steps": 100', '"steps": 4, "max_new_tokens": 6, "eval_holdout": 16, "eval_size": 16, "device": "cpu"')
    (tmp_path / "my_run.py").write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + script)
    out = subprocess.run([sys.executable, "my_run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.fullmatch(r"reward: before [\d.]+ -> after [\d.]+", out.stdout.splitlines()[-1])
    bash = re.sub(r" *\\\n *", " ", re.findall(r"```bash\n(.*?)```", section, re.S)[0])  # (continued lines joined)
    command = re.search(r"^(python tba.py .*--max_steps 100.*?)(?:  #.*)?$", bash, re.M).group(1)  # TRL's names
    command = command.replace("Qwen/Qwen2.5-0.5B-Instruct", str(own / "qwen")).replace("--max_steps 100", "--max_steps 4")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tba.py"), *command.split()[2:], "--max_completion_length", "6",
                          "--eval-holdout", "16", "--eval-size", "16", "--device", "cpu", "--output_dir", "trl-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.load(open(tmp_path / "trl-run" / "config.json"))["steps"] == 4


TRL_DOCS = r'''
import asyncio
import re

def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if "4" in completion[0]["content"] else -1.0)
        else:
            rewards.append(None)
    return rewards

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

def logging_reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c[0]["content"]) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards

def progress(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)
'''  # TRL 1.16's GRPOTrainer documentation's examples 1, 2, 4, 5 and 6 as written there (the helpers of example 4
#    replaced by a check), and a reward reading trainer_state


def test_rewards_written_as_trls_documentation_writes_them(tmp_path):
    (tmp_path / "trl_docs.py").write_text(TRL_DOCS)
    spec = lambda name: f"{tmp_path / 'trl_docs.py'}:{name}"
    names = ["reward_func", "format_reward_func", "math_reward_func", "async_reward_func", "logging_reward_func", "progress"]
    for name in names:  # (every signature takes what it is passed)
        from tasks.dataset import check_signature
        check_signature(spec(name), load_reward(spec(name)), ["task", "ground_truth"])
    metas = [{"prompt": [{"role": "user", "content": "2+2?"}], "task": "math", "ground_truth": "4"},
             {"prompt": [{"role": "user", "content": "code"}], "task": "code", "ground_truth": "1"}]
    texts = ["<think>2 and 2</think><answer>\\boxed{4}</answer>", "no"]
    call = lambda names, weights, log=None: RewardScorer([spec(n) for n in names], weights, "prompt", chat=True, steps=8)(
        ["p", "q"], texts, metas, completion_ids=[[1, 2, 3], [4]], step=2, log=log)
    assert call(["reward_func"], [1.0]) == [3.0, 1.0], "completion_ids: the generated token ids"
    assert call(["format_reward_func"], [1.0]) == [1.0, 0.0], "chat completions"
    assert call(["progress"], [1.0]) == [0.25, 0.25], "trainer_state: global_step 2 of max_steps 8"
    assert math.isnan(call(["math_reward_func"], [1.0])[1]), "every reward None: unscored (NaN)"
    assert call(["math_reward_func", "format_reward_func"], [2.0, 0.5]) == [2.5, 0.0], "None left out of the weighted sum"
    assert call(["async_reward_func", "reward_func", "async_reward_func"], [1.0, 1.0, 1.0]) == [5.0, 3.0], "async awaited"
    log = {"metrics": {}, "extra": {}}
    assert call(["logging_reward_func"], [1.0], log) == [1.0, 0.0]
    assert log == {"metrics": {"accuracy": [0.5]}, "extra": {"golden_answer": ["4", "1"], "extracted_answer": ["4", "[none]"]}}


def test_async_rewards_score_inside_a_running_event_loop(tmp_path):
    """Scoring from inside a running event loop (a notebook's): the async rewards are awaited on the scorer's own
    loop (asyncio.run raised "cannot be called from a running event loop")."""
    import asyncio
    path = tmp_path / "rewards.py"
    path.write_text("import asyncio\n\nasync def slow(prompts, completions, **kwargs):\n    await asyncio.sleep(0)\n"
                    "    return [float(len(c)) for c in completions]\n")
    scorer = RewardScorer([f"{path}:slow"], [1.0], "prompt", False, 10)

    async def inside_a_loop():
        return scorer(["p", "q"], ["ab", "abc"], [{"prompt": "p"}, {"prompt": "q"}])
    assert asyncio.run(inside_a_loop()) == [2.0, 3.0]


def test_two_rewards_one_async_with_weights_learn_and_none_is_skipped(own, tmp_path):
    """python tba.py with two rewards (one async) and weights learns; a TRL-signature reward taking completion_ids runs
    unchanged, and a completion it scores None (with nothing else scoring it) is skipped, counted, warned about."""
    rewards = lambda *names: [a for n in names for a in ("--reward", f"{own / 'rewards.py'}:{n}")]
    out = _run(own, tmp_path, *rewards("says_yes", "async_yes"), "--reward-weights", "1", "0.5", "--steps", "40",
               "--lr", "3e-3")
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(float, re.fullmatch(r"reward: before ([\d.]+) -> after ([\d.]+)", out.stdout.splitlines()[-1]).groups())
    assert after - before >= 0.3, out.stdout[-2000:]
    assert max(before, after) <= 1.5 + 1e-9, "the weighted sum of two rewards in [0, 1] with weights 1 and 0.5"
    out = _run(own, tmp_path / "none", *rewards("half_none"), "--steps", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"warning: \d+ completions that every reward scored None were skipped at step \d+", out.stdout)
    rows = read_metrics(tmp_path / "none", evals=True)
    assert sum(r.get("reward/unscored", 0) for r in rows) > 0 and all(r["reward/batch"] == 1.0 for r in rows if "loss/train" in r)


def test_dry_run_runs_the_input_checks_of_a_real_start(own, tmp_path):
    """--dry-run refuses (exit 2, one line) what the real start would: a dataset that --eval-holdout leaves without
    training rows, a model neither here nor reachable; it used to print a plan and exit 0. A model whose shape the
    plan knows (a paper preset's) is a warning offline."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "hi", "target": "yes"}) + "\n")
    base = [sys.executable, os.path.join(ROOT, "tba.py"), "--reward", f"{own / 'rewards.py'}:says_yes", "--dry-run",
            "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(base + ["--model", str(own / "qwen"), "--dataset", str(one)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (f"error: --eval-holdout 64 leaves no training rows of the 1 in "
                                                          f"--dataset {one}; give --eval-dataset, --eval-split or a smaller --eval-holdout")
    text = tmp_path / "text.jsonl"  # (text prompts: chat ones would load the tokenizer for its template first)
    text.write_text("".join(json.dumps({"prompt": f"do you like tea {i}?", "target": "yes"}) + "\n" for i in range(80)))
    data = ["--dataset", str(text)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # (no hub, as on this machine)
    out = subprocess.run(base + ["--model", "nobody/no-such-model", *data], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.startswith("error: --model nobody/no-such-model: not in the Hugging Face "
                                                         "cache here, and the hub cannot give it"), out.stderr
    out = subprocess.run(base + ["--model", "realtreetune/rho-1b-sft-GSM8K", *data, "--plan-for", "1x80"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "warning: --model realtreetune/rho-1b-sft-GSM8K: not in the Hugging Face cache" in out.stdout
    assert "memory plan (estimates; GPUs of 80 GiB):" in out.stdout and not os.path.exists(tmp_path / "run")


# -----------------------------------------------------------------------------
# TRL's names and --config files (ops/flags.py)

TRL_FLAGS = ["--learning_rate", "3e-3", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4",
             "--num_generations", "8", "--max_completion_length", "6", "--max_steps", "40", "--logging_steps", "10"]


def _run_trl(own, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), "--model", str(own / "qwen"), "--dataset", str(own / "train.jsonl"),
           "--eval-dataset", str(own / "eval.jsonl"), "--device", "cpu", "--initial-completions", "32", "--eval-every", "0",
           *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _learned(out):
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(float, re.fullmatch(r"reward: before ([\d.]+) -> after ([\d.]+)", out.stdout.splitlines()[-1]).groups())
    return after - before


def test_trl_names_on_the_command_line_and_in_a_yaml_file_learn(own, tmp_path):
    """The command line a GRPOTrainer user brings (GRPOConfig's names; their batch of 8 x 4 completions, 8 per prompt)
    runs and learns as the own-task test does (+0.2), and so do the same names in a --config YAML file."""
    cli = _run_trl(own, *TRL_FLAGS, "--reward", f"{own / 'rewards.py'}:says_yes", "--output_dir", str(tmp_path / "cli"))
    assert _learned(cli) >= 0.2, cli.stdout[-2000:]
    saved = json.load(open(tmp_path / "cli" / "config.json"))
    assert (saved["lr"], saved["batch_size"], saved["responses_per_prompt"], saved["samples_per_prompt"],
            saved["max_new_tokens"], saved["steps"], saved["log_every"]) == (3e-3, 32, 8, 8, 6, 40, 10)
    yaml = "".join(f"{a[2:]}: {b}\n" for a, b in zip(TRL_FLAGS[::2], TRL_FLAGS[1::2]))
    (tmp_path / "grpo.yaml").write_text(yaml + f"reward:\n  - {own / 'rewards.py'}:says_yes\noutput_dir: {tmp_path / 'yaml'}\n")
    from_file = _run_trl(own, "--config", str(tmp_path / "grpo.yaml"))
    assert _learned(from_file) >= 0.2, from_file.stdout[-2000:]
    assert {k: v for k, v in json.load(open(tmp_path / "yaml" / "config.json")).items() if k != "run_dir"} == \
           {k: v for k, v in saved.items() if k != "run_dir"}, "the file and the command line make the same run"


def test_a_runs_config_json_repeats_it_exactly_and_flags_override_the_file(own, tmp_path):
    """--config RUN_DIR/config.json makes the same run (the same resolved config, the same first-step metrics but
    time and memory: --sync, where a step's batch does not depend on timing); a flag after it overrides the file's."""
    first = _run_trl(own, "--sync", "--reward", f"{own / 'rewards.py'}:says_yes", "--steps", "2", "--lr", "3e-3",
                     "--batch-size", "16", "--responses-per-prompt", "4", "--max-new-tokens", "6", "--run-dir", str(tmp_path / "a" / "run"))
    assert first.returncode == 0, first.stderr[-3000:]
    again = _run_trl(own, "--config", str(tmp_path / "a" / "run" / "config.json"), "--run-dir", str(tmp_path / "b" / "run"))
    assert again.returncode == 0, again.stderr[-3000:]
    config = lambda run: {k: v for k, v in json.load(open(tmp_path / run / "run" / "config.json")).items() if k != "run_dir"}
    assert config("b") == config("a")
    step0 = lambda run: {k: v for k, v in read_metrics(tmp_path / run)[0].items() if k.split("/")[0] not in ("time", "memory")}
    assert step0("b") == step0("a") and "loss/train" in step0("a")
    overridden = _run_trl(own, "--config", str(tmp_path / "a" / "run" / "config.json"), "--run-dir", str(tmp_path / "c"),
                          "--steps", "1", "--dry-run")
    assert overridden.returncode == 0 and re.search(r"^steps += 1$", overridden.stdout, re.M), overridden.stdout[-2000:]


def test_trl_names_with_no_meaning_here_and_unknown_flags_are_one_line():
    from ops.flags import TRL, expand
    from tasks.dataset import DatasetConfig
    for argv, message in [(["--beta", "0.0"], "--beta 0.0: TB's target is pi_ref exp(r / beta): beta must be > 0"),
                          (["--max_prompt_length", "256"], "TRL 1.16 has no max_prompt_length; here: --max-prompt-tokens"),
                          (["--num_train_epochs", "3"], "this trainer counts steps: --max_steps"),
                          (["--top_p", "0.9"], "searchers sample with full support"),
                          (["--learnin_rate", "1e-5"], "unrecognized flag --learnin_rate: did you mean --learning_rate?"),
                          (["--max-new-token", "8"], "unrecognized flag --max-new-token: did you mean --max-new-tokens?")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            expand(DatasetConfig, argv)
    assert expand(DatasetConfig, ["--top_k", "0", "--bf16", "--use_vllm", "--warmup_steps", "3"]) == \
           ["--trainer-dtype", "bf16-mixed", "--backend", "vllm", "--warmup-steps", "3"]
    assert expand(DatasetConfig, ["--gradient_checkpointing", "true", "--share_prompt", "false", "--sync"]) == \
           ["--gradient-checkpointing", "--no-share-prompt", "--sync"], "a bool with a value, as TRL writes it"
    with pytest.raises(ConfigError, match=re.escape("--share_prompt maybe: 'maybe' is not true or false")):
        expand(DatasetConfig, ["--share_prompt", "maybe"])
    trl = pytest.importorskip("trl")
    import dataclasses
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert trl.__version__ == "1.16.0" and set(TRL) - names == {"max_prompt_length"}, "every other name is TRL 1.16's"
    from ops.flags import table
    assert table() in open(os.path.join(ROOT, "docs", "tasks.md")).read(), "docs/tasks.md prints ops/flags.py's table"


def test_argv_of_own_flags_skips_ops_flags_and_means_what_expand_makes_of_it():
    """ops/launch.cli leaves argv to the parser as it is when it holds only this project's flags as --help spells
    them (ops/flags.py is then not imported): exactly the argvs whose expansion parses to the same config."""
    from config import parse_config
    from ops.flags import expand
    from ops.launch import own_flags_only
    from tasks.dataset import PRESETS, DatasetConfig
    argvs = [[], ["--steps", "6", "--no-share-prompt", "--sync", "--lr", "1e-5"], ["--preset", "default", "--eval-every", "0"],
             ["--beta-start", "-1"], ["--steps=6"], ["--warmup_steps", "3"], ["--sync", "true"], ["--beta", "0.1"],
             ["--max-new-token", "8"], ["--config", "x.yaml"], ["--top_k", "0"]]
    plain = [a for a in argvs if own_flags_only(DatasetConfig, a)]
    assert plain == argvs[:3], "only own flags, each bool alone, no --name=value, no negative value"
    for argv in plain:
        assert parse_config(DatasetConfig, PRESETS, argv) == parse_config(DatasetConfig, PRESETS,
                                                                                    expand(DatasetConfig, argv))


def test_a_hub_dataset_with_a_config_trains_on_one_split_and_evaluates_on_another(own, tmp_path, capsys):
    """A local copy of a hub repository laid out as openai/gsm8k's (configurations main and socratic, each with train
    and test splits, declared in its README): --dataset-config picks one, --dataset-split and --eval-split the splits;
    --system-prompt goes before every prompt through the chat template; held-out rows are said at the start."""
    import datasets
    repo = tmp_path / "gsm8k-like"
    for config in ("main", "socratic"):
        for split, n in (("train", 40), ("test", 10)):
            (repo / config).mkdir(parents=True, exist_ok=True)
            rows = [{"prompt": f"{config} {split} question {i}?", "target": "yes"} for i in range(n)]
            datasets.Dataset.from_list(rows).to_parquet(str(repo / config / f"{split}-00000-of-00001.parquet"))
    (repo / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n  - split: test\n    path: {c}/test-*\n"
        for c in ("main", "socratic")) + "---\n")
    cfg = _cfg(own, dataset=str(repo), dataset_config="socratic", eval_dataset="", eval_split="test",
               system_prompt="Answer yes or no.")
    task = make_task(cfg, say=True)
    assert [m["prompt"] for m in task.metas[:1] + task.eval_metas[:1]] == ["socratic train question 0?", "socratic test question 0?"]
    assert (len(task.prompts), len(task.eval_prompts)) == (40, 10) and capsys.readouterr().out == ""
    assert task.prompts[0] == ("<|im_start|>system\nAnswer yes or no.<|im_end|>\n<|im_start|>user\nsocratic train "
                               "question 0?<|im_end|>\n<|im_start|>assistant\n")
    held = make_task(_cfg(own, dataset=str(repo), dataset_config="main", eval_dataset="", eval_holdout=8), say=True)
    assert (len(held.prompts), len(held.eval_prompts)) == (32, 8) and held.prompts[0] == "main train question 0?"
    assert capsys.readouterr().out.strip() == (f"--eval-holdout 8: the last 8 of the 40 rows of --dataset {repo} are "
                                               "held out for evaluation (or: --eval-dataset, --eval-split)")
