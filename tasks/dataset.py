"""
Your own model, data and reward as a Task: what `python tba.py` trains.

    python tba.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset prompts.jsonl --reward my_reward.py:says_yes

  --dataset / --eval-dataset   a .jsonl, .json, .csv or .parquet file, a `save_to_disk` directory, a hub id (when
                               online; --dataset-config its configuration) or a local copy of a hub repository,
                               read with Hugging Face `datasets`; --eval-split evaluates on another split (of
                               --dataset without --eval-dataset); with neither, the last --eval-holdout rows of
                               --dataset are held out (said at the start)
  --system-prompt              a system message before every prompt, through the chat template
  --prompt-column              a string, or a list of chat messages [{"role": ..., "content": ...}]; messages
                               go through the tokenizer's chat template (the generation prompt added, never a
                               second BOS)
  --reward FILE.py:NAME        (or module:NAME) a reward function called as TRL 1.16's GRPOTrainer calls it, so
                               one written for it works unchanged:
                                   fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=,
                                      log_metric=, **columns) -> list[float | None]
                               prompts as the dataset holds them; completions as strings for text prompts and
                               as [{"role": "assistant", "content": ...}] for chat prompts; completion_ids the
                               generated token ids (no prompt); trainer_state.global_step the trainer step whose
                               weights generated them; log_extra(column, values) adds a column to samples.jsonl
                               (an evaluation's), log_metric(name, value) a metric to metrics.jsonl (reward/NAME
                               in training, eval/NAME in an evaluation); columns the dataset's others, as lists.
                               `async def` rewards are awaited, together. It runs batched in the searcher
                               processes (and in the trainer for evaluation).
  --reward A --reward B        several rewards, summed with --reward-weights (default 1.0 each); as TRL, a None
                               is NaN and left out of the sum, and a completion every reward scored None is
                               skipped with a warning: out of its group's baseline, the logged mean and the loss.

The evaluation is the mean reward of greedy completions of the held-out prompts; the run's closing line is
`reward: before X -> after Y`. A reward whose signature cannot take what it is passed is refused before anything
starts (exit 2, naming the function and the parameter); one that raises, returns the wrong number of values, a
NaN, an infinity or a non-number stops the run with a line naming --reward and what it returned.

Run: python tba.py --help
"""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import threading
from dataclasses import dataclass

from config import Config, ConfigError, RunError, knob
from rewards import Task, greedy_evaluation

DEFAULTS = dict(  # one machine, a small model; every field is printed in the resolved config
    run_dir="runs/own", steps=200, batch_size=64, responses_per_prompt=8, samples_per_prompt=8, micro_batch_prompts=8,
    micro_batch=64, prompts_per_search=8, max_new_tokens=128, temperature=1.0, lr=1e-5, warmup_steps=10,
    stable_steps=150, decay_steps=40, lr_decay="linear", lr_floor=0.1, beta_start=0.05, beta_end=0.05,
    beta_decay_steps=0, sync_every=2, initial_completions=64, m=0.95, capacity_per_prompt=64, eval_every=50,
    eval_size=64, eval_batch_size=64, log_every=10, checkpoint_every=100, num_searchers=1,
    tb_correction="trust-region")  # TB with a trust region, ours: the paper's plain TB is --tb-correction none (README)
PRESETS = {"default": DEFAULTS}


