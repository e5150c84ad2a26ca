"""
The benchmark's bookkeeping (python -m bench): the interval and run summary, --reuse, runs.csv. No run is timed.

Run: python -m pytest -q tests/test_bench.py
"""

import importlib.util
import json
import math

import torch

import pytest


# A bench run's metrics.jsonl: an evaluation before training, three training steps, three evaluations after.
BENCH_RECORDS = [{"step": 0, "eval/accuracy": 0.2, "time/eval_since_launch": 5.0},
                 *({"step": s, "loss/train": 1.0, "time/since_launch": 6.0 + s, "time/train": 0.3, "perf/busy": 0.9,
                    "perf/tokens_per_s": 100.0, "buffer/latest_frac": 1.0, "staleness/mean": 1.0, "staleness/max": 3,
                    "grad/norm": 2.0, "loss/kl": 0.1, "loss/log_Z_std": 0.5} for s in range(3)),
                 {"step": 10, "eval/accuracy": 0.75, "time/eval_since_launch": 9.0},
                 {"step": 20, "eval/accuracy": 0.65, "time/eval_since_launch": 12.0},
                 {"step": 30, "eval/accuracy": 0.8, "time/eval_since_launch": 15.0}]


def test_bench_interval_and_run_summary():
    from bench import protocol as bench
    mean, half = bench.interval([1.0, 2.0, 3.0])  # sd 1, t(2 dof) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert bench.interval([5.0])[0] == 5.0 and math.isnan(bench.interval([5.0])[1])
    assert bench.fmt([0.5, 0.7, None], 100) == f"60.0 ± {100 * 12.706 * math.sqrt(0.02) / math.sqrt(2):.1f}"
    row = bench.summarise(BENCH_RECORDS, "eval/accuracy", target=0.7)
    assert row["score"] == pytest.approx((0.75 + 0.65 + 0.8) / 3), "the mean of the last three evaluations"
    assert row["time_to_target_s"] == 9.0 and row["startup_s"] == pytest.approx(5.7) and row["staleness_max"] == 3
    assert row["steps_to_target"] == 10 and row["s_per_step"] == pytest.approx(1.0), "steps 0-2 at 6, 7, 8 s"
    short = bench.summarise(BENCH_RECORDS[:-2], "eval/accuracy", target=0.7)  # evaluations at steps 0 and 10 only
    assert short["score"] == 0.75, "the evaluation before training never counts in the score"


def test_bench_reuse_reads_finished_runs_back(tmp_path, monkeypatch):
    from bench import evidence, protocol as bench
    cfg = evidence.BenchConfig(out=str(tmp_path), reuse=True, target=0.7)
    run_dir = tmp_path / "runs" / "stale-tb-k8-seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BENCH_RECORDS))
    (run_dir / "result.json").write_text(json.dumps({"headline": "accuracy"}))
    bench.write_runs(str(tmp_path / "runs.csv"), [{"name": "stale-tb-k8-seed1", "seed": 1, "flags": "--sync-every 8",
                                                   "run_wall_s": 170.5, "score": 0.0}])
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    row = bench.run(cfg, "run_gsm8k.py", "stale-tb-k8-seed1", ["--sync-every", "8"], 1)
    assert row["score"] == pytest.approx(0.733333, abs=1e-6) and row["run_wall_s"] == 170.5 and row["seed"] == 1
    assert row["curve"][-1] == (30, 0.8), "summarised again from the run's own files, not copied from runs.csv"
    assert bench.reused(cfg, str(run_dir), "stale-tb-k8-seed1", ["--sync-every", "4"]) is None, "other flags"
    assert bench.reused(cfg, str(tmp_path / "runs" / "x"), "x", []) is None, "never finished"


def test_bench_runs_csv_keeps_earlier_runs(tmp_path):
    from bench import protocol as bench
    path = str(tmp_path / "runs.csv")
    bench.write_runs(path, [{"name": "a", "score": 0.1, "curve": [(0, 0.1)]}, {"name": "b", "score": 0.2}])
    bench.write_runs(path, [{"name": "b", "score": 0.3, "eval_kl": 0.05}])  # b again, with a new column
    with open(path) as f:
        assert f.read().splitlines() == ["name,score,eval_kl", "a,0.1,", "b,0.3,0.05"]


