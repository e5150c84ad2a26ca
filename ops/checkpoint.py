"""
Run directories and checkpoints: a run directory belongs to one run at a time, and a run can always be
resumed from what it last saved.

The run directory (`prepare_run_dir`, called before anything is loaded or spawned):
  - `--resume DIR` continues the run in DIR (it implies `--run-dir DIR`);
  - a lock (run_dir/.lock, flock, released when the process exits, however it exits) refuses a second
    run on the same directory, naming the holder's pid;
  - a directory that holds an earlier run is refused unless `--resume` or `--overwrite` is given;
  - a resume compares the new config with the one saved in the checkpoint: a changed field that changes
    what the run is (model, objective, batch shape, buffer, --sync, ...) is refused with a one-line diff
    unless `--allow-config-change`; harmless ones (`HARMLESS`: steps, logging, threads, ...) are printed.

A checkpoint is a directory run_dir/checkpoints/step-NNNNNN/:
    policy/, ref/        save_pretrained (safetensors) of the policy (with --lora-rank: its adapters) and the reference
    optimizer.pt         the AdamW state dict: tensors and numbers only, loaded with weights_only=True
    rng.pt               torch (and CUDA) RNG states, loaded with weights_only=True
    buffer.json          the replay buffer: every trajectory, the latest round, its sampler's RNG state
    state.json           step, reference version, counters, the searchers' own state, the config, saved_at
It is written under a temporary name and renamed into place; then run_dir/checkpoints/latest (a one-line
file naming it) is replaced atomically, and all but the `keep` most recently written checkpoints are
removed (by when they were written, not by step number: a run resumed with fewer --steps writes a lower
step number last). A crash at any moment leaves the previous checkpoint intact and `latest` pointing at a
complete one. If the newest checkpoint cannot be read, resuming names the broken file and falls back to
the one before it.

What resuming reproduces: in --sync mode with a fixed seed, a resumed run takes exactly the same steps as an
uninterrupted one (same weights to float rounding; the tests check 1e-6). With searcher processes, the
trainer, optimiser, schedules and buffer are restored exactly, but the searchers restart with fresh
random streams and whatever timing the machine gives them, so the data they produce afterwards differs.

Run: python run_gsm8k.py --checkpoint-every 50, then the same command with --resume runs/gsm8k-tiny.
"""

import errno
import fcntl
import json
import os
import shutil
import time

from config import ConfigError, RunError, flag

RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "result.json", "checkpoints", "final", "evals",
             "tensorboard", "wandb")  # what a run writes
# config fields a resumed run may change without changing what the run is (printed when they change)
HARMLESS = {"run_dir", "resume", "overwrite", "allow_config_change", "auto_resume", "dry_run", "plan_for", "steps", "checkpoint_every",
            "keep_checkpoints", "eval_every", "eval_size", "eval_batch_size", "log_every", "trainer_threads",
            "searcher_threads", "num_searchers", "device", "searcher_device", "queue_size", "on_searcher_failure",
            "max_searcher_restarts", "searcher_timeout", "max_nonfinite_steps", "cache_dir", "data_dir",
            "vllm_gpu_memory_utilization", "vllm_kv_cache_gb", "report_to", "gradient_checkpointing"}
_lock = None  # the open lock file of this process's run directory


# -----------------------------------------------------------------------------
# The run directory belongs to one run at a time

