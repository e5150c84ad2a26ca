"""
The protocol of `python -m bench` (bench/evidence.py has the experiments): one run of a task's tiny preset in a
subprocess and its summary row, a cell of seeds, --reuse of finished runs, the 95% interval, the diagnostic
columns and the markdown table, and results/runs.csv. Read evidence.py's docstring for the protocol itself.
"""

import csv
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root: the run_*.py scripts, results/
QUICK_SCHEDULE = ["--steps", "60", "--warmup-steps", "5", "--stable-steps", "35", "--decay-steps", "20"]


# -----------------------------------------------------------------------------
# One run, and a cell of runs

def run(cfg, script, name, flags, seed, eval_every=None, load=False):
    """One run of a task's tiny preset; returns its row: score, time to target, start-up, rates, diagnostics.
    load: a second process spins one core while it runs (a busy machine)."""
    run_dir = os.path.join(cfg.out, "runs", name)
    if cfg.reuse and (row := reused(cfg, run_dir, name, flags)) is not None:
        return row
    warm_up(cfg, script)
    cmd = [sys.executable, os.path.join(HERE, script), "--preset", "tiny", "--run-dir", run_dir, "--overwrite",
           "--cache-dir", cfg.cache_dir, "--seed", str(seed), "--eval-every", str(eval_every or cfg.eval_every),
           "--log-every", "1000000", *(QUICK_SCHEDULE if cfg.quick else []), *flags]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
    t0 = time.time()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if out.returncode != 0:
        raise RuntimeError(f"run {name} failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    row = summarise(*read_run(run_dir), cfg.target)
    row.update({"name": name, "seed": seed, "flags": " ".join(flags), "run_wall_s": round(time.time() - t0, 1)})
    write_runs(os.path.join(cfg.out, "runs.csv"), [row])  # at once: a bench stopped later keeps this run for --reuse
    print(f"  {name:<34} score {row['score']:.3f} | to target {row['time_to_target_s']} s | {row['run_wall_s']:.0f} s",
          flush=True)
    return row


def read_run(run_dir):
    """A finished run's metrics.jsonl records and the metrics key of its task's headline score."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "result.json")) as f:
        return records, "eval/" + json.load(f)["headline"]


TB_VARIANTS = {"tb": ["--objective", "tb", "--tb-correction", "none"],  # plain TB, whatever the preset's default
               "tb-trust-region": ["--objective", "tb", "--tb-correction", "trust-region"]}  # (clamp, tis: f552cd9)


def objective_flags(objective):
    """A grid's objective column as run_gsm8k.py's flags: rloo, grpo, ..., or tb (plain) and tb-trust-region."""
    return TB_VARIANTS.get(objective, ["--objective", objective])


REUSED = []  # names of the runs that --reuse took from earlier invocations


def reused(cfg, run_dir, name, flags):
    """--reuse: the row of a run that an earlier invocation finished with the same flags (its run dir holds
    result.json and runs.csv holds its row), summarised again from its files; None if there is none."""
    old = finished(cfg, run_dir, name, flags)
    if old is None:
        return None
    row = summarise(*read_run(run_dir), cfg.target)
    row.update({"name": name, "seed": int(old["seed"]), "flags": old["flags"], "run_wall_s": float(old["run_wall_s"])})
    REUSED.append(name)
    print(f"  {name:<34} score {row['score']:.3f} | reused from {run_dir}", flush=True)
    return row


def finished(cfg, run_dir, name, flags):
    """runs.csv's row of a run an earlier invocation finished with these flags (its run dir holds result.json)."""
    if not os.path.exists(os.path.join(run_dir, "result.json")):
        return None
    return next((r for r in read_runs(os.path.join(cfg.out, "runs.csv")) if r["name"] == name and r["flags"] == " ".join(flags)),
                None)


def summarise(records, headline, target):
    """A run's row from its metrics.jsonl records (training steps and evaluations)."""
    steps = [r for r in records if "loss/train" in r]
    evals = [r for r in records if r.get(headline) is not None]
    hit = next((r for r in evals if r[headline] >= target), None)
    mean = lambda key: _mean([r[key] for r in steps if r.get(key) is not None and not math.isnan(r[key])])
    trained = [r for r in evals if r["step"] > 0]  # the evaluation before training never counts in the score
    return {"score": _mean([r[headline] for r in trained[-3:]]), "before": evals[0][headline], "final": evals[-1][headline],
            "time_to_target_s": None if hit is None else round(hit["time/eval_since_launch"], 1),
            "steps_to_target": None if hit is None else hit["step"],
            "startup_s": round(steps[0]["time/since_launch"] - steps[0]["time/train"], 1),
            "s_per_step": (steps[-1]["time/since_launch"] - steps[0]["time/since_launch"]) / max(1, len(steps) - 1),
            "end_s": round(steps[-1]["time/since_launch"], 1),  # launch to the last step's end, evaluation excluded
            "busy": steps[-1].get("perf/busy"), "tokens_per_s": steps[-1].get("perf/tokens_per_s"),
            "latest_frac": mean("buffer/latest_frac"), "staleness_mean": mean("staleness/mean"),
            "staleness_max": max((r["staleness/max"] for r in steps if "staleness/max" in r), default=math.nan),
            "grad_norm": mean("grad/norm"),
            "kl": mean("loss/kl"), "log_Z_std": mean("loss/log_Z_std"), "eval_kl": evals[-1].get("eval/kl"),
            "round_age": mean("buffer/round_age"), "latest_size": mean("buffer/latest"),
            "drift": mean("offpolicy/drift"), "drift_p90": mean("offpolicy/drift_p90"),
            "ratio_out": mean("offpolicy/ratio_out"), "clip_frac": mean("offpolicy/clip_frac"),
            "cosine_sim": evals[-1].get("eval/cosine_sim"), "modes_covered": evals[-1].get("eval/modes_covered"),
            "grad_clipped": mean("grad/clipped"), "loss_max": max(r["loss/train"] for r in steps),
            "wait_s": round(sum(r.get("time/wait", 0.0) for r in steps), 1),  # the trainer's waits for fresh data
            "empty_syncs": sum(r.get("buffer/new_round") is False for r in steps),  # merges that formed no round
            "low_from_100": min((r[headline] for r in evals if r["step"] >= 100), default=math.nan),  # mid-run dips
            "curve": [(r["step"], r[headline]) for r in evals],
            "curve_s": [(r["time/eval_since_launch"], r[headline]) for r in evals]}


def _mean(values):
    return sum(values) / len(values) if values else math.nan


T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 30: 2.042}  # two-sided 95% Student-t quantiles by degrees of freedom