def test_bench_ablation_and_frontier_sections_tabulate(tmp_path, monkeypatch):
    from bench import diagnosis, evidence, protocol as bench
    cfg = evidence.BenchConfig(out=str(tmp_path), seeds=2, ablations="preset,no-grad-clip,trust-region,no-ratio-clip,trust-region@4",
                            ablation_objectives="tb,grpo", frontier_betas="0.05,schedule")
    made = []

    def fake_run(cfg, script, name, flags, seed, eval_every=None, load=False):
        made.append((script, name, flags))
        records = [dict(r, **({"offpolicy/drift": 0.1 * (seed + 1), "offpolicy/ratio_out": float("nan"),
                               "eval/kl": 0.02} if "loss/train" in r else {"eval/kl": 0.02})) for r in BENCH_RECORDS]
        return {**bench.summarise(records, "eval/accuracy", 0.7), "name": name, "seed": seed}

    monkeypatch.setattr(bench, "run", fake_run)
    assert diagnosis.ablation_runs(cfg) == 7, "preset and no-grad-clip for both, trust region for TB (also at k = 4), no ratio clip for GRPO"
    cells, text = diagnosis.ablations(cfg)
    assert len(made) == 14 and "| trust-region | tb | 4 |" in text and ("run_gsm8k.py", "stale-tb-k16-seed0", ["--objective", "tb", "--tb-correction", "none", "--sync-every", "16"]) in made
    assert ("run_gsm8k.py", "abl-trust-region-tb-k16-seed1", ["--objective", "tb", "--tb-correction", "none", "--sync-every",
                                                             "16", "--tb-correction", "trust-region"]) in made
    assert "| trust-region | tb | 16 | 73.3 ± 0.0 | 0.150 ± 0.635 |" in text and "| n/a |" in text, "NaN steps left out"
    cells, text = diagnosis.frontier(cfg)
    assert len(cells) == 6 and "| online_dpo | schedule |" in text and (tmp_path / "frontier_kl.png").exists() == bench_plots()


def test_bench_staleness_tabulates_each_seeds_lowest_evaluation_from_step_100_and_runs_the_chosen_seeds(tmp_path, monkeypatch):
    from bench import evidence, protocol as bench
    cfg = evidence.BenchConfig(out=str(tmp_path), seeds=2, first_seed=2, stale_k="1,8", stale_objectives="tb,tb-trust-region,grpo")
    made = []

    def fake_run(cfg, script, name, flags, seed, eval_every=None, load=False):
        made.append((name, flags, seed))
        dip = 0.5 if "tb" in flags and "none" in flags and "8" in flags else 0.85  # plain TB dips at k = 8
        records = [*BENCH_RECORDS[:4], *({"step": s, "eval/accuracy": a, "time/eval_since_launch": 20.0 + s}
                                         for s, a in ((50, 0.4), (100, dip + 0.01 * seed), (150, 0.88), (200, 0.9)))]
        return {**bench.summarise(records, "eval/accuracy", 0.7), "name": name, "seed": seed}

    monkeypatch.setattr(bench, "run", fake_run)
    cells, text = evidence.staleness(cfg)
    assert [seed for *_, seed in made] == [2, 3] * 6, "seeds --first-seed .. + --seeds - 1"
    assert ("stale-tb-trust-region-k8-seed3", ["--objective", "tb", "--tb-correction", "trust-region", "--sync-every", "8"], 3) in made
    assert ("stale-tb-k8-seed2", ["--objective", "tb", "--tb-correction", "none", "--sync-every", "8"], 2) in made
    lows = text.split("from step 100 on (%), each seed's")[1].split("the final")[0]
    assert "| tb | 87 / 88 | 52 / 53 |" in lows and "| grpo | 87 / 88 | 87 / 88 |" in lows, "step 50's 40% is before step 100"
    assert "| tb | 90 / 90 | 90 / 90 |" in text.split("the final held-out evaluation")[1], "each seed's final evaluation"


