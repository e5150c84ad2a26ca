"""
Evidence for the paper's claims, measured on the tiny presets with a protocol that can tell a result from
noise. Every run is `python run_*.py --preset tiny ...` in a subprocess, on this machine's cores.

Protocol
  - every cell is >= 4 seeds (the seed changes the SFT warm start, the data and the sampling);
  - every run is the preset's full schedule, learning-rate decay included;
  - the score of a run is the mean of its last 3 evaluations of the task's headline metric (one evaluation
    is noisy: greedy accuracy of the tiny model moves by several points between neighbouring steps);
  - a cell is reported as mean +- the half-width of a 95% Student-t interval over its seeds;
  - each seed's warm start (SFT, reward model, ...) is built by a 1-step run before any measured run, so
    no measured time includes it.

Experiments (--sections)
  speed      async TBA vs the --sync baseline (same loss, batch and model): seconds from launch to the
             first evaluation at or above --target (evaluation time excluded), start-up seconds (launch to
             the first trainer step), final score, the trainer's busy fraction, searcher tokens/s.
  staleness  sync period k in {1, 2, 4, 8, 16} for TB, RLOO and GRPO, with per-run diagnostics that can
             explain the result: realised m (fraction of the batch from the latest round), mean and max
             staleness, the latest round's age (steps since a sync last replaced it) and size (trajectories),
             gradient norm, KL, spread of log Z across prompts.
  buffer     most-on-policy probability m in {0, 0.5, 0.95} x prioritisation {softmax, uniform}, TB.
  tba_prime  TB with beta decaying linearly against TBA' (constant beta, reference reset every rho steps).
  tldr       the paper's Table 1 in miniature on the tiny TL;DR preset at the paper's most off-policy
             setting, sync every k = 10 steps with m = 0.5 (the tiny preset's own k is 4): win rate and KL
             for TB, RLOO and Online DPO.

Output: one markdown table per section on stdout and in results/<section>.md, a PNG per section in
results/ (matplotlib, optional), and every run as a row of results/runs.csv (kept across invocations; a
run made again replaces its row). Each section's file names the command, the date, the machine and the
section's wall time. With --reuse a run that an earlier invocation finished (same name and flags) is read
back from its run dir instead of run again, so a long grid can be made in pieces and tabulated whole.

Departures: the paper measures on GPUs with vLLM searchers; here the searcher and the trainer share 2 CPU
cores, so the async speedup is bounded by how the two processes split the machine (the README's Results
section works the bound out from the per-step times in each run's metrics.jsonl).

Run: python -m bench --quick     # a CI-sized check, under 20 minutes on 2 cores
     python -m bench             # the full protocol; prints its expected wall time first
     python -m bench --sections staleness --stale-k 8       # one piece of a grid, then the whole grid:
     python -m bench --sections staleness --reuse           # (runs only the cells not made yet)
"""

import csv
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

from config import build_parser, knob

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root: the run_*.py scripts, results/


@dataclass
class BenchConfig:
    out: str = knob("results", "directory for the tables, plots, runs.csv and the runs themselves")
    quick: bool = knob(False, "a CI-sized check: 2 seeds, 60-step schedules, fewer cells (under 20 minutes)")
    seeds: int = knob(4, "seeds per cell")
    sections: str = knob("speed,staleness,buffer,tba_prime,tldr", "which experiments to run (comma list)")
    target: float = knob(0.7, "headline score for the time-to-target comparison (GSM8K accuracy)")
    eval_every: int = knob(25, "evaluate every this many steps (the score is the mean of the last 3 evaluations)")
    speed_eval_every: int = knob(10, "evaluation period of the speed runs (time to target is read at evaluations)")
    stale_k: str = knob("1,2,4,8,16", "staleness section: the sync periods k (comma list; --quick: 2,16)")
    stale_objectives: str = knob("tb,rloo,grpo", "staleness section: the objectives (comma list; --quick: tb,grpo)")
    tldr_eval_every: int = knob(10, "evaluation period of the TL;DR runs (50 steps: the score is steps 30-50)")
    cache_dir: str = knob("~/.cache/tba", "where the tiny presets' warm starts are cached (shared by all runs)")
    seconds_per_run: float = knob(150.0, "expected seconds per full run, for the wall-time estimate printed first")
    reuse: bool = knob(False, "take a run that an earlier invocation finished with the same flags from its run dir "
                              "instead of running it again (splits a long bench over several invocations)")


QUICK_SCHEDULE = ["--steps", "60", "--warmup-steps", "5", "--stable-steps", "35", "--decay-steps", "20"]


# -----------------------------------------------------------------------------
# One run, and a cell of runs

