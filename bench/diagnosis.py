"""
The paper's claims, diagnosed (sections of `python -m bench`; the protocol is bench/protocol.py):

  ablations  why TB trails the clipped baselines off-policy: one change at a time from the tiny GSM8K preset
             (ABLATIONS) at the sync periods --ablation-k, with the off-policy diagnostics of every cell.
  frontier   TL;DR tiny at k = 10: win rate against KL(pi_sft, pi) for TB, RLOO and Online DPO at several betas
             and the official schedule's shape.
  load       the tiny red-teaming and GSM8K presets on a busy machine (a second process spins one core), with
             fresh rounds (the trainer waits for the searchers) and without (--no-fresh-rounds): how many syncs
             brought no new round, how stale the data got, and what each run gained, per seed.

Run: python -m bench --sections ablations --ablations preset,trust-region --ablation-objectives tb,grpo
     python -m bench --sections frontier
     python -m bench --sections load
"""

import os

from bench.protocol import cell, diagnostics, finished, fmt, interval, objective_flags, pyplot, seeds, table


# an ablation: its flags, and the objectives it applies to (None: all); each departs from the tiny preset
ABLATIONS = {
    "preset": ([], None),
    "no-grad-clip": (["--grad-clip", "0"], None),  # the official code never clips
    "grad-clip-10": (["--grad-clip", "10"], None),
    "grad-clip-1": (["--grad-clip", "1"], None),  # the tiny preset until 2026-12-05
    "init-1024": (["--initial-completions", "1024"], None),
    "m-0.5": (["--m", "0.5"], None), "m-0": (["--m", "0"], None),
    "lr-5e-6": (["--lr", "5e-6"], ("tb", "grpo")),
    "beta-0.03": (["--beta-start", "0.03", "--beta-end", "0.03"], ("tb", "rloo")),
    "beta-0.3": (["--beta-start", "0.3", "--beta-end", "0.3"], ("tb", "rloo")),
    "no-dedup": (["--no-dedup"], None),
    "no-ratio-clip": (["--no-ratio-clip"], ("rloo", "grpo")),
    "trust-region": (["--tb-correction", "trust-region"], ("tb",)),
    "trust-region-no-grad-clip": (["--tb-correction", "trust-region", "--grad-clip", "0"], ("tb",)),
}
ABLATION_COLUMNS = ["drift", "drift p90", "ratio out", "clip frac", "grad norm", "grad clipped", "kl"]


def made(cfg, name, flags):
    """Whether every seed's run of a cell was finished by an earlier invocation (--made-only)."""
    return all(finished(cfg, os.path.join(cfg.out, "runs", f"{name}-seed{s}"), f"{name}-seed{s}", flags) is not None
               for s in seeds(cfg))


def ablation_list(cfg):
    """--ablations as (variant, sync periods) pairs: "name" runs at every --ablation-k, "name@4" at k = 4 only."""
    default = [int(k) for k in cfg.ablation_k.split(",")]
    return [(v.split("@")[0], [int(v.split("@")[1])] if "@" in v else default) for v in cfg.ablations.split(",")]


def ablation_runs(cfg):
    """Runs per seed of the ablations section."""
    objectives = cfg.ablation_objectives.split(",")
    return sum(len(ks) * sum(ABLATIONS[v][1] is None or o in ABLATIONS[v][1] for o in objectives)
               for v, ks in ablation_list(cfg))


def ablations(cfg):
    """Tiny GSM8K, one change at a time from the preset, at the sync periods --ablation-k: TB against GRPO and
    RLOO, with the off-policy diagnostics of every cell. The preset cell at k is named as the staleness
    section's, so that the two sections share it."""
    objectives, cells = cfg.ablation_objectives.split(","), {}
    for variant, ks in ablation_list(cfg):
        flags, applies = ABLATIONS[variant]
        for k in ks:
            for o in objectives:
                name = f"stale-{o}-k{k}" if variant == "preset" else f"abl-{variant}-{o}-k{k}"
                run_flags = [*objective_flags(o), "--sync-every", str(k), *flags]
                if (applies is None or o in applies) and (not cfg.made_only or made(cfg, name, run_flags)):
                    cells[variant, o, k] = cell(cfg, "run_gsm8k.py", name, run_flags)
    rows = [{"variant": v, "objective": o, "k": k, "score (%)": fmt([r["score"] for r in rs], 100),
             **diagnostics(rs, ABLATION_COLUMNS)} for (v, o, k), rs in cells.items()]
    return {f"{v} {o} k={k}": rs for (v, o, k), rs in cells.items()}, table(rows)


