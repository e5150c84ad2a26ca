"""
Plot the evaluations of TL;DR runs from their metrics.jsonl: win rate against the reference summaries (gold),
KL(pi_sft || pi) per token, and the proxy and gold rewards, against the trainer step; one line per run.

Needs matplotlib (`pip install matplotlib`), which nothing else here uses.

Run: python bench/plot_tldr.py runs/tldr-tiny runs/tldr-tiny-seed1 -o results/tldr_tiny.png
"""

import argparse
import json
import os


def evaluations(run_dir):
    """The records of metrics.jsonl that hold an evaluation, in step order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval/win_rate" in r]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("-o", "--out", default="results/tldr_tiny.png")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("eval/win_rate", "win rate vs reference (gold)"), ("eval/kl", "KL(pi_sft || pi) per token"),
              ("eval/proxy_reward", "proxy reward"), ("eval/gold_reward", "gold reward")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for run_dir in args.run_dirs:
        rows = evaluations(run_dir)
        for ax, (key, title) in zip(axes, panels):
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", ms=3, label=os.path.basename(run_dir))
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("trainer step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