@dataclass
class DatasetConfig(Config):
    dataset: str = knob("", "training prompts: a .jsonl/.json/.csv/.parquet file, a save_to_disk directory, or a hub id")
    eval_dataset: str = knob("", "held-out prompts, as --dataset (empty: the last --eval-holdout rows of --dataset)")
    eval_holdout: int = knob(64, "rows of --dataset held out for evaluation when there is neither --eval-dataset nor "
                                 "--eval-split")
    dataset_config: str = knob("", "the configuration of a hub dataset (or of a local copy of its repository): "
                                   "openai/gsm8k's main or socratic, say")
    dataset_split: str = knob("train", "the split to read from a hub dataset or a DatasetDict directory")
    eval_split: str = knob("", "the split of --eval-dataset, or without it the split of --dataset to evaluate on "
                               "(test, say); empty: --eval-dataset's --dataset-split, or the --eval-holdout rows")
    prompt_column: str = knob("prompt", "the column holding each prompt: a string, or a list of chat messages")
    system_prompt: str = knob("", "a system message put before every prompt (a text prompt becomes the user's "
                                  "message), through the model's chat template; the reward sees the dataset's prompt")
    reward: list[str] = knob([], "the reward, FILE.py:NAME or module:NAME, called as TRL's GRPOTrainer calls its "
                                 "reward functions (async def too); give it again for several")
    reward_weights: list[float] = knob([], "the rewards' weights in their sum, one per --reward (default: 1.0 each)")

    def check_inputs(self):
        """Everything make_task will read, read now (before anything starts): the flags, the reward, the rows."""
        make_task(self, say=True)


class RewardError(RunError):
    """The user's reward function failed or returned something that is not one finite number per completion."""


def make_task(cfg, say=False):
    """The DatasetTask of --dataset, --eval-dataset and --reward; every problem is one line naming its flag. say: print
    what is held out for evaluation (once, at the checks before the run)."""
    for name in ("model", "dataset", "reward"):
        if not getattr(cfg, name):
            raise ConfigError(f"--{name} is required (python tba.py --model M --dataset D --reward FILE.py:NAME)")
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward):
        raise ConfigError(f"--reward-weights: {len(cfg.reward_weights)} weights for {len(cfg.reward)} rewards")
    rows = list(read_rows(cfg.dataset, cfg.dataset_config, cfg.dataset_split, "dataset", cfg.prompt_column))
    for spec in cfg.reward:  # a missing file or function, or a signature that cannot take TRL's arguments: now
        check_signature(spec, load_reward(spec), [c for c in rows[0] if c != cfg.prompt_column])
    if cfg.eval_dataset or cfg.eval_split:
        eval_rows = read_rows(cfg.eval_dataset or cfg.dataset, cfg.dataset_config, cfg.eval_split or cfg.dataset_split,
                              "eval_dataset" if cfg.eval_dataset else "dataset", cfg.prompt_column)
    elif cfg.eval_holdout < len(rows):
        rows, eval_rows = rows[:-cfg.eval_holdout], rows[-cfg.eval_holdout:]
        if say:
            print(f"--eval-holdout {cfg.eval_holdout}: the last {cfg.eval_holdout} of the {len(rows) + cfg.eval_holdout} "
                  f"rows of --dataset {cfg.dataset} are held out for evaluation (or: --eval-dataset, --eval-split)")
    else:
        raise ConfigError(f"--eval-holdout {cfg.eval_holdout} leaves no training rows of the {len(rows)} in "
                          f"--dataset {cfg.dataset}; give --eval-dataset, --eval-split or a smaller --eval-holdout")
    chat = [is_chat(r[cfg.prompt_column], cfg.prompt_column) for r in rows + eval_rows]
    if len(set(chat)) > 1:
        raise ConfigError(f"--prompt-column {cfg.prompt_column}: some prompts are chat messages and some are text")
    render = chat_renderer(cfg) if chat[0] or cfg.system_prompt else (lambda prompt: prompt)
    return DatasetTask([render(r[cfg.prompt_column]) for r in rows], rows,
                       [render(r[cfg.prompt_column]) for r in eval_rows], eval_rows,
                       reward=cfg.reward, reward_weights=cfg.reward_weights or [1.0] * len(cfg.reward),
                       prompt_column=cfg.prompt_column, chat=chat[0], steps=cfg.steps)