def bench_plots():
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def test_bench_trl_section_tabulates_per_seed_and_ratio(tmp_path, monkeypatch):
    from bench import evidence, protocol as bench
    cfg = evidence.BenchConfig(out=str(tmp_path), seeds=2)
    made = []

    def fake_run(cfg, script, name, flags, seed, eval_every=None, load=False):  # TRL's runs reach 70% at 18 s, ours at 9 s
        made.append((script, name))
        late = [dict(r, **{"time/eval_since_launch": 2 * r["time/eval_since_launch"]}) if "eval/accuracy" in r else r
                for r in BENCH_RECORDS]
        return {**bench.summarise(late if "trl" in name else BENCH_RECORDS, "eval/accuracy", 0.7), "name": name, "seed": seed}

    monkeypatch.setattr(bench, "run", fake_run)
    cells, text = evidence.trl(cfg)
    assert ("run_gsm8k.py", "speed-async-seed1") in made, "TB's cell is the speed section's async cell"
    assert ("bench/peer.py", "peer-trl-seed0") in made and len(made) == 8
    assert "TRL / this project: TB 2.00; RLOO 2.00; GRPO 2.00" in text
    assert "| GRPO (TRL GRPOTrainer) | 1 | 18.0 | 10 | 5.7 | 1.00 | 0.0 | 73.3 |" in text
    assert evidence.median([3.0, None, 1.0]) == 3.0 and evidence.median([None, None, 1.0]) is None


def test_bench_speed_section_compares_time_to_target_and_to_the_end(tmp_path, monkeypatch):
    from bench import evidence, protocol as bench
    cfg = evidence.BenchConfig(out=str(tmp_path), seeds=2)

    def fake_run(cfg, script, name, flags, seed, eval_every=None, load=False):  # --sync runs take twice as long
        slow = lambda r: {**r, **{k: 2 * v for k, v in r.items() if k.startswith("time/") and "--sync" in flags}}
        return {**bench.summarise([slow(r) for r in BENCH_RECORDS], "eval/accuracy", 0.7), "name": name, "seed": seed}

    monkeypatch.setattr(bench, "run", fake_run)
    cells, text = evidence.speed(cfg)
    assert list(cells) == ["async", "async, --no-share-prompt", "sync"]
    assert "| async | 73.3 ± 0.0 | 9.0 ± 0.0 | 2/2 | 8.0 ± 0.0 | 1.000 ± 0.000 | 5.7 ± 0.0 |" in text
    assert "time-to-target ratio sync / async, per seed: 2.00, 2.00" in text
    assert "time to the end sync / async, per seed: 2.00, 2.00" in text and "(start-up + 30 x s/step)" in text


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is an optional bench dependency")
def test_trl_trainer_gets_the_projects_hyperparameters(tmp_path):
    """bench/peer.py's mapping: the GRPOTrainer TRL builds from the resolved tiny GSM8K config has its K, batch,
    steps, optimiser, learning-rate schedule (shifted by the one step TRL's scheduler lags), clipping, sampling,
    beta and seed, and the task's own reward."""
    from bench import peer
    from config import parse_config
    from loss import wsd_schedule
    from rewards import GSM8KTask
    from run_gsm8k import PRESETS, GSM8KConfig, make_dataset
    from tests.helpers import _tiny_random_hf_model
    rows = make_dataset(40, 0, 9, 9, 2)
    task = GSM8KTask.from_rows(rows[:32], rows[32:])
    model = _tiny_random_hf_model("llama", tmp_path / "model", [task.prompts[0] + r["answer"] for r in rows])
    cfg = parse_config(GSM8KConfig, PRESETS, ["--model", model, "--run-dir", str(tmp_path / "run"), "--seed", "3"])
    trainer = peer.make_trainer(cfg, task, clock=None)
    args = trainer.args
    assert trainer.num_generations == cfg.responses_per_prompt == 8 and args.per_device_train_batch_size == cfg.batch_size
    assert args.per_device_train_batch_size // trainer.num_generations == cfg.prompts_per_step and args.gradient_accumulation_steps == 1
    assert (args.max_steps, args.seed, trainer.temperature, trainer.max_completion_length, trainer.beta) == \
        (cfg.steps, 3, cfg.temperature, cfg.max_new_tokens, cfg.beta_start)
    assert args.max_grad_norm == cfg.grad_clip == 0.0 and not args.gradient_checkpointing and not args.bf16
    trainer.create_optimizer_and_scheduler(cfg.steps)
    group = trainer.optimizer.param_groups[0]
    assert type(trainer.optimizer).__name__ == "AdamW" and group["weight_decay"] in (cfg.weight_decay, 0.0)
    ours = [wsd_schedule(s, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.lr_floor, cfg.lr_decay) for s in range(cfg.steps)]
    theirs = trainer.lr_scheduler.lr_lambdas[0]
    assert [theirs(s + 1) for s in range(cfg.steps)] == pytest.approx(ours), \
        "TRL's update s + 1 has this project's learning rate of update s"
    assert group["initial_lr"] == cfg.lr and theirs(0) == pytest.approx(cfg.lr_floor), "TRL's first update: the floor"
    reward = trainer.reward_funcs[0]
    answer = rows[0]["answer"].split("####")[-1].strip()
    assert reward([task.prompts[0]] * 2, [f"#### {answer}", "#### -1"], [task.metas[0]] * 2) == [1.0, 0.0]


