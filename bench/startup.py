"""
The start-up of a tiny GSM8K run, as a timeline (issue: speed against the peer): `python -m bench.startup`
runs `run_gsm8k.py --steps 3` in this process, with each phase of the trainer's start-up timed from launch:

    spawn the searchers -> build the task (and find the cached warm start) -> load the policy and the reference
    (imports transformers' models) -> send the searchers their job -> the first evaluation (not counted in
    a run's clocks) -> the first merge (waits for the searchers' initial fill) -> the first trainer step

The searchers' own start (import, load, the initial fill) runs beside it; the first merge's end is when their
fill arrived. Times are seconds since launch, as the `time/since_launch` of a run's metrics (evaluation NOT
excluded here: the evaluation's own line says how long it took).

Run: python -m bench.startup [any run_gsm8k.py flag, e.g. --objective grpo]
"""

import sys
import time

import run_gsm8k
from config import LAUNCHED
from ops import launch


def stamp(what):
    print(f"{time.time() - LAUNCHED:6.2f} s  {what}", flush=True)


def timed(owner, name, label):
    """Replace owner.name by the same function that stamps its start and end."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        stamp(f"{label} ...")
        out = fn(*args, **kwargs)
        stamp(f"... {label}: done")
        return out
    setattr(owner, name, wrapper)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    import searcher
    import tba
    from ops import bookkeeping
    stamp("launched; imported torch and tba")
    timed(run_gsm8k, "spawn_searchers", "spawn the searchers")
    timed(run_gsm8k, "make_task", "build the task")
    timed(tba, "load_trainer_models", "load the policy and the reference")
    timed(searcher.Searchers, "start", "send the searchers their job")
    timed(bookkeeping.Bookkeeping, "evaluate", "evaluation")
    timed(tba, "merge", "merge")
    timed(tba, "train_step", "trainer step")
    return launch.cli(run_gsm8k.GSM8KConfig, run_gsm8k.PRESETS, run_gsm8k.main,
                      ["--steps", "3", "--eval-every", "0", "--run-dir", "runs/startup", "--overwrite", *argv])


if __name__ == "__main__":
    sys.exit(main())
