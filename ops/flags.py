"""
The command line before it is parsed: `--config FILE` (YAML or JSON), TRL's names for a run (GRPOConfig and its
TrainingArguments, TRL 1.16) mapped onto this project's fields, and an unknown flag answered with the nearest known
one. ops/launch.cli calls `expand` on argv; config.parse_config then parses the project's own flags.

    python tba.py --model M --dataset D --reward R.py:f --learning_rate 1e-5 --per_device_train_batch_size 8 \
        --gradient_accumulation_steps 4 --num_generations 8 --max_completion_length 64 --output_dir out
    python tba.py --config grpo.yaml --max_steps 50      # the file's keys: this project's names or TRL's
    python tba.py --config runs/x/config.json --run-dir runs/y      # repeat a run exactly, elsewhere

The mapping is the table TRL below, written once; `python -m ops.flags` prints it as docs/tasks.md holds it. Flags
on the command line override the file's; a field's name with underscores is its flag too (--warmup_steps). A TRL
name or value with no meaning here is one line saying what to use.
"""

import dataclasses
import difflib
import json
import typing

from config import ConfigError, flag, flag_names


def _bool(value):
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{value!r} is not true or false")


def _only(want, why):
    """A TRL setting this project has as a fixed behaviour: the value that behaviour equals is accepted (it sets
    nothing), any other refused with `why`."""
    def check(value):
        if float(value) != want:
            raise ValueError(why)
        return {}
    return check


def _refuse(why):
    def check(value):
        raise ValueError(why)
    return check


def _beta(value):
    if float(value) <= 0:
        raise ValueError("TB's target is pi_ref exp(r / beta): beta must be > 0 (TRL's default 0.0 turns the KL off; "
                         "the tiny presets use 0.1, the paper's GSM8K 0.014 -> 0.004)")
    return {"beta_start": float(value), "beta_end": float(value)}


def _report_to(value):
    names = value if isinstance(value, list) else [value]
    if len(names) != 1 or names[0] not in ("none", "tensorboard", "wandb"):
        raise ValueError("one of none, tensorboard, wandb")
    return {"report_to": names[0]}