def run(cfg, script, name, flags, seed, eval_every=None):
    """One run of a task's tiny preset; returns its row: score, time to target, start-up, rates, diagnostics."""
    run_dir = os.path.join(cfg.out, "runs", name)
    if cfg.reuse and (row := reused(cfg, run_dir, name, flags)) is not None:
        return row
    warm_up(cfg, script)
    cmd = [sys.executable, os.path.join(HERE, script), "--preset", "tiny", "--run-dir", run_dir, "--overwrite",
           "--cache-dir", cfg.cache_dir, "--seed", str(seed), "--eval-every", str(eval_every or cfg.eval_every),
           "--log-every", "1000000", *(QUICK_SCHEDULE if cfg.quick else []), *flags]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"run {name} failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    row = summarise(*read_run(run_dir), cfg.target)
    row.update({"name": name, "seed": seed, "flags": " ".join(flags), "run_wall_s": round(time.time() - t0, 1)})
    print(f"  {name:<34} score {row['score']:.3f} | to target {row['time_to_target_s']} s | {row['run_wall_s']:.0f} s",
          flush=True)
    return row


def read_run(run_dir):
    """A finished run's metrics.jsonl records and the metrics key of its task's headline score."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "result.json")) as f:
        return records, "eval/" + json.load(f)["headline"]


REUSED = []  # names of the runs that --reuse took from earlier invocations


def reused(cfg, run_dir, name, flags):
    """--reuse: the row of a run that an earlier invocation finished with the same flags (its run dir holds
    result.json and runs.csv holds its row), summarised again from its files; None if there is none."""
    if not os.path.exists(os.path.join(run_dir, "result.json")):
        return None
    old = next((r for r in read_runs(os.path.join(cfg.out, "runs.csv"))
                if r["name"] == name and r["flags"] == " ".join(flags)), None)
    if old is None:
        return None
    row = summarise(*read_run(run_dir), cfg.target)
    row.update({"name": name, "seed": int(old["seed"]), "flags": old["flags"], "run_wall_s": float(old["run_wall_s"])})
    REUSED.append(name)
    print(f"  {name:<34} score {row['score']:.3f} | reused from {run_dir}", flush=True)
    return row


def summarise(records, headline, target):
    """A run's row from its metrics.jsonl records (training steps and evaluations)."""
    steps = [r for r in records if "loss/train" in r]
    evals = [r for r in records if r.get(headline) is not None]
    hit = next((r["time/eval_since_launch"] for r in evals if r[headline] >= target), None)
    mean = lambda key: _mean([r[key] for r in steps if r.get(key) is not None])
    trained = [r for r in evals if r["step"] > 0]  # the evaluation before training never counts in the score
    return {"score": _mean([r[headline] for r in trained[-3:]]), "before": evals[0][headline],
            "time_to_target_s": None if hit is None else round(hit, 1),
            "startup_s": round(steps[0]["time/since_launch"] - steps[0]["time/train"], 1),
            "busy": steps[-1]["perf/busy"], "tokens_per_s": steps[-1]["perf/tokens_per_s"],
            "latest_frac": mean("buffer/latest_frac"), "staleness_mean": mean("staleness/mean"),
            "staleness_max": max(r["staleness/max"] for r in steps), "grad_norm": mean("grad/norm"),
            "kl": mean("loss/kl"), "log_Z_std": mean("loss/log_Z_std"), "eval_kl": evals[-1].get("eval/kl"),
            "round_age": mean("buffer/round_age"), "latest_size": mean("buffer/latest"),
            "curve": [(r["step"], r[headline]) for r in evals]}


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


def cell(cfg, script, name, flags, eval_every=None):
    """The runs of one configuration over cfg.seeds seeds."""
    return [run(cfg, script, f"{name}-seed{s}", flags, s, eval_every) for s in range(cfg.seeds)]


WARM = set()  # (script, seed) pairs whose warm start is known to be cached