FRONTIER_SCHEDULE = ["--beta-start", "1.0", "--beta-end", "0.05", "--beta-decay-steps", "25", "--beta-stop-step", "6"]


def frontier(cfg):
    """TL;DR tiny at Table 1's setting (k = 10, m = 0.5, as the tldr section): win rate against KL(pi_sft, pi)
    for TB, RLOO and Online DPO at several betas,
    and the official schedule's shape scaled to the 50-step run (1.0 decaying linearly, then 0.05 from
    step 6: the official holds beta >= 0.77 for 31 of 256 updates, then drops to 0.05)."""
    objectives = ("tb", "rloo", "online_dpo")
    betas = cfg.frontier_betas.split(",")
    beta_flags = lambda b: FRONTIER_SCHEDULE if b == "schedule" else ["--beta-start", b, "--beta-end", b]
    cells = {(o, b): cell(cfg, "run_tldr.py", f"frontier-{o}-beta{b}",
                          ["--objective", o, "--sync-every", "10", *beta_flags(b)], cfg.tldr_eval_every)
             for o in objectives for b in betas}
    rows = [{"objective": o, "beta": b, "win rate (%)": fmt([r["score"] for r in rs], 100),
             "KL(pi_sft, pi) per token, after": fmt([r["eval_kl"] for r in rs], digits=3),
             **diagnostics(rs, ["drift", "kl"])} for (o, b), rs in cells.items()]
    plot_frontier(cells, os.path.join(cfg.out, "frontier_kl.png"))
    return {f"{o} beta={b}": rs for (o, b), rs in cells.items()}, table(rows)


def plot_frontier(cells, path):
    """Win rate against KL, one point per (objective, beta) with its seeds' 95% intervals, a line per objective."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for o in dict.fromkeys(o for o, _ in cells):
        points = sorted((interval([r["eval_kl"] for r in rs]), interval([100 * r["score"] for r in rs]), b)
                        for (oo, b), rs in cells.items() if oo == o)
        (x, xe), (y, ye) = zip(*[p[0] for p in points]), zip(*[p[1] for p in points])
        ax.errorbar(x, y, xerr=xe, yerr=ye, marker="o", capsize=3, label=o)
        for (kl, _), (win, _), b in points:
            ax.annotate(b, (kl, win), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="KL(pi_sft, pi) per token (held-out)", ylabel="win rate (%)", title="TL;DR tiny at k = 10: win rate against KL")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LOAD_TASKS = {"red-teaming": ("run_redteam.py", 50), "GSM8K": ("run_gsm8k.py", 50)}  # script, evaluation period
LOAD_COLUMNS = ["empty syncs", "trainer waits (s)", "staleness mean", "round age", "drift", "loss max"]


def load(cfg):
    """Each task's tiny preset with a second process spinning one core, with and without fresh rounds: the
    headline score (mean of the last 3 evaluations), the final evaluation's gain over the first per seed, and
    the diagnostics of an empty-sync collapse."""
    variants = {"fresh rounds": [], "--no-fresh-rounds": ["--no-fresh-rounds"]}
    cells = {(t, v): cell(cfg, script, f"load-{script[4:-3]}-{'fresh' if not f else 'nofresh'}", f, every, load=True)
             for v, f in variants.items() for t, (script, every) in LOAD_TASKS.items()}  # both tasks' fresh rounds first
    gain = lambda r: 100 * (r["final"] - r["before"])
    rows = [{"task": t, "variant": v, "score (%)": fmt([r["score"] for r in rs], 100),
             "gain per seed (points)": ", ".join(f"{gain(r):+.1f}" for r in rs),
             "seeds with +20": f"{sum(gain(r) >= 20 for r in rs)}/{len(rs)}", **diagnostics(rs, LOAD_COLUMNS)}
            for (t, v), rs in cells.items()]
    return {f"{t} {v}": rs for (t, v), rs in cells.items()}, table(rows)