# TRL's name -> (what it is here, for the table; value -> {field: value}, raising ValueError with what to use)
TRL = {
    "learning_rate": ("--lr", lambda v: {"lr": float(v)}),
    "max_steps": ("--steps", lambda v: {"steps": int(v)}),
    "output_dir": ("--run-dir", lambda v: {"run_dir": str(v)}),
    "per_device_train_batch_size": ("--batch-size: per_device_train_batch_size x gradient_accumulation_steps, the "
                                    "completions per step as TRL 1.16 counts them (one trainer process)", None),
    "gradient_accumulation_steps": ("(see per_device_train_batch_size; the trainer accumulates over "
                                    "--micro-batch-prompts prompts)", None),
    "num_generations": ("--responses-per-prompt K and --samples-per-prompt S, both",
                        lambda v: {"responses_per_prompt": int(v), "samples_per_prompt": int(v)}),
    "max_completion_length": ("--max-new-tokens", lambda v: {"max_new_tokens": int(v)}),
    "beta": ("--beta-start and --beta-end (a constant beta); must be > 0", _beta),
    "bf16": ("--trainer-dtype bf16-mixed (false: float32)",
             lambda v: {"trainer_dtype": "bf16-mixed" if _bool(v) else "float32"}),
    "fp16": ("refused: --bf16, or --trainer-dtype float16 (16-bit weights)",
             _refuse("float16 mixed precision is not offered here: --bf16 (bfloat16 compute on float32 weights)")),
    "logging_steps": ("--log-every", lambda v: {"log_every": int(v)}),
    "save_steps": ("--checkpoint-every", lambda v: {"checkpoint_every": int(v)}),
    "eval_steps": ("--eval-every", lambda v: {"eval_every": int(v)}),
    "per_device_eval_batch_size": ("--eval-batch-size", lambda v: {"eval_batch_size": int(v)}),
    "report_to": ("--report-to: none, tensorboard or wandb", _report_to),
    "use_vllm": ("--backend vllm (false: hf)", lambda v: {"backend": "vllm" if _bool(v) else "hf"}),
    "max_grad_norm": ("--grad-clip", lambda v: {"grad_clip": float(v)}),
    "epsilon": ("--clip-eps", lambda v: {"clip_eps": float(v)}),
    "ref_model_sync_steps": ("--ref-reset-every (TBA's reference reset, with sync_ref_model and "
                             "ref_model_mixup_alpha 1)", lambda v: {"ref_reset_every": int(v)}),
    "sync_ref_model": ("(see ref_model_sync_steps)", lambda v: {} if _bool(v) else {"ref_reset_every": 0}),
    "ref_model_mixup_alpha": ("1 only: a reset copies the policy",
                              _only(1.0, "a reference reset here copies the policy: ref_model_mixup_alpha 1")),
    "top_k": ("0 only", _only(0, "searchers sample with full support (top_k 0, top_p 1), as TB's off-policy "
                                 "sampler must")),
    "top_p": ("1 only", _only(1.0, "searchers sample with full support (top_k 0, top_p 1), as TB's off-policy "
                                   "sampler must")),
    "num_train_epochs": ("refused: --max_steps", _refuse("this trainer counts steps: --max_steps (or --steps)")),
    "lr_scheduler_type": ("refused: warmup-stable-decay", _refuse(
        "the learning rate is warmup-stable-decay here: --warmup-steps, --stable-steps, --decay-steps, --lr-decay")),
    "loss_type": ("refused: --objective", _refuse("the loss is --objective here: tb (default) | rloo | grpo | "
                                                   "dr_grpo | online_dpo")),
    "num_iterations": ("refused: --sync-every", _refuse("how stale the data may be is TBA's sync period here: "
                                                         "--sync-every k")),
    "steps_per_generation": ("refused: --sync-every", _refuse("how stale the data may be is TBA's sync period here: "
                                                               "--sync-every k")),
    "max_prompt_length": ("refused (not in TRL 1.16): --max-prompt-tokens",
                          _refuse("TRL 1.16 has no max_prompt_length; here: --max-prompt-tokens")),
}
SAME = ("temperature", "seed", "warmup_steps", "weight_decay", "gradient_checkpointing", "reward_weights",
        "vllm_gpu_memory_utilization")  # TRL's names that are this project's fields too
TRL_BATCH = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}  # (TRL 1.16's defaults)


def expand(config_cls, argv):
    """argv with --config FILE's settings put first and TRL's names turned into this project's flags; raises
    ConfigError (one line) for a TRL name or value with no meaning here and for an unknown flag."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    bools = {name for name in fields if hints[name] is bool}
    argv, settings = take_config(list(argv))
    batch = {k: settings.pop(k) for k in TRL_BATCH if k in settings}  # (TRL's batch: two names, one field)
    out, i = tokens(fields, settings), 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        values = [value] if eq else _values(argv, i + 1)
        i += 1 if eq or not name else 1 + len(values)
        key = name.replace("-", "_")
        negated = key.startswith("no_") and key[3:] in fields  # (--no-share-prompt)
        if not name or key in ("preset", "help") or not (key in fields or key in TRL or negated):
            out += [token] if eq or not name else [token, *values]  # (check_known names what is unknown)
        elif key in TRL_BATCH:
            batch[key] = values[0] if values else ""
        elif key in TRL and key not in fields:
            out += tokens(fields, translate(key, values))
        elif key in bools and values:  # a bool with a value, as TRL writes it: --gradient_checkpointing true
            out += tokens(fields, translate(key, values, lambda v: {key: _bool(v)})) + values[1:]
        else:  # a field, or --no-<field>: its flag, in whichever spelling (--warmup_steps is --warmup-steps)
            out += [flag(key), *values]
    out += tokens(fields, translate_batch(batch)) if batch else []
    check_known(config_cls, out)
    return out


def take_config(argv):
    """argv without --config FILE, and the file's settings ({} without one)."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv, {}
    i = at[-1]
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    if not path:
        raise ConfigError("--config needs a file: a YAML or JSON mapping of names to values")
    return argv[:i] + argv[i + (1 if "=" in argv[i] else 2):], read_config(path)