@dataclass
class DatasetTask(Task):
    """Prompts from a dataset (a meta is its whole row), scored by TRL-style reward functions; the evaluation is
    the mean reward of greedy completions."""
    reward: list = None  # FILE.py:NAME or module:NAME, each
    reward_weights: list = None  # one per reward
    prompt_column: str = "prompt"
    chat: bool = False  # the prompts are chat messages (rendered by the chat template)
    steps: int = 0  # the run's trainer steps (trainer_state.max_steps)
    name = "dataset"
    headline = "reward"
    percent = False

    def make_scorer(self, device="cpu"):
        return RewardScorer(self.reward, self.reward_weights, self.prompt_column, self.chat, self.steps)

    def evaluate(self, policy, n):
        if getattr(self, "_scorer", None) is None:
            self._scorer = self.make_scorer()  # (never pickled: attributes starting with _ stay here)
        return greedy_evaluation(policy, self.eval_prompts[:n], self.eval_metas[:n], self._scorer, "reward")


@dataclass
class TrainerState:
    """What TRL passes a reward as `trainer_state`, as far as a searcher knows it."""
    global_step: int  # the trainer step whose weights generated the completions
    max_steps: int


class RewardScorer:
    """The user's reward functions behind the Task scorer interface, called as TRL calls them, their output checked
    and summed with their weights; NaN for a completion that every function scored None."""

    def __init__(self, specs, weights, prompt_column, chat, steps):
        self.specs, self.fns, self.weights = specs, [load_reward(s) for s in specs], weights
        self.prompt_column, self.chat, self.steps = prompt_column, chat, steps

    def __call__(self, prompts, completions, metas, completion_ids=None, step=0, log=None):
        log = {"metrics": {}, "extra": {}} if log is None else log
        texts = [[{"role": "assistant", "content": c}] for c in completions] if self.chat else list(completions)
        kwargs = dict(prompts=[m[self.prompt_column] for m in metas], completions=texts,
                      completion_ids=completion_ids or [[] for _ in completions],
                      trainer_state=TrainerState(step, self.steps),
                      log_extra=lambda column, values: log["extra"].setdefault(column, []).extend(values),
                      log_metric=lambda name, value: log["metrics"].setdefault(name, []).append(value),
                      **{k: [m[k] for m in metas] for k in metas[0] if k != self.prompt_column})
        rows = [[w * v for w, v in zip(self.weights, values) if not math.isnan(v)] for values in zip(*self._call_all(kwargs))]
        return [math.fsum(row) if row else math.nan for row in rows]  # (TRL: nansum; every one None: unscored)

    def _call_all(self, kwargs):
        """Each function's checked output (None as NaN): the sync ones in turn, the async ones awaited together; an
        exception is a RewardError naming the reward."""
        async def call(i):
            try:
                out = self.fns[i](**kwargs)
                out = await out if inspect.isawaitable(out) else out
            except Exception as e:
                raise RewardError(f"--reward {self.specs[i]} raised {type(e).__name__}: {e}") from e
            return self._checked(self.specs[i], out, len(kwargs["completions"]))

        async def together():
            return await asyncio.gather(*(call(i) for i in range(len(self.fns))))
        if not any(inspect.iscoroutinefunction(fn) for fn in self.fns):
            return asyncio.run(together())  # (nothing to await: no loop kept)
        return asyncio.run_coroutine_threadsafe(together(), self._event_loop()).result()

    def _event_loop(self):
        """An event loop of the scorer's own, on a thread of its own, made on first use: the async rewards are
        awaited there, so that a caller inside a running loop (a notebook) can score too (asyncio.run cannot)."""
        if getattr(self, "_loop", None) is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="rewards-event-loop", daemon=True).start()
        return self._loop

    @staticmethod
    def _checked(spec, out, n):
        """A reward's output as n floats (None as NaN); anything but one finite number or None each: a RewardError."""
        ok = (isinstance(out, (list, tuple)) or hasattr(out, "tolist")) and len(out) == n
        values = list(out.tolist() if hasattr(out, "tolist") else out) if ok else []
        bad = [v for v in values if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v))]
        if not ok or bad:
            what = f"{len(out)} values" if ok or isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise RewardError(f"--reward {spec} returned {what}{f' with {bad[0]!r}' if bad else ''} for {n} "
                              f"completions; expected a list of {n} finite numbers (or None)")
        return [math.nan if v is None else float(v) for v in values]