def prepare_run_dir(cfg, run_dir_given):
    """Claim cfg.run_dir for this run, before anything is loaded: --resume DIR implies --run-dir DIR; the
    directory must be writable and not in use by another run (a lock held until this process exits); a
    directory holding an earlier run needs --resume or --overwrite; a resume must keep the run's meaning."""
    global _lock
    if cfg.resume or cfg.auto_resume:
        resume_in_place(cfg, run_dir_given)
    lock_path = os.path.join(cfg.run_dir, ".lock")
    made = [p for p in (cfg.run_dir, lock_path) if not os.path.exists(p)]  # removed again if the run is refused
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        _lock = open(lock_path, "a+")
    except OSError as e:
        raise ConfigError(f"--run-dir {cfg.run_dir} is not writable ({e.strerror})") from None
    try:
        fcntl.flock(_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _lock.seek(0)
        holder = _lock.read().strip() or "?"
        release_run_dir()
        raise ConfigError(f"--run-dir {cfg.run_dir} is in use by another run (pid {holder})") from None
    used = [n for n in RUN_FILES if os.path.exists(os.path.join(cfg.run_dir, n))]
    try:
        if cfg.resume:
            check_resume(cfg)
        elif used and not cfg.overwrite and not trained_nothing(cfg.run_dir):
            raise ConfigError(f"--run-dir {cfg.run_dir} holds an earlier run ({', '.join(used)}); "
                              f"continue it with --resume {cfg.run_dir}, or pass --overwrite to replace it")
        elif used and not cfg.overwrite:
            print(f"--run-dir {cfg.run_dir}: an earlier start ended before its first step ({', '.join(used)}); "
                  f"starting afresh there")
    except ConfigError:  # a refused run writes nothing: the lock file keeps the pid of the run that wrote it
        release_run_dir()
        for path in reversed(made):
            os.rmdir(path) if os.path.isdir(path) else os.remove(path)
        raise
    _lock.truncate(0)
    _lock.write(f"{os.getpid()}\n")
    _lock.flush()
    if used and not cfg.resume:
        for name in used:
            path = os.path.join(cfg.run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    remove_leftovers(cfg.run_dir)  # (this run holds the lock: no one else is writing them)


def resume_in_place(cfg, run_dir_given):
    """--resume DIR (or --auto-resume finding a checkpoint) continues the run in DIR: --run-dir becomes DIR."""
    if cfg.auto_resume and not cfg.resume:
        auto_resume(cfg)
    if cfg.resume:
        if run_dir_given and os.path.abspath(cfg.run_dir) != os.path.abspath(cfg.resume):
            raise ConfigError(f"--resume {cfg.resume} continues that run in its own directory; drop --run-dir {cfg.run_dir}")
        cfg.run_dir = cfg.resume


def trained_nothing(run_dir):
    """Whether what run_dir holds was written by a start that ended before it trained a step (a reward that raised
    at its first call, a model that would not load, ...): no checkpoint, no result, and no step in metrics.jsonl.
    The same command then starts afresh there rather than asking for --overwrite."""
    if any(os.path.exists(os.path.join(run_dir, n)) for n in ("checkpoints", "final", "result.json")):
        return False
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return not any('"loss/train"' in line for line in f)
    except FileNotFoundError:
        return True


def release_run_dir():
    """Give up this process's claim on its run directory (exiting does it too)."""
    global _lock
    if _lock is not None:
        _lock.close()
        _lock = None


def auto_resume(cfg):
    """--auto-resume: a run directory with a checkpoint is resumed (as --resume would); one that holds only
    what an attempt wrote before its first checkpoint is started afresh (as --overwrite would)."""
    if checkpoints_newest_first(cfg.run_dir):
        print(f"--auto-resume: {cfg.run_dir} has a checkpoint; resuming it")
        cfg.resume = cfg.run_dir
    elif any(os.path.exists(os.path.join(cfg.run_dir, n)) for n in RUN_FILES):
        print(f"--auto-resume: {cfg.run_dir} has no checkpoint; starting the run afresh there")
        cfg.overwrite = True


def check_resume(cfg):
    """The checkpoint to resume exists, and the config differs from the saved one only in harmless fields."""
    found = checkpoints_newest_first(cfg.resume)
    if not found:
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint there (expected {cfg.resume}/checkpoints/step-*/)")
    saved, new = read_state(found[0]).get("config", {}), vars(cfg)
    bookkeeping = {"run_dir", "resume", "overwrite", "allow_config_change", "dry_run"}
    changed = [k for k in new if k in saved and saved[k] != new[k] and k not in bookkeeping
               and not (k == "model" and not new[k])  # (an empty --model: the tiny preset derives it)
               and new[k] != "auto"]  # (an "auto" device, dtype or backend: what it resolved to was saved)
    meaningful = [k for k in changed if k not in HARMLESS]
    if meaningful and not cfg.allow_config_change:
        was = " ".join(f"{flag(k)} {saved[k]}" for k in meaningful)
        now = " ".join(f"{flag(k)} {new[k]}" for k in meaningful)
        raise ConfigError(f"--resume {cfg.resume}: the run was saved with {was}, now {now}; "
                          f"pass --allow-config-change to continue anyway")
    if changed:
        print("resume: changed since the checkpoint: " + ", ".join(f"{flag(k)} {saved[k]} -> {new[k]}" for k in changed))


# -----------------------------------------------------------------------------
# Checkpoints

def save_checkpoint(run_dir, step, policy, ref, opt, buffer, state, keep=2):
    """Write the checkpoint taken before trainer step `step`; returns its path. One that cannot be written (a full
    disk: checked first, against its size) is a WriteError naming it, with nothing of it left behind."""
    import torch
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:06d}")
    tmp = final + f".tmp{os.getpid()}"
    records = {"buffer.json": json.dumps(buffer.state_dict()), "state.json": json.dumps({"step": step, **state,
                                                                                       "saved_at": time.time()})}
    needed = sum(map(tensor_bytes, (policy.state_dict(), ref.state_dict(), opt.state_dict()))) + sum(map(len, records.values()))
    try:
        os.makedirs(root, exist_ok=True)
        if shutil.disk_usage(root).free < needed:  # (nothing is written when it cannot all be; write_error words it)
            raise OSError(errno.ENOSPC, "No space left on device")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        policy.save_pretrained(os.path.join(tmp, "policy"))
        ref.save_pretrained(os.path.join(tmp, "ref"))
        torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
        rng = {"torch": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}
        torch.save(rng, os.path.join(tmp, "rng.pt"))
        for name, text in records.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        respect_umask(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomic(os.path.join(root, "latest"), os.path.basename(final))
    except BaseException as e:  # (a second stop signal too): nothing half-written stays, the last checkpoint does
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):  # (a stop, a BaseException, is a stop, not a failed write)
            raise write_error(final, e, needed) from None
        raise
    for old in checkpoints_newest_first(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class WriteError(RunError):
    """A file of the run could not be written (a full disk, a read-only directory, ...): one line, naming it."""


def tensor_bytes(state):
    """Bytes of the tensors in a (nested) state dict."""
    if hasattr(state, "element_size"):
        return state.numel() * state.element_size()
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in values)


def write_error(path, e, needed=None):
    """The WriteError of a failed write of `path`: a full disk (however the writer words it: OSError 28, safetensors'
    'os error 28', torch's 'unexpected pos') is said as such, with the space needed and free; else the error."""
    if isinstance(e, WriteError):
        return e
    folder = next(p for p in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))) if os.path.exists(p))
    free, text = shutil.disk_usage(folder).free, str(e)
    if getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in text or "No space left" in text or \
            (needed is not None and free < needed):
        space = f"{mb(needed)} needed, {mb(free)} free" if needed is not None else f"{mb(free)} free"
        return WriteError(f"cannot write {path}: no space left on the device ({space})")
    reason = getattr(e, "strerror", None) or (text.strip().splitlines() or [type(e).__name__])[0]
    return WriteError(f"cannot write {path}: {reason}"[:500])


