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
  speed      async TBA vs the --sync baseline (same loss, batch and model), and async without --share-prompt:
             seconds from launch to the first evaluation at or above --target and to the end of the schedule
             (evaluation time excluded), seconds per step, start-up seconds (launch to the first trainer step),
             final score, the trainer's busy fraction, searcher tokens/s.
  staleness  sync period k in {1, 2, 4, 8, 16} for TB, RLOO and GRPO, with per-run diagnostics that can
             explain the result: realised m (fraction of the batch from the latest round), mean and max
             staleness, the latest round's age (steps since a sync last replaced it) and size (trajectories),
             gradient norm, KL, spread of log Z across prompts.
  buffer     most-on-policy probability m in {0, 0.5, 0.95} x prioritisation {softmax, uniform}, TB.
  tba_prime  TB with beta decaying linearly against TBA' (constant beta, reference reset every rho steps).
  redteam    the tiny red-teaming preset at k = 1 and 8 for plain TB, TB with the trust region and RLOO:
             attack success, and the diversity of the attacks (cosine similarity, trigger families covered).
  tldr       the paper's Table 1 in miniature on the tiny TL;DR preset at the paper's most off-policy
             setting, sync every k = 10 steps with m = 0.5 (the tiny preset's own k is 4): win rate and KL
             for TB, RLOO and Online DPO.
  ablations  why TB trails the clipped baselines off-policy (issue: the paper's claims, diagnosed): one change
             at a time from the tiny GSM8K preset (ABLATIONS: gradient clipping, the initial fill, m, the
             learning rate, beta, dedup, the ratio clip, TB with a trust region) at the sync periods
             --ablation-k, with the off-policy diagnostics of every cell: drift |log pi - log mu| (mean, p90),
             the fraction of ratios outside [1 - eps, 1 + eps], the clip fraction, the gradient norm before
             clipping and how often it was clipped.
  frontier   TL;DR tiny at k = 10: win rate against KL(pi_sft, pi) for TB, RLOO and Online DPO at several betas and the
             official schedule's shape (the paper reads TL;DR on this frontier, not at one shared beta).
  trl        this project's async system (TB, RLOO, GRPO) against TRL's GRPOTrainer (bench/peer.py) on the tiny
             GSM8K preset: time to --target, steps to it, start-up, seconds per step and final score, per seed,
             and the asymmetries that cannot be matched. Not in the default list: it needs TRL
             (pip install -r requirements-bench.txt).

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

import datetime
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

from bench.diagnosis import ablation_runs, ablations, frontier, load
from bench.protocol import DIAGNOSTICS, REUSED, _mean, cell, diagnostics, fmt, objective_flags, pyplot, table, write_runs
from config import build_parser, knob


@dataclass
class BenchConfig:
    out: str = knob("results", "directory for the tables, plots, runs.csv and the runs themselves")
    quick: bool = knob(False, "a CI-sized check: 2 seeds, 60-step schedules, fewer cells (under 20 minutes)")
    seeds: int = knob(4, "seeds per cell")
    first_seed: int = knob(0, "the first seed of every cell (seeds --first-seed .. + --seeds - 1)")
    sections: str = knob("speed,staleness,buffer,tba_prime,tldr,ablations,frontier", "which experiments to run (comma list)")
    target: float = knob(0.7, "headline score for the time-to-target comparison (GSM8K accuracy)")
    eval_every: int = knob(25, "evaluate every this many steps (the score is the mean of the last 3 evaluations)")
    speed_eval_every: int = knob(10, "evaluation period of the speed runs (time to target is read at evaluations)")
    stale_k: str = knob("1,2,4,8,16", "staleness section: the sync periods k (comma list; --quick: 2,16)")
    stale_objectives: str = knob("tb,rloo,grpo", "staleness section: the objectives (comma list; --quick: tb,grpo): tb is "
                                                 "plain TB, tb-trust-region TB with --tb-correction trust-region")
    ablations: str = knob("preset,no-grad-clip,trust-region,init-1024", "ablations section: the variants (comma list of ABLATIONS' "
                                                      "names, run in this order; name@4: at k = 4 only)")
    ablation_k: str = knob("16", "ablations section: the sync periods k (comma list)")
    ablation_objectives: str = knob("tb,grpo,rloo", "ablations section: the objectives (comma list; a variant runs "
                                                    "only for the objectives it applies to)")
    frontier_betas: str = knob("0.05,0.2,0.8,schedule", "frontier section: constant betas, and 'schedule' for the "
                                                        "official-shaped one (comma list)")
    tldr_eval_every: int = knob(10, "evaluation period of the TL;DR runs (50 steps: the score is steps 30-50)")
    cache_dir: str = knob("~/.cache/tba", "where the tiny presets' warm starts are cached (shared by all runs)")
    seconds_per_run: float = knob(150.0, "expected seconds per full run, for the wall-time estimate printed first")
    made_only: bool = knob(False, "ablations section: tabulate the cells whose runs were all made already (--reuse), "
                                  "leave out the others, run nothing")
    reuse: bool = knob(False, "take a run that an earlier invocation finished with the same flags from its run dir "
                              "instead of running it again (splits a long bench over several invocations)")


# -----------------------------------------------------------------------------
# The experiments

def speed(cfg):
    cells = {"async": cell(cfg, "run_gsm8k.py", "speed-async", [], cfg.speed_eval_every),  # a core each
             "async, --no-share-prompt": cell(cfg, "run_gsm8k.py", "speed-async-unshared", ["--no-share-prompt"],
                                              cfg.speed_eval_every),  # (before the trainer ran each prompt once)
             "sync": cell(cfg, "run_gsm8k.py", "speed-sync", ["--sync", "--trainer-threads", "2"], cfg.speed_eval_every)}
    rows = [{"mode": m, "score (%)": fmt([r["score"] for r in rs], 100),
             f"time to {100 * cfg.target:.0f}% (s)": fmt([r["time_to_target_s"] for r in rs]),
             "reached": f"{sum(r['time_to_target_s'] is not None for r in rs)}/{len(rs)}",
             "time to the end (s)": fmt([r["end_s"] for r in rs]), "s / step": fmt([r["s_per_step"] for r in rs], digits=3),
             "start-up (s)": fmt([r["startup_s"] for r in rs]), "trainer waits (s)": fmt([r["wait_s"] for r in rs]),
             "busy": fmt([r["busy"] for r in rs], digits=2),
             "searcher tokens/s": fmt([r["tokens_per_s"] for r in rs], digits=0)} for m, rs in cells.items()]
    pairs = list(zip(cells["async"], cells["sync"]))
    ratio = [s["time_to_target_s"] / a["time_to_target_s"] for a, s in pairs if a["time_to_target_s"] and s["time_to_target_s"]]
    end = [s["end_s"] / a["end_s"] for a, s in pairs]
    steps = len(cells["async"][0]["curve"]) and cells["async"][0]["curve"][-1][0]  # the schedule's last step
    bound = [(s["startup_s"] + steps * s["s_per_step"]) / (a["startup_s"] + steps * a["s_per_step"]) for a, s in pairs]
    per_seed = lambda xs: f"{', '.join(f'{x:.2f}' for x in xs) or 'n/a'} (mean {fmt(xs, digits=2)})"
    note = (f"time-to-target ratio sync / async, per seed: {per_seed(ratio)}\n\nfull schedule, time to the end "
            f"sync / async, per seed: {per_seed(end)}; from each run's start-up and seconds per step, (start-up + "
            f"{steps} x s/step) sync / async: {per_seed(bound)}")
    return cells, table(rows) + "\n\n" + note


def stale_grid(cfg):
    """The staleness section's sync periods k and objectives, from --stale-k and --stale-objectives."""
    return [int(k) for k in cfg.stale_k.split(",")], cfg.stale_objectives.split(",")


# a diagnostic column of the tables: (its key in a run's summary row, digits shown)


def staleness(cfg):
    ks, objectives = stale_grid(cfg)
    cells = {(o, k): cell(cfg, "run_gsm8k.py", f"stale-{o}-k{k}", [*objective_flags(o), "--sync-every", str(k)])
             for o in objectives for k in ks}
    scores = [{"objective": o, **{f"k={k}": fmt([r["score"] for r in cells[o, k]], 100) for k in ks},
               "lowest k's mean": f"{100 * min(_mean([r['score'] for r in cells[o, k]]) for k in ks):.1f}"} for o in objectives]
    lows = [{"objective": o, **{f"k={k}": each_seed(cells[o, k], "low_from_100") for k in ks}} for o in objectives]
    finals = [{"objective": o, **{f"k={k}": each_seed(cells[o, k], "final") for k in ks}} for o in objectives]
    diag = [{"objective": o, "k": k, **diagnostics(rs, DIAGNOSTICS)} for (o, k), rs in cells.items()]
    plot_staleness(cells, ks, objectives, os.path.join(cfg.out, "staleness_curves.png"))
    return ({f"{o} k={k}": rs for (o, k), rs in cells.items()},
            "score (%), by objective and sync period k (mean of the last 3 evaluations; mean and 95% interval over "
            "seeds), and the lowest k's mean\n\n" + table(scores) +
            "\n\nthe lowest held-out evaluation from step 100 on (%), each seed's\n\n" + table(lows) +
            "\n\nthe final held-out evaluation (%), each seed's\n\n" + table(finals) +
            "\n\ndiagnostics, mean over each run's steps\n\n" + table(diag))


def each_seed(rows, key):
    """A cell's value of `key` (a fraction) in each seed's run, as percentages: "84 / 80 / 79"."""
    return " / ".join(f"{100 * r[key]:.0f}" for r in rows)


def plot_staleness(cells, ks, objectives, path):
    """Held-out score over steps, a panel per sync period k: each objective's seeds (thin) and their mean (bold)."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(3.2 * len(ks), 3.4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        for i, o in enumerate(objectives):
            color, rows = plt.get_cmap("tab10")(i), cells[o, k]
            for r in rows:
                ax.plot(*zip(*r["curve"]), color=color, alpha=0.25, linewidth=0.8)
            ax.plot(*mean_curve(rows), color=color, linewidth=2, label=o)
        ax.set(title=f"k = {k}", xlabel="trainer step")
    axes[0][0].set_ylabel("held-out accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


REDTEAM_GRID = [(o, k) for o in ("tb", "tb-trust-region", "rloo") for k in (1, 8)]  # the redteam section's cells


def redteam(cfg):
    cells = {(o, k): cell(cfg, "run_redteam.py", f"redteam-{o}-k{k}", [*objective_flags(o), "--sync-every", str(k)], 100)
             for o, k in REDTEAM_GRID}
    rows = [{"objective": o, "k": k, "attack success (%)": fmt([r["final"] for r in rs], 100),
             "each seed's (%)": each_seed(rs, "final"),
             "cosine similarity (lower: more diverse)": fmt([r["cosine_sim"] for r in rs], digits=3),
             "trigger families covered (of 4)": fmt([r["modes_covered"] for r in rs])} for (o, k), rs in cells.items()]
    return ({f"{o} k={k}": rs for (o, k), rs in cells.items()},
            "the final evaluation (step 200, 1,024 attacks), mean and 95% interval over seeds\n\n" + table(rows))


def tldr(cfg):
    objectives = ("tb", "rloo") if cfg.quick else ("tb", "rloo", "online_dpo")
    cells = {o: cell(cfg, "run_tldr.py", f"tldr-{o}", ["--objective", o, "--sync-every", "10"], cfg.tldr_eval_every)
             for o in objectives}
    rows = [{"objective": o, "win rate (%)": fmt([r["score"] for r in rs], 100),
             "KL(pi_sft, pi) per token, after": fmt([r["eval_kl"] for r in rs], digits=3),
             "log pi - log pi_ref in training": fmt([r["kl"] for r in rs], digits=2)} for o, rs in cells.items()]
    return cells, table(rows)


PEER_ASYMMETRIES = """Matched (bench/peer.py's `trl_args`, read from the resolved tiny GSM8K config): the SFT warm start, the \
training prompts, the reward (the task's scorer), the held-out problems and the evaluation code, K responses x Q \
prompts per step, the steps, AdamW's learning rate and weight decay, the warmup-stable-decay schedule, gradient \
clipping (none), the sampling temperature, max new tokens, beta, dtype, seed, 2 CPU threads. Not matched: TRL \
generates and trains one after the other in one process with 2 threads, this project in a searcher and a trainer \
process with 1 thread each; TRL's GRPO is its own (token-level "dapo" loss, rewards scaled by the group's std, a k3 \
KL term with beta that costs a reference forward per step, on-policy so its ratio clip never acts) where this \
project's GRPO has no KL term and trains on its buffer; evaluation time is excluded from every clock (this \
project's searchers are held meanwhile, so neither system works off the clock); TRL steps its scheduler after \
each update, so its learning rates lag this project's by one step; its AdamW is torch's fused one (its default)."""


def trl(cfg):
    """TRL's GRPOTrainer (bench/peer.py) against this project's async system with TB, RLOO and GRPO, on the tiny
    GSM8K preset: time to the target, steps to it, start-up, seconds per step and final score, per seed. The TB
    cell is the speed section's async cell (shared under --reuse)."""
    flags = {"TB": ("speed-async", []), "RLOO": ("peer-rloo", ["--objective", "rloo"]),
             "GRPO": ("peer-grpo", ["--objective", "grpo"])}
    cells = {f"{o} (this project, async)": cell(cfg, "run_gsm8k.py", n, f, cfg.speed_eval_every) for o, (n, f) in flags.items()}
    cells["GRPO (TRL GRPOTrainer)"] = cell(cfg, "bench/peer.py", "peer-trl", [], cfg.speed_eval_every)
    target = f"{100 * cfg.target:.0f}%"
    rows = [{"system": name, "seed": r["seed"], f"time to {target} (s)": r["time_to_target_s"] or "not reached",
             f"steps to {target}": r["steps_to_target"] or "-", "start-up (s)": r["startup_s"],
             "s / step": f"{r['s_per_step']:.2f}", "trainer waits (s)": r["wait_s"], "final score (%)": f"{100 * r['score']:.1f}"}
            for name, rs in cells.items() for r in rs]
    summary = [{"system": name, f"median time to {target} (s)": median([r["time_to_target_s"] for r in rs]),
                "reached": f"{sum(r['time_to_target_s'] is not None for r in rs)}/{len(rs)}",
                f"median steps to {target}": median([r["steps_to_target"] for r in rs]),
                "start-up (s)": fmt([r["startup_s"] for r in rs]), "s / step": fmt([r["s_per_step"] for r in rs], digits=2),
                "trainer waits (s)": fmt([r["wait_s"] for r in rs]), "final score (%)": fmt([r["score"] for r in rs], 100)}
               for name, rs in cells.items()]
    trl_median = median([r["time_to_target_s"] for r in cells["GRPO (TRL GRPOTrainer)"]])
    ratios = "; ".join(f"{name.split(' ')[0]} {trl_median / t:.2f}" for name, rs in cells.items()
                       if "async" in name and (t := median([r["time_to_target_s"] for r in rs])))
    plot_time(cells, os.path.join(cfg.out, "trl_time.png"), cfg.target)
    return cells, (table(summary) + f"\n\nmedian time to {target}, TRL / this project: {ratios or 'n/a'}\n\nper seed\n\n"
                   + table(rows) + "\n\n" + PEER_ASYMMETRIES)


def median(values):
    """The median of the values that are not None (a run that never reached the target counts as never)."""
    values = sorted(v if v is not None else math.inf for v in values)
    if not values:
        return None
    m = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
    return None if math.isinf(m) else round(m, 1)


def plot_time(cells, path, target):
    """Headline score against seconds since launch (evaluation excluded), a line per run, a colour per system."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, rows) in enumerate(cells.items()):
        for j, r in enumerate(rows):
            ax.plot(*zip(*r["curve_s"]), color=plt.get_cmap("tab10")(i), alpha=0.7, label=name if j == 0 else None)
    ax.axhline(target, color="grey", linestyle=":")
    ax.set(xlabel="seconds since launch (evaluation excluded)", ylabel="held-out accuracy",
           title="Tiny GSM8K: this project against TRL's GRPOTrainer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SECTIONS = {"speed": speed, "staleness": staleness, "buffer": buffer, "tba_prime": tba_prime, "redteam": redteam, "tldr": tldr,
            "ablations": ablations, "frontier": frontier, "trl": trl, "load": load}
TITLES = {"speed": "Async TBA vs --sync (tiny GSM8K)", "staleness": "Off-policyness: sync period k (tiny GSM8K)",
          "buffer": "The buffer: m and prioritisation, TB (tiny GSM8K)", "tba_prime": "TBA' against beta decay (tiny GSM8K)",
          "redteam": "Red-teaming off-policy: k = 1 and 8 (tiny red-teaming)",
          "tldr": "Table 1 in miniature: TL;DR at k = 10, m = 0.5 (tiny TL;DR)",
          "ablations": "Why TB trails the clipped baselines off-policy: one change at a time (tiny GSM8K)",
          "frontier": "TL;DR at k = 10: win rate against KL, by beta (tiny TL;DR)",
          "trl": "This project against TRL's GRPOTrainer (tiny GSM8K)",
          "load": "A busy machine: fresh rounds against --no-fresh-rounds (tiny red-teaming and GSM8K)"}


# -----------------------------------------------------------------------------
# Output



def mean_curve(rows):
    """(steps, headline score at each, averaged over the cell's seeds): the first seed's evaluation steps."""
    steps = [s for s, _ in rows[0]["curve"]]
    return steps, [_mean([dict(r["curve"]).get(s, math.nan) for r in rows]) for s in steps]


def plot(cells, path, title):
    """Mean headline score over steps for each cell (seeds averaged)."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, rows) in enumerate(cells.items()):  # tab20: up to 20 cells, no colour repeated
        ax.plot(*mean_curve(rows), marker="o", label=name, color=plt.get_cmap("tab20")(i % 20))
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
    runs_per_seed = {"speed": 3, "staleness": math.prod(map(len, stale_grid(cfg))), "buffer": 4 if cfg.quick else 6,
                     "tba_prime": 2, "redteam": len(REDTEAM_GRID), "tldr": 3, "ablations": ablation_runs(cfg), "frontier": 3 * len(cfg.frontier_betas.split(",")), "trl": 4, "load": 4}
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




if __name__ == "__main__":
    main()  # (python -m bench runs this through bench/__main__.py)
