"""
What a run reports: one line per step on the terminal, one strict-JSON record per step in metrics.jsonl
(non-finite numbers become null, so any JSON reader or plot can read the file while the run goes on), and
the wall-clock accounting behind the perf/ and time/ metrics (evaluation time always excluded).

Used by tba.py; the metric names are listed in the README's "Metrics" table.
"""

import json
import math
import time

from config import LAUNCHED


def write_metrics(run, m):
    """Append one strict-JSON line (non-finite numbers become null): a plot can read the file mid-run."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps(clean, allow_nan=False) + "\n")


def format_line(m):
    return (f"step {m['step']:5d} | loss {m['loss/train']:8.3f} | log_Z {m['loss/log_Z']:7.2f} | kl {m['loss/kl']:6.2f} | "
            f"reward {m['reward/batch']:.3f} fresh {m['reward/fresh']:.3f} | beta {m['sched/beta']:.4f} | lr {m['sched/lr']:.2e} | "
            f"buffer {m['buffer/size']} | stale {m['staleness/mean']:.1f}/{m['staleness/max']} | "
            f"{m['perf/samples_per_s']:.0f} samples/s | busy {100 * m['perf/busy']:.0f}%")


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