def mb(n):
    return f"{n / 1e6:.1f} MB"


def remove_leftovers(run_dir):
    """What a crashed write left: checkpoint directories and files under a temporary name (*.tmpPID)."""
    for folder in (run_dir, os.path.join(run_dir, "checkpoints")):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if ".tmp" in name:
                path = os.path.join(folder, name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def checkpoints_newest_first(run_dir):
    """Complete checkpoints of a run directory, the most recently written first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    paths = [os.path.join(root, n) for n in os.listdir(root) if n.startswith("step-") and ".tmp" not in n]
    return sorted((p for p in paths if os.path.isfile(os.path.join(p, "state.json"))), key=_saved_at, reverse=True)


def _saved_at(path):
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f).get("saved_at", 0.0)
    except (OSError, ValueError):
        return 0.0  # unreadable: oldest


# names a checkpoint written before the query -> prompt rename (2026-12-06) uses, and what they are now
RENAMED = {"query_id": "prompt_id", "responses_per_query": "responses_per_prompt",
           "capacity_per_query": "capacity_per_prompt", "micro_batch_queries": "micro_batch_prompts"}


def renamed(record):
    """A record (a Trajectory's, a config's) with the names of before the rename made today's."""
    return {RENAMED.get(k, k): v for k, v in record.items()}


def read_state(path):
    """The state.json of a checkpoint (step, counters, the config it was saved with, in today's names)."""
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    return {**state, "config": renamed(state["config"])} if "config" in state else state


def load_checkpoint(path, policy, ref, opt, buffer):
    """Restore weights, optimiser, RNG and buffer in place; returns the contents of state.json.
    Raises CheckpointError naming the file that could not be read."""
    import torch
    from safetensors.torch import load_file
    current = path
    try:
        for model, name in ((policy, "policy"), (ref, "ref")):
            lora = hasattr(model, "peft_config")  # a LoRA policy saves its adapters alone
            current = os.path.join(path, name, "adapter_model.safetensors" if lora else "model.safetensors")
            tensors = load_file(current, device=str(next(model.parameters()).device))
            if lora:
                from peft import set_peft_model_state_dict
                missing, unexpected = [], set_peft_model_state_dict(model, tensors).unexpected_keys
            else:
                missing, unexpected = model.load_state_dict(tensors, strict=False)
            if unexpected or any(not _is_tied(model, k) for k in missing):
                raise ValueError(f"does not match the model (missing {missing}, unexpected {unexpected})")
        current = os.path.join(path, "optimizer.pt")  # (onto the device the policy is on now, whatever it was saved from)
        opt.load_state_dict(torch.load(current, weights_only=True, map_location=next(policy.parameters()).device))
        current = os.path.join(path, "rng.pt")
        rng = torch.load(current, weights_only=True, map_location="cpu")
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        current = os.path.join(path, "buffer.json")
        with open(current) as f:
            saved = json.load(f)
        buffer.load_state_dict({**saved, "items": [renamed(r) for r in saved["items"]]})
        current = os.path.join(path, "state.json")
        return read_state(path)
    except Exception as e:  # any unreadable or inconsistent file: name it, one line
        raise CheckpointError(f"{current}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]) from None


class CheckpointError(ValueError):
    pass


def _is_tied(model, key):
    """save_pretrained drops tied weights (e.g. lm_head.weight = embed_tokens.weight)."""
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def respect_umask(folder):
    """Give every file under `folder` the mode a plain open() would (0666 minus the umask): some writers
    create files 0600 through a temporary file."""
    umask = os.umask(0)
    os.umask(umask)
    for parent, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(parent, name), 0o666 & ~umask)


def write_text_atomic(path, text):
    """Write a file under a temporary name and rename it into place: a crash leaves the old one or the new one."""
    tmp = path + f".tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise write_error(path, e) from None
