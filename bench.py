"""
Evidence for the paper's two claims, measured side by side on the tiny preset (one machine, one command):

  1. Asynchrony cuts wall-clock time. TBA (1 searcher + 1 trainer process, a core each) against the --sync
     baseline (one process generating then training, both cores), same model, task, loss and batch:
     wall-clock to a target held-out accuracy, samples/s, trainer busy fraction. From the sync run's
     per-step generation time Tg and training time Tt it prints the ideal speedup of N searchers,
         (Tg + Tt) / max(Tg / N, Tt)
     (generation spread over N searchers, the trainer never waiting), next to the measured ratio.
  2. TB is robust to off-policy, stale data. TB vs RLOO vs GRPO vs Dr. GRPO inside the asynchronous system
     at sync periods k = 1, 4, 16 (staleness grows with k), final held-out accuracy over several seeds.
  3. Ablations of the most-on-policy probability m and the sync period k, for TB.

Every run is `python run_gsm8k.py --preset tiny ...` in a subprocess; the tiny SFT warm start is trained
once and shared. Output: markdown tables on stdout, results/results.csv (one row per run), and PNG plots
of accuracy and reward against wall-clock (matplotlib, optional: `pip install matplotlib`).

Departures: the paper measures on GPUs with vLLM searchers; here both processes share 2 CPU cores, so the
async speedup is bounded by how generation and training split the machine (see the printed bound).

Run: python bench.py            # the default comparisons (about 45 minutes on 2 cores)
     python bench.py --quick    # a few short runs, under 5 minutes
"""

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from tba import build_parser, knob

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class BenchConfig:
    out: str = knob("results", "directory for results.csv, plots and the runs")
    quick: bool = knob(False, "a few short runs (under 5 minutes), e.g. for CI")
    steps: int = knob(150, "trainer steps per run")
    seeds: int = knob(2, "seeds for the objectives comparison")
    target: float = knob(0.7, "held-out accuracy for the time-to-target comparison")
    eval_every: int = knob(50, "evaluate every this many steps in the objective and ablation runs")
    speed_eval_every: int = knob(10, "evaluation period of the async-vs-sync runs (finer: time to target is read at evals)")
    sections: str = knob("speed,objectives,ablations", "which comparisons to run (comma list)")
    cache_dir: str = knob("~/.cache/tba", "where the tiny SFT warm start is cached")


BASE = {"objective": "tb", "sync-every": "4", "m": "0.95", "seed": "0"}  # the tiny preset's values
DONE = {}  # identical configurations run once: e.g. the m=0.95 and k=4 ablations are the TB k=4 seed-0 run


def run(cfg, name, flags, eval_every=None):
    """One run of the tiny preset (reused if an identical one already ran); returns its summary and curves."""
    overrides = dict(zip(flags[::2], flags[1::2])) if "--sync" not in flags else {"sync": name}
    key = tuple(sorted({**BASE, **{k.lstrip("-"): v for k, v in overrides.items()}}.items())) + (eval_every,)
    if key in DONE:
        row, curves = DONE[key]
        print(f"  {name:<28} (same configuration as {row['name']}: reused)", flush=True)
        return {**row, "name": name, "flags": " ".join(flags)}, curves
    DONE[key] = _run(cfg, name, flags, eval_every)
    return DONE[key]