def _values(argv, start):
    """The values after a flag: every token up to the next --flag."""
    end = start
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[start:end]


def translate(key, values, convert=None):
    """{field: value} for TRL's `key` given `values` (a bool given alone is true); `convert`: TRL's own by default."""
    value = values if key == "report_to" and len(values) > 1 else values[0] if values else True
    try:
        return (convert or TRL[key][1])(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--{key} {' '.join(map(str, values))}: {e}") from None


def translate_batch(batch):
    try:
        sizes = {k: int(batch.get(k, default)) for k, default in TRL_BATCH.items()}
    except ValueError as e:
        raise ConfigError(f"--{next(iter(batch))}: {e}") from None
    return {"batch_size": sizes["per_device_train_batch_size"] * sizes["gradient_accumulation_steps"]}


def read_config(path):
    """The settings of a --config file: YAML (.yaml, .yml) or JSON, one mapping of names to values."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            settings = yaml.safe_load(text)
        else:
            settings = json.loads(text)
    except Exception as e:
        raise ConfigError(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                          f"({str(e).splitlines()[0]})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"--config {path}: expected a mapping of names to values")
    return {**settings, "__file__": path}


def tokens(fields, settings):
    """Command-line tokens for {name: value} (this project's fields, or TRL's names, translated)."""
    path = settings.pop("__file__", None)
    out = []
    for key, value in settings.items():
        if key in TRL and key not in fields:
            out += tokens(fields, translate(key, value if isinstance(value, list) else [value]))
        elif key not in fields:
            near = difflib.get_close_matches(key, list(fields) + list(TRL), n=1)
            raise ConfigError(f"--config {path}: {key} is not a setting{f' (did you mean {near[0]}?)' if near else ''}")
        elif isinstance(value, bool):
            out.append(flag(key) if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag(key), *map(str, value)] if value else []
        else:
            out += [flag(key), "none" if value is None else str(value)]
    return out


def check_known(config_cls, argv):
    """Every --flag is one of this project's (or --preset, --help); else ConfigError with the nearest known name."""
    known, _ = flag_names(config_cls)
    for token in argv:
        name = token.partition("=")[0]
        if token.startswith("--") and name not in known:
            if name[2:].replace("-", "_") in trl_names():
                raise ConfigError(f"{name} is TRL's (GRPOConfig) and has no meaning here; the TRL names that do, and "
                                  f"what each is here: docs/tasks.md, \"TRL's names\"")
            near = difflib.get_close_matches(name, sorted(known) + [f"--{k}" for k in TRL], n=1, cutoff=0.6)
            raise ConfigError(f"unrecognized flag {name}{f': did you mean {near[0]}?' if near else ''} "
                              f"(--help lists every flag; TRL's names: docs/tasks.md)")


def trl_names():
    """Every name of TRL's GRPOConfig where TRL is installed (an error message's wording only), else none."""
    try:
        from trl import GRPOConfig
    except ImportError:
        return set()
    return {f.name for f in dataclasses.fields(GRPOConfig)}


def table():
    """TRL's names and what each is here, as the markdown table docs/tasks.md holds."""
    rows = [f"| `{name}` | {meaning} |" for name, (meaning, _) in TRL.items()]
    rows += [f"| `{name}` | `{flag(name)}` (the same name) |" for name in SAME]
    return "\n".join(["| TRL (GRPOConfig, TRL 1.16) | here |", "|---|---|", *rows])


if __name__ == "__main__":
    print(table())