def test_the_memory_plan_estimates_a_steps_peak_within_30_percent():
    """ops/memory.py's trainer estimate of what a step adds (gradients, AdamW state, activations, logits) against the
    peak a real step adds on CPU, for two model sizes (measured: 1.02 and 1.11 of it on 2026-12-06, docs/scaling.md)."""
    from bench.memory import plan_check
    checks = plan_check()
    for name, measured, estimated in checks:
        assert abs(estimated / measured - 1) < 0.3, f"{name}: estimate {estimated / 2**20:.0f} MiB, measured {measured / 2**20:.0f}"
    assert checks[1][1] > 4 * checks[0][1], "two sizes that differ"


def test_bench_gpu_weights_times_a_publish_and_a_pull_in_each_dtype():
    """python -m bench.gpu --weights: the trainer publishes and a spawned searcher pulls each version (a small
    Llama here, RhoMath-1B's shape there): after every pull the searcher holds exactly the version published, and
    each side's median is a time."""
    from bench.gpu import weights_trip
    for dtype in (torch.float32, torch.bfloat16):
        publish, pull, right = weights_trip(dtype, repeats=3, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=2, num_key_value_heads=2, vocab_size=1000)
        assert right == 3, f"{dtype}: {3 - right} of 3 pulled versions differ from what was published"
        assert publish > 0 and pull > 0, (dtype, publish, pull)


def test_bench_gpu_prints_its_table_on_a_cpu_at_small_shapes():
    """python -m bench.gpu on this machine: a short async run of each paper architecture (small shapes, real
    vocabularies) and one table row each, with numbers in every column a CPU can measure."""
    import os
    import subprocess
    import sys
    from bench.gpu import SHAPES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    columns, rows = lines[0][2:-2].split(" | "), [dict(zip(lines[0][2:-2].split(" | "), l[2:-2].split(" | "))) for l in lines[1:]]
    assert [r["architecture"] for r in rows] == list(SHAPES) and "MFU" in columns
    for r in rows:
        assert float(r["trainer step (s)"]) > 0 and float(r["searcher tokens/s"]) > 0 and float(r["publish (ms)"]) > 0
        assert r["MFU"] == r["bandwidth bound"] == "n/a", "no card on a CPU"
        for process in ("trainer", "searcher"):
            peak, estimate = map(float, r[f"{process} peak / plan (GiB)"].split(" / "))
            assert peak > 0 and estimate > 0