def _run(cfg, name, flags, eval_every):
    run_dir = os.path.join(cfg.out, "runs", name)
    cmd = [sys.executable, os.path.join(HERE, "run_gsm8k.py"), "--preset", "tiny", "--run-dir", run_dir,
           "--cache-dir", cfg.cache_dir, "--steps", str(cfg.steps), "--eval-every", str(eval_every or cfg.eval_every),
           "--log-every", "1000000", "--checkpoint-every", "0", *flags]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"run {name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    before, after = map(float, re.search(r"accuracy: before ([\d.]+)% -> after ([\d.]+)%", out.stdout).groups())
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    last = metrics[-1]
    curve = [(0.0, before / 100)] + [(m["time/elapsed"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    curve.append((last["time/elapsed"], after / 100))
    hit = next((t for t, acc in curve if acc >= cfg.target), None)
    row = {"name": name, "flags": " ".join(flags), "acc_before": before, "acc_after": after,
           "train_wall_s": round(last["time/elapsed"], 1), "run_wall_s": round(time.time() - t0, 1),
           "time_to_target_s": None if hit is None else round(hit, 1),
           "samples_per_s": round(last["perf/samples_per_s"], 1), "busy": round(last["perf/busy"], 3),
           "Tg_s": round(float(np.median([m["time/merge"] for m in metrics[1:]])), 3),
           "Tt_s": round(float(np.median([m["time/train"] for m in metrics[1:]])), 3),
           "staleness_mean": round(float(np.mean([m["staleness/mean"] for m in metrics])), 2),
           "staleness_max": max(m["staleness/max"] for m in metrics)}
    print(f"  {name:<28} {before:5.1f}% -> {after:5.1f}% | train {row['train_wall_s']:6.1f}s | "
          f"to {100 * cfg.target:.0f}%: {row['time_to_target_s']} s", flush=True)
    return row, {"curve": curve, "reward": [(m["time/elapsed"], m["reward/fresh"]) for m in metrics]}


def table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def async_vs_sync(cfg):
    a, ca = run(cfg, "async", [], cfg.speed_eval_every)
    s, cs = run(cfg, "sync", ["--sync", "--trainer-threads", "2"], cfg.speed_eval_every)  # same 2 cores, one process
    for row in (a, s):
        row["steps_per_s"] = round(cfg.steps / row["train_wall_s"], 2)
    Tg, Tt, Tt1 = s["Tg_s"], s["Tt_s"], a["Tt_s"]
    ratio = s["time_to_target_s"] / a["time_to_target_s"] if a["time_to_target_s"] and s["time_to_target_s"] else None
    text = table([a, s], ["name", "acc_before", "acc_after", "time_to_target_s", "train_wall_s", "steps_per_s",
                          "samples_per_s", "busy", "Tg_s", "Tt_s"])
    bounds = ", ".join(f"N={n}: {(Tg + Tt) / max(Tg / n, Tt):.2f}x" for n in (1, 2, 4))
    text += (f"\n\n- sync, per step (2 threads): generation Tg = {Tg:.3f} s, training Tt = {Tt:.3f} s. Ideal async speedup "
             f"(Tg + Tt) / max(Tg / N, Tt), if each phase kept its speed: {bounds}."
             f"\n- on these 2 cores each async process has 1 thread: a trainer step takes {Tt1:.3f} s (vs {Tt:.3f} s), so "
             f"the trainer-step rate can gain at most (Tg + Tt) / Tt(1 thread) = {(Tg + Tt) / Tt1:.2f}x; "
             f"measured steps/s ratio async / sync = {a['steps_per_s'] / s['steps_per_s']:.2f}x."
             f"\n- measured time-to-{100 * cfg.target:.0f}% ratio sync / async = "
             f"{'n/a (target not reached by both)' if ratio is None else f'{ratio:.2f}x'} "
             f"(read at evaluations every {cfg.speed_eval_every} steps)")
    return [a, s], {"async": ca, "sync": cs}, text


def objectives(cfg, ks, seeds):
    rows, curves = [], {}
    for objective in ("tb", "rloo", "grpo", "dr_grpo"):
        for k in ks:
            for seed in range(seeds):
                name = f"{objective}-k{k}-seed{seed}"
                row, curve = run(cfg, name, ["--objective", objective, "--sync-every", str(k), "--seed", str(seed)])
                rows.append({**row, "objective": objective, "k": k, "seed": seed})
                curves[name] = curve
    summary = []
    for objective in ("tb", "rloo", "grpo", "dr_grpo"):
        entry = {"objective": objective}
        for k in ks:
            accs = [r["acc_after"] for r in rows if r["objective"] == objective and r["k"] == k]
            entry[f"k={k}"] = f"{np.mean(accs):.1f} ({', '.join(f'{x:.1f}' for x in accs)})"
        summary.append(entry)
    return rows, curves, table(summary, ["objective"] + [f"k={k}" for k in ks])


def ablations(cfg, ms, ks):
    rows, curves = [], {}
    for m in ms:
        row, curve = run(cfg, f"m{m}", ["--m", str(m)])
        rows.append({**row, "ablation": "m", "value": m})
        curves[f"m={m}"] = curve
    for k in ks:
        row, curve = run(cfg, f"k{k}", ["--sync-every", str(k)])
        rows.append({**row, "ablation": "k", "value": k})
        curves[f"k={k}"] = curve
    return rows, curves, table(rows, ["ablation", "value", "acc_after", "time_to_target_s", "staleness_mean", "staleness_max"])


def plot(curves, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: skipping {path})")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        ax1.plot(*zip(*c["curve"]), marker="o", label=name)
        ax2.plot(*zip(*c["reward"]), label=name, alpha=0.8)
    ax1.set(xlabel="wall-clock (s, eval excluded)", ylabel="held-out greedy accuracy", title=title)
    ax2.set(xlabel="wall-clock (s, eval excluded)", ylabel="reward of fresh searcher samples", title=title)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    import dataclasses
    args = build_parser(BenchConfig, {}).parse_args(argv)
    cfg = BenchConfig(**vars(args))
    if cfg.quick:
        cfg = dataclasses.replace(cfg, steps=20, seeds=1, eval_every=10, speed_eval_every=10, target=0.5)
    os.makedirs(cfg.out, exist_ok=True)
    t0 = time.time()
    print(f"bench: {'quick' if cfg.quick else 'default'} settings, {cfg.steps} steps per run, results in {cfg.out}/", flush=True)
    sections, all_rows, chosen = [], [], cfg.sections.split(",")
    if "speed" in chosen:
        rows, curves, text = async_vs_sync(cfg)
        sections.append(("Async vs sync (TB, tiny preset, 2 cores)", text))
        all_rows += rows
        plot(curves, os.path.join(cfg.out, "async_vs_sync.png"), "async vs sync")
    ks = (1, 4) if cfg.quick else (1, 4, 16)
    if "objectives" in chosen:
        rows, curves, text = objectives(cfg, ks, cfg.seeds)
        sections.append((f"Final accuracy (%) by objective and sync period k, mean (per seed), {cfg.steps} steps", text))
        all_rows += rows
        plot({n: c for n, c in curves.items() if n.endswith("seed0")}, os.path.join(cfg.out, "objectives.png"),
             "objectives, seed 0")
    if "ablations" in chosen and not cfg.quick:
        rows, curves, text = ablations(cfg, (0.5, 0.8, 0.95, 1.0), (1, 2, 4, 8))
        sections.append((f"TB ablations: m and k, seed 0, {cfg.steps} steps", text))
        all_rows += rows
        plot(curves, os.path.join(cfg.out, "ablations.png"), "TB ablations")
    columns = sorted({c for r in all_rows for c in r}, key=lambda c: list(all_rows[0]).index(c) if c in all_rows[0] else 99)
    with open(os.path.join(cfg.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(all_rows)
    for title, text in sections:
        print(f"\n### {title}\n\n{text}")
    print(f"\nbench finished in {(time.time() - t0) / 60:.1f} min; {len(all_rows)} runs; {cfg.out}/results.csv")


if __name__ == "__main__":
    main()