def warm_up(cfg, script):
    """Build (or find) each seed's cached warm start with a 1-step run, so that no measured run includes it:
    a run's seconds from launch then mean the same thing whichever run of a seed comes first."""
    for seed in range(cfg.seeds):
        if (script, seed) not in WARM:
            cmd = [sys.executable, os.path.join(HERE, script), "--preset", "tiny", "--steps", "1", "--overwrite",
                   "--run-dir", os.path.join(cfg.out, "runs", f"warm-up-{script[:-3]}-seed{seed}"),
                   "--cache-dir", cfg.cache_dir, "--seed", str(seed), "--eval-every", "0"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"warm-up failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
            WARM.add((script, seed))


# -----------------------------------------------------------------------------
# The experiments

def speed(cfg):
    cells = {"async": cell(cfg, "run_gsm8k.py", "speed-async", [], cfg.speed_eval_every),  # a core each
             "sync": cell(cfg, "run_gsm8k.py", "speed-sync", ["--sync", "--trainer-threads", "2"], cfg.speed_eval_every)}
    rows = [{"mode": m, "score (%)": fmt([r["score"] for r in rs], 100),
             f"time to {100 * cfg.target:.0f}% (s)": fmt([r["time_to_target_s"] for r in rs]),
             "reached": f"{sum(r['time_to_target_s'] is not None for r in rs)}/{len(rs)}",
             "start-up (s)": fmt([r["startup_s"] for r in rs]), "busy": fmt([r["busy"] for r in rs], digits=2),
             "searcher tokens/s": fmt([r["tokens_per_s"] for r in rs], digits=0)} for m, rs in cells.items()]
    ratio = [s["time_to_target_s"] / a["time_to_target_s"] for a, s in zip(cells["async"], cells["sync"])
             if a["time_to_target_s"] and s["time_to_target_s"]]
    note = (f"time-to-target ratio sync / async, per seed: {', '.join(f'{x:.2f}' for x in ratio) or 'n/a'} "
            f"(mean {fmt(ratio, digits=2)})")
    return cells, table(rows) + "\n\n" + note


def stale_grid(cfg):
    """The staleness section's sync periods k and objectives, from --stale-k and --stale-objectives."""
    return [int(k) for k in cfg.stale_k.split(",")], cfg.stale_objectives.split(",")


# a diagnostic column of the tables: (its key in a run's summary row, digits shown)
DIAGNOSTICS = {"realised m": ("latest_frac", 2), "staleness mean": ("staleness_mean", 1),
               "staleness max": ("staleness_max", 0), "round age": ("round_age", 1), "round size": ("latest_size", 0),
               "grad norm": ("grad_norm", 2), "kl": ("kl", 2), "log Z spread": ("log_Z_std", 2)}


def diagnostics(rows, columns):
    """The named DIAGNOSTICS columns of one cell, each as mean ± 95% interval over its runs."""
    return {c: fmt([r[DIAGNOSTICS[c][0]] for r in rows], digits=DIAGNOSTICS[c][1]) for c in columns}


def staleness(cfg):
    ks, objectives = stale_grid(cfg)
    cells = {(o, k): cell(cfg, "run_gsm8k.py", f"stale-{o}-k{k}", ["--objective", o, "--sync-every", str(k)])
             for o in objectives for k in ks}
    scores = [{"objective": o, **{f"k={k}": fmt([r["score"] for r in cells[o, k]], 100) for k in ks}} for o in objectives]
    diag = [{"objective": o, "k": k, **diagnostics(rs, DIAGNOSTICS)} for (o, k), rs in cells.items()]
    return ({f"{o} k={k}": rs for (o, k), rs in cells.items()},
            "score (%), by objective and sync period k\n\n" + table(scores) + "\n\ndiagnostics, mean over each run's steps\n\n" + table(diag))


def buffer(cfg):
    cells = {(m, p): cell(cfg, "run_gsm8k.py", f"buffer-m{m}-{p}", ["--m", str(m), "--prioritization", p])
             for m in ((0.0, 0.95) if cfg.quick else (0.0, 0.5, 0.95)) for p in ("softmax", "uniform")}
    rows = [{"m": m, "prioritization": p, "score (%)": fmt([r["score"] for r in rs], 100),
             **diagnostics(rs, ["realised m", "staleness mean", "round age", "round size", "kl"])}
            for (m, p), rs in cells.items()]
    return {f"m={m} {p}": rs for (m, p), rs in cells.items()}, table(rows)


def tba_prime(cfg):
    cells = {"beta decay 0.2 -> 0.05": cell(cfg, "run_gsm8k.py", "prime-decay", ["--beta-start", "0.2", "--beta-end", "0.05",
                                                                                  "--beta-decay-steps", "200"]),
             "TBA': beta 0.1, reset every 50": cell(cfg, "run_gsm8k.py", "prime-reset", ["--ref-reset-every", "50"])}
    rows = [{"variant": v, "score (%)": fmt([r["score"] for r in rs], 100), "kl": fmt([r["kl"] for r in rs], digits=2)}
            for v, rs in cells.items()]
    return cells, table(rows)


def tldr(cfg):
    objectives = ("tb", "rloo") if cfg.quick else ("tb", "rloo", "online_dpo")
    cells = {o: cell(cfg, "run_tldr.py", f"tldr-{o}", ["--objective", o, "--sync-every", "10"], cfg.tldr_eval_every)
             for o in objectives}
    rows = [{"objective": o, "win rate (%)": fmt([r["score"] for r in rs], 100),
             "KL(pi_sft, pi) per token, after": fmt([r["eval_kl"] for r in rs], digits=3),
             "log pi - log pi_ref in training": fmt([r["kl"] for r in rs], digits=2)} for o, rs in cells.items()]
    return cells, table(rows)


SECTIONS = {"speed": speed, "staleness": staleness, "buffer": buffer, "tba_prime": tba_prime, "tldr": tldr}
TITLES = {"speed": "Async TBA vs --sync (tiny GSM8K)", "staleness": "Off-policyness: sync period k (tiny GSM8K)",
          "buffer": "The buffer: m and prioritisation, TB (tiny GSM8K)", "tba_prime": "TBA' against beta decay (tiny GSM8K)",
          "tldr": "Table 1 in miniature: TL;DR at k = 10, m = 0.5 (tiny TL;DR)"}


# -----------------------------------------------------------------------------
# Output

def table(rows):
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows])


