"""
Which device each process uses: the 'auto' fields resolved from the GPUs this machine shows, the plan printed
by --dry-run, the device flags checked before anything starts, and the GPU mask a vLLM searcher needs.

Operations, not the algorithm: ops/launch.py and searcher.searcher_loop call it.
"""

import dataclasses
import importlib.util
import os
import re

from config import ConfigError, check, print_config


def resolve_devices(cfg, num_gpus, vllm_installed=False):
    """Fill in the 'auto' fields in place (searchers, devices, dtypes, backend), given how many GPUs are visible."""
    if cfg.num_searchers == 0:  # one per GPU after the trainer's, at least one (or one per device listed)
        listed = cfg.searcher_device.split(",")
        cfg.num_searchers = len(listed) if len(listed) > 1 else max(1, num_gpus - 1)
    if cfg.device == "auto":
        cfg.device = "cuda:0" if num_gpus else "cpu"
    if cfg.searcher_device == "auto":
        n = 1 if cfg.sync else cfg.num_searchers
        cfg.searcher_device = ",".join(f"cuda:{(1 + i) % num_gpus}" for i in range(n)) if num_gpus else "cpu"
    if cfg.trainer_dtype == "auto":  # float32 weights and AdamW state, bfloat16 compute: an update of lr 1e-5 is
        cfg.trainer_dtype = "bf16-mixed" if cfg.device.startswith("cuda") else "float32"  # not rounded away
    if cfg.searcher_dtype == "auto":
        on_gpu = all(d.startswith("cuda") for d in cfg.searcher_devices)
        cfg.searcher_dtype = "bfloat16" if on_gpu and not cfg.sync else "float32"
    if cfg.backend == "auto":
        on_gpu = all(d.startswith("cuda") for d in cfg.searcher_devices)
        cfg.backend = "vllm" if on_gpu and vllm_installed else "hf"
    return cfg


def device_plan(cfg):
    """One line per process: what runs where."""
    lines = [f"trainer     : {cfg.device} ({precision(cfg.trainer_dtype)}, {cfg.trainer_threads} threads)"]
    if cfg.sync:
        return lines + ["searchers   : none (--sync: the trainer generates its own on-policy batches)"]
    for rank, device in enumerate(cfg.searcher_devices):
        memory = (f"kv cache {cfg.vllm_kv_cache_gb} GiB" if cfg.vllm_kv_cache_gb else "kv cache for one search batch"
                  if device == "cpu" else f"gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}")
        backend = f"vllm, {memory}" if cfg.backend == "vllm" else "hf generate"
        lines.append(f"searcher-{rank:<2d} : {device} ({cfg.searcher_dtype}, {backend}, {cfg.searcher_threads} threads)")
    return lines


def precision(dtype):
    """How the trainer holds and computes, in words."""
    return {"bf16-mixed": "float32 weights and AdamW state, bfloat16 compute", "float32": "float32"}.get(
        dtype, f"{dtype} weights and AdamW state: pure 16-bit training")


def check_devices(cfg):
    """Every device flag names cpu, auto or a visible CUDA device."""
    for name in ("device", "searcher_device"):
        for device in getattr(cfg, name).split(","):
            check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", device), name, f"{device}: expected auto, cpu or cuda:N")
            if device.startswith("cuda"):
                import torch
                n = torch.cuda.device_count()
                index = int(device.split(":")[1]) if ":" in device else 0
                check(index < n, name, f"{device}: {n} CUDA device(s) visible")


def resolve_and_plan(cfg, num_gpus, gpu_bytes, vllm_installed, where):
    """resolve_devices, then the memory plan of the result on `num_gpus` GPUs of `gpu_bytes` each (ops/memory.py):
    its lines, or ConfigError in one line when it does not fit, naming a flag that would (`where`: the machine)."""
    from ops.memory import plan, remedy
    unresolved = dataclasses.replace(cfg)
    resolve = lambda c: resolve_devices(c, num_gpus, vllm_installed)
    resolve(cfg)
    if not num_gpus:
        return []
    lines, problems = plan(cfg, gpu_bytes)
    if problems:
        fix = remedy(unresolved, gpu_bytes, resolve)
        raise ConfigError(f"{where}: {problems[0]}; {f'{fix} would make it fit' if fix else 'no single flag makes it fit'}")
    return lines