def interval(values):
    """(mean, half-width of the 95% Student-t interval) of a cell's values; (mean, nan) for one value."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = T_95[max(d for d in T_95 if d <= n - 1)]
    return mean, t * sd / math.sqrt(n)


def fmt(values, scale=1.0, digits=1):
    mean, half = interval(values)
    if math.isnan(mean):
        return "n/a"
    return f"{scale * mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {scale * half:.{digits}f}")


def cell(cfg, script, name, flags, eval_every=None, load=False):
    """The runs of one configuration over cfg.seeds seeds, from --first-seed on."""
    return [run(cfg, script, f"{name}-seed{s}", flags, s, eval_every, load) for s in seeds(cfg)]


def seeds(cfg):
    """The seeds of every cell: --seeds of them from --first-seed on (0-1 to tune a setting, 2-5 to report it)."""
    return range(cfg.first_seed, cfg.first_seed + cfg.seeds)


WARM = set()  # (script, seed) pairs whose warm start is known to be cached
WARM_START_OF = {"bench/peer.py": "run_gsm8k.py"}  # a script that trains another's warm start (TRL: GSM8K's)


def warm_up(cfg, script):
    """Build (or find) each seed's cached warm start with a 1-step run, so that no measured run includes it:
    a run's seconds from launch then mean the same thing whichever run of a seed comes first."""
    script = WARM_START_OF.get(script, script)
    for seed in seeds(cfg):
        if (script, seed) not in WARM:
            cmd = [sys.executable, os.path.join(HERE, script), "--preset", "tiny", "--steps", "1", "--overwrite",
                   "--run-dir", os.path.join(cfg.out, "runs", f"warm-up-{script[:-3]}-seed{seed}"),
                   "--cache-dir", cfg.cache_dir, "--seed", str(seed), "--eval-every", "0"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"warm-up failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
            WARM.add((script, seed))


DIAGNOSTICS = {"realised m": ("latest_frac", 2), "staleness mean": ("staleness_mean", 1),
               "staleness max": ("staleness_max", 0), "round age": ("round_age", 1), "round size": ("latest_size", 0),
               "grad norm": ("grad_norm", 2), "kl": ("kl", 2), "log Z spread": ("log_Z_std", 2),
               "drift": ("drift", 3), "drift p90": ("drift_p90", 3), "ratio out": ("ratio_out", 3),
               "clip frac": ("clip_frac", 3), "grad clipped": ("grad_clipped", 2), "empty syncs": ("empty_syncs", 1),
               "trainer waits (s)": ("wait_s", 1), "loss max": ("loss_max", 0)}


def diagnostics(rows, columns):
    """The named DIAGNOSTICS columns of one cell, each as mean ± 95% interval over its runs."""
    return {c: fmt([r[DIAGNOSTICS[c][0]] for r in rows], digits=DIAGNOSTICS[c][1]) for c in columns}


def table(rows):
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows])


def pyplot(path):
    """matplotlib.pyplot (headless), or None if matplotlib is not installed (an optional bench dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: skipping {path})")
        return None
    return plt


def write_runs(path, rows):
    """Every run as a row of runs.csv; runs of earlier invocations stay unless this one ran them again."""
    old = read_runs(path)
    names = {r["name"] for r in rows}
    rows = [r for r in old if r["name"] not in names] + rows
    columns = list(dict.fromkeys(c for r in rows for c in r if not c.startswith("curve")))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_runs(path):
    """The rows of runs.csv (as strings), or none if it does not exist yet."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