def plot(cells, path, title):
    """Mean headline score over steps for each cell (seeds averaged)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: skipping {path})")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, rows) in enumerate(cells.items()):  # tab20: up to 20 cells, no colour repeated
        steps = [s for s, _ in rows[0]["curve"]]
        ax.plot(steps, [_mean([dict(r["curve"]).get(s, math.nan) for r in rows]) for s in steps], marker="o",
                label=name, color=plt.get_cmap("tab20")(i % 20))
    ax.set(xlabel="trainer step", ylabel="headline score (mean over seeds)", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def provenance(argv, seconds):
    return (f"made by `python -m bench {' '.join(argv)}` on {datetime.date.today()} on {platform.node()} "
            f"({os.cpu_count()} CPU cores, {platform.machine()}, no GPU), {seconds / 60:.1f} min")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = BenchConfig(**vars(build_parser(BenchConfig, {}).parse_args(argv)))
    if cfg.quick:
        cfg.seeds, cfg.sections, cfg.stale_k, cfg.stale_objectives = 2, "speed,staleness", "2,16", "tb,grpo"
    chosen = cfg.sections.split(",")
    os.makedirs(cfg.out, exist_ok=True)
    runs_per_seed = {"speed": 2, "staleness": math.prod(map(len, stale_grid(cfg))), "buffer": 4 if cfg.quick else 6,
                     "tba_prime": 2, "tldr": 3}
    n = cfg.seeds * sum(runs_per_seed[s] for s in chosen)
    print(f"bench: {n} runs; expect about {n * cfg.seconds_per_run / (2.5 if cfg.quick else 1) / 60:.0f} min "
          f"(plus building the warm starts of {cfg.seeds} seeds, first, where not cached"
          f"{'; less with --reuse, which reads finished runs back' if cfg.reuse else ''})", flush=True)
    t0, all_rows = time.time(), []
    for name in chosen:
        print(f"\n## {TITLES[name]}", flush=True)
        t_section, n_reused_before = time.time(), len(REUSED)
        cells, text = SECTIONS[name](cfg)
        rows, n_reused = [r for rs in cells.values() for r in rs], len(REUSED) - n_reused_before
        all_rows += rows
        header = f"### {TITLES[name]}\n\n{provenance(argv, time.time() - t_section)}; {cfg.seeds} seeds per cell"
        if n_reused:
            header += (f"; {n_reused} of its {len(rows)} runs were made by earlier invocations (--reuse): the runs "
                       f"themselves took {sum(r['run_wall_s'] for r in rows) / 60:.1f} min")
        header += "\n\n"
        print("\n" + text, flush=True)
        with open(os.path.join(cfg.out, f"{name}.md"), "w") as f:
            f.write(header + text + "\n")
        plot(cells, os.path.join(cfg.out, f"{name}.png"), TITLES[name])
    write_runs(os.path.join(cfg.out, "runs.csv"), all_rows)
    print(f"\nbench finished: {provenance(argv, time.time() - t0)}; {len(all_rows)} runs; {cfg.out}/runs.csv")


def write_runs(path, rows):
    """Every run as a row of runs.csv; runs of earlier invocations stay unless this one ran them again."""
    old = read_runs(path)
    names = {r["name"] for r in rows}
    rows = [r for r in old if r["name"] not in names] + rows
    columns = list(dict.fromkeys(c for r in rows for c in r if c != "curve"))
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


if __name__ == "__main__":
    main()  # (python -m bench runs this through bench/__main__.py)