def visible_gpu_bytes():
    """The memory of the smallest visible GPU (0 without one)."""
    import torch
    return min((torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())), default=0)


def dry_run(cfg):
    """Print the resolved config, the process-to-device plan and the memory plan, for the visible GPUs or the
    machine of --plan-for (and the 4-GPU device plan when no GPU is visible nor stated)."""
    import torch
    from ops.memory import parse_plan_for
    unresolved = dataclasses.replace(cfg)
    if cfg.plan_for:  # (a GPU machine is taken to have vLLM)
        num_gpus, gpu_bytes = parse_plan_for(cfg.plan_for)
        memory = resolve_and_plan(cfg, num_gpus, gpu_bytes, cfg.backend != "hf", f"--plan-for {cfg.plan_for}")
    else:
        num_gpus, gpu_bytes = torch.cuda.device_count(), visible_gpu_bytes()
        memory = resolve_and_plan(cfg, num_gpus, gpu_bytes, importlib.util.find_spec("vllm") is not None,
                                  "the visible GPUs")
    print_config(cfg)
    print("\n".join(["", "process-to-device plan:", *device_plan(cfg)]))
    if memory:
        print("\n".join(["", f"memory plan (estimates; GPUs of {gpu_bytes / (1 << 30):.0f} GiB):", *memory]))
    if not cfg.device.startswith("cuda") and unresolved.device == "auto" and not cfg.plan_for:
        four = resolve_devices(dataclasses.replace(unresolved), num_gpus=4, vllm_installed=unresolved.backend != "hf")
        print("\n".join(["", "no CUDA device is visible; with 4 GPUs (and vLLM installed) the plan would be:",
                         *device_plan(four)]))
    return 0


def torchrun_rank():
    """This process's rank when torchrun started it (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else None."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return int(os.environ["RANK"]) if all(n in os.environ for n in names) else None


def claim_gpu(cfg, device):
    """A searcher's device, masked for vLLM: vLLM's engine takes the first visible GPU, so a vLLM searcher on
    cuda:N hides every other GPU (before CUDA starts in its process) and then uses cuda:0."""
    if cfg.backend != "vllm" or not device.startswith("cuda"):
        return device
    index = int(device.split(":")[1]) if ":" in device else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = physical_device(os.environ.get("CUDA_VISIBLE_DEVICES"), index)
    return "cuda:0"


def physical_device(mask, logical_index):
    """The CUDA_VISIBLE_DEVICES entry for our cuda:<logical_index>, given the mask this process inherited.

    Our device flags count the GPUs this process sees. A scheduler (Slurm, Kubernetes) may already have
    masked the machine's GPUs, e.g. CUDA_VISIBLE_DEVICES=4,6: then cuda:1 is GPU 6, not GPU 1. Entries may
    also be UUIDs (GPU-8c1e...) or MIG ids, kept as written. mask None: nothing masked, the index itself."""
    if mask is None:
        return str(logical_index)
    entries = [e.strip() for e in mask.split(",") if e.strip()]
    if not 0 <= logical_index < len(entries):
        raise ValueError(f"cuda:{logical_index} is not visible: CUDA_VISIBLE_DEVICES={mask!r} has {len(entries)} device(s)")
    return entries[logical_index]


def local_device(flag, rank):
    """This searcher rank's device: under --searcher-device auto its LOCAL_RANK's GPU, round-robin over the GPUs this
    node shows when it runs more ranks than it has GPUs (cpu without CUDA); else its entry of the flag (one device for
    all, or one per searcher)."""
    if flag == "auto":
        import torch
        n = torch.cuda.device_count()
        return f"cuda:{int(os.environ['LOCAL_RANK']) % n}" if n else "cpu"
    devices = flag.split(",")
    return devices[0] if len(devices) == 1 else devices[rank - 1]
