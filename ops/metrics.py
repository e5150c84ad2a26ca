"""
What a run reports: one line per step on the terminal, one strict-JSON record per step in metrics.jsonl
(non-finite numbers become null, so any JSON reader or plot can read the file while the run goes on), the same
numbers under the same names in TensorBoard or Weights & Biases with --report-to (`Tracker`), the held-out
prompts, completions and rewards of each evaluation in samples.jsonl, and the wall-clock accounting behind the
perf/ and time/ metrics (evaluation time always excluded).

Used by ops/bookkeeping.py; the metric names are listed in docs/operations.md.
"""

import dataclasses
import json
import math
import os
import time

from config import LAUNCHED
from ops.checkpoint import write_error, write_text_atomic


def write_metrics(path, record):
    """Append one strict-JSON line (non-finite numbers become null): a plot can read the file mid-run. A failed
    write is a WriteError naming the file (a full disk: the space free)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(clean, allow_nan=False) + "\n")
    except OSError as e:
        raise write_error(path, e) from None


class Tracker:
    """Where records go: metrics.jsonl always; with --report-to, TensorBoard (run_dir/tensorboard) or W&B (its
    files under run_dir/wandb; WANDB_MODE=offline keeps them there) too, every finite number by its name."""

    def __init__(self, cfg):
        self.path, self.samples_path = (os.path.join(cfg.run_dir, n) for n in ("metrics.jsonl", "samples.jsonl"))
        if not cfg.resume:  # a resumed run appends
            for path in (self.path, self.samples_path):
                open(path, "w").close()
        self.tensorboard = self.wandb = None
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(cfg.run_dir, "tensorboard"))
        elif cfg.report_to == "wandb":
            import wandb
            self.wandb = wandb.init(dir=cfg.run_dir, name=os.path.basename(os.path.abspath(cfg.run_dir)),
                                    config=dataclasses.asdict(cfg))

    def log(self, record):
        write_metrics(self.path, record)
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tensorboard is not None:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(numbers, step=record["step"])

    def rewind(self, step):
        """On resume: metrics.jsonl and samples.jsonl cut back to the records before `step` (the steps after it are
        recorded again as they are re-run), a line cut by a crash dropped: strict JSON, each step once."""
        for path in (self.path, self.samples_path):
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if before_step(line, step)]
                write_text_atomic(path, "".join(kept).rstrip("\n")) if kept else open(path, "w").close()

    def samples(self, step, samples):
        """An evaluation's held-out prompts, completions and scores, one strict-JSON line each."""
        for sample in samples:
            write_metrics(self.samples_path, {"step": step, **sample})

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tensorboard = self.wandb = None


def before_step(line, step):
    """Whether a metrics line is a whole JSON record of a step before `step`."""
    try:
        return json.loads(line)["step"] < step
    except (ValueError, KeyError, TypeError):
        return False


def format_line(record):
    return (f"step {record['step']:5d} | loss {record['loss/train']:8.3f} | log_Z {record['loss/log_Z']:7.2f} | kl {record['loss/kl']:6.2f} | "
            f"reward {record['reward/batch']:.3f} fresh {record['reward/fresh']:.3f} | beta {record['sched/beta']:.4f} | lr {record['sched/lr']:.2e} | "
            f"buffer {record['buffer/size']} | stale {record['staleness/mean']:.1f}/{record['staleness/max']} | "
            f"drift {record['offpolicy/drift']:.2f} out {record['offpolicy/ratio_out']:.2f} clip {record['offpolicy/clip_frac']:.2f} | "
            f"grad {record['grad/norm']:.3g} | "
            f"{record['perf/samples_per_s']:.0f} samples/s | busy {100 * record['perf/busy']:.0f}% | wait {record['time/wait']:.2f}s")


class Meter:
    """Wall-clock accounting, evaluation time always excluded. Rates (trajectories and tokens received,
    the trainer's busy fraction) count from the first trained step on, after the initial fill."""

    def __init__(self):
        self.start = self.t0 = time.time()
        self.busy, self.eval, self.eval0, self.samples, self.tokens = 0.0, 0.0, 0.0, 0, 0

    def times(self):
        return {"time/elapsed": time.time() - self.start - self.eval,  # since setup (initial fill included)
                "time/since_launch": time.time() - LAUNCHED - self.eval, "time/eval": self.eval}

    def restart(self):
        self.t0, self.busy, self.eval0, self.samples, self.tokens = time.time(), 0.0, self.eval, 0, 0

    def count(self, trajectories):
        self.samples += len(trajectories)
        self.tokens += sum(len(t.response_ids) for t in trajectories)

    def rates(self, started):
        wall = time.time() - self.t0 - (self.eval - self.eval0)
        if not started or wall <= 0:
            return {"perf/samples_per_s": math.nan, "perf/tokens_per_s": math.nan, "perf/busy": math.nan}
        return {"perf/samples_per_s": self.samples / wall, "perf/tokens_per_s": self.tokens / wall,
                "perf/busy": self.busy / wall}