TRL_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_signature(spec, fn, columns):
    """A reward must take every keyword argument it is passed (TRL_KWARGS and the dataset's other columns) and need
    no other: else a ConfigError naming the function and the parameter."""
    params = inspect.signature(fn).parameters
    passed = TRL_KWARGS + tuple(columns)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name in passed:
            if name not in params or params[name].kind is inspect.Parameter.POSITIONAL_ONLY:
                raise ConfigError(f"--reward {spec}: {fn.__name__}() takes no keyword argument '{name}', which every "
                                  f"reward is passed (TRL's reward interface: give it **kwargs)")
    for name, p in params.items():
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in passed:
            raise ConfigError(f"--reward {spec}: {fn.__name__}() needs '{name}', which no reward is passed (they are "
                              f"{', '.join(TRL_KWARGS)} and the columns of --dataset)")


def load_reward(spec):
    """The function named by FILE.py:NAME or module:NAME; a ConfigError naming --reward if it cannot be had."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"--reward {spec}: expected FILE.py:NAME or module:NAME")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ConfigError(f"--reward {spec}: no such file {where}")
            module_spec = importlib.util.spec_from_file_location(f"reward_{os.path.basename(where)[:-3]}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--reward {spec}: importing {where} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"--reward {spec}: {where} has no {name}")
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


@functools.lru_cache(maxsize=4)  # check_inputs reads them before anything starts, make_task again after
def read_rows(path, config, split, flag, prompt_column):
    """The rows of a dataset (a list of dicts) through Hugging Face `datasets`, checked: some rows, the prompt column.
    `path`: a data file, a save_to_disk directory, a hub id or a local copy of a hub repository (`config`: which of
    its configurations)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--{flag.replace('_', '-')} needs the `datasets` library: pip install datasets==5.2.0 "
                          f"(the version requirements.txt pins)") from None
    datasets.disable_progress_bars()
    kinds = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    kind = kinds.get(os.path.splitext(path)[1])
    try:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            data = datasets.load_from_disk(path)  # (save_to_disk's)
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        elif os.path.isdir(path):  # (a repository's files: its README's configurations, or its data files)
            data = datasets.load_dataset(path, config or None, split=split)
        elif kind and os.path.isfile(path):
            data = datasets.load_dataset(kind, data_files=path, split="train")
        elif os.path.exists(path) or kind or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path):
            raise ConfigError(f"--{flag.replace('_', '-')} {path}: no such file, or not .jsonl, .json, .csv or .parquet")
        else:
            data = datasets.load_dataset(path, config or None, split=split)
    except ConfigError:
        raise
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"--{flag.replace('_', '-')} {path}: {type(e).__name__}: {message}"[:500]) from None
    rows = [dict(r) for r in data]
    if not rows:
        raise ConfigError(f"--{flag.replace('_', '-')} {path}: no rows")
    if prompt_column not in rows[0]:
        raise ConfigError(f"--prompt-column {prompt_column}: not a column of {path} (its columns: {', '.join(rows[0])})")
    return rows


def is_chat(prompt, column):
    """True for a list of chat messages, False for a string; anything else is refused."""
    if isinstance(prompt, str):
        return False
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        return True
    raise ConfigError(f"--prompt-column {column}: a prompt must be a string or a list of "
                      f"{{'role': ..., 'content': ...}} messages, not {str(prompt)[:80]!r}")


def chat_renderer(cfg):
    """Chat messages (or a text prompt, the user's message) -> the prompt text of the model's chat template, after
    --system-prompt's message (unless the messages have one), the assistant's turn opened."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {cfg.model}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    if not tokenizer.chat_template:
        raise ConfigError(f"--model {cfg.model}: its tokenizer has no chat template, and the prompts are chat messages")
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []

    def render(prompt):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = messages if messages[0]["role"] == "system" else system + messages
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return render
