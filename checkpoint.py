"""
Checkpoints that a run can resume from, written atomically and loadable without unpickling objects.

A checkpoint is a directory run_dir/checkpoints/step-NNNNNN/:
    policy/, ref/        save_pretrained (safetensors) of the policy and the reference
    optimizer.pt         the AdamW state dict: tensors and numbers only, loaded with weights_only=True
    rng.pt               torch (and CUDA) RNG states, loaded with weights_only=True
    buffer.json          the replay buffer: every trajectory, the latest round, its sampler's RNG state
    state.json           step, reference version, counters, the rollout's own state, the config
It is written under a temporary name and renamed into place; then run_dir/checkpoints/latest (a one-line
file naming it) is replaced atomically, and older checkpoints are removed. A crash at any moment leaves
the previous checkpoint intact and `latest` pointing at a complete one.

What resuming reproduces: in --sync mode with a fixed seed, a resumed run takes exactly the same steps as an
uninterrupted one (same weights to float rounding; the tests check 1e-6). With searcher processes, the
trainer, optimiser, schedules and buffer are restored exactly, but the searchers restart with fresh
random streams and whatever timing the machine gives them, so the data they produce afterwards differs.

Run: python run_gsm8k.py --checkpoint-every 50, then the same command with --resume runs/gsm8k-tiny.
"""

import json
import os
import shutil

import torch


def save_checkpoint(run_dir, step, policy, ref, opt, buffer, state, keep=1):
    """Write the checkpoint taken before trainer step `step`; returns its path."""
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step-{step:06d}")
    tmp = final + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    policy.save_pretrained(os.path.join(tmp, "policy"))
    ref.save_pretrained(os.path.join(tmp, "ref"))
    torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, os.path.join(tmp, "rng.pt"))
    _write_json(os.path.join(tmp, "buffer.json"), buffer.state_dict())
    _write_json(os.path.join(tmp, "state.json"), {"step": step, **state})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_text_atomic(os.path.join(root, "latest"), os.path.basename(final))
    for name in sorted(n for n in os.listdir(root) if n.startswith("step-") and ".tmp" not in n)[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return final


def latest_checkpoint(run_dir):
    """Path of the newest complete checkpoint of a run directory; a clear error if there is none."""
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint there (expected {pointer})")
    with open(pointer) as f:
        path = os.path.join(run_dir, "checkpoints", f.read().strip())
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise FileNotFoundError(f"--resume {run_dir}: {pointer} names {path}, which is incomplete")
    return path


def load_checkpoint(path, policy, ref, opt, buffer):
    """Restore weights, optimiser, RNG and buffer in place; returns the contents of state.json."""
    from safetensors.torch import load_file
    for model, name in ((policy, "policy"), (ref, "ref")):
        tensors = load_file(os.path.join(path, name, "model.safetensors"), device=str(next(model.parameters()).device))
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected or any(not _is_tied(model, k) for k in missing):
            raise ValueError(f"{path}/{name}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")
    opt.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    with open(os.path.join(path, "buffer.json")) as f:
        buffer.load_state_dict(json.load(f))
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def _is_tied(model, key):
    """save_pretrained drops tied weights (e.g. lm_head.weight = embed_tokens.weight)."""
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def _write_text_atomic(path, text):
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
