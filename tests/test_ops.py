"""
The operations layer under fault: bad flags and inputs (one line, exit 2, before anything starts), stop
signals and dead searchers (a checkpoint, a message, no process left), resume and the run directory's lock,
the non-finite guard. Real processes with the tiny preset, CPU only, no network.

Run: python -m pytest -q tests/test_ops.py
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from buffer import ReplayBuffer
from config import ConfigError, RunError
from rewards import GSM8KTask, load_gsm8k
from tests.helpers import (ROOT, TINY_SFT, _alive, _bpe_tokenizer, _children, _descendants, _popen, gsm8k_cli,
                           _start_and_wait_for_training, _start_in_the_warm_start, _wait_gone, read_metrics, tiny_args)


def test_load_gsm8k_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.jsonl"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_gsm8k(str(bad))
    missing = tmp_path / "missing_field.jsonl"
    missing.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"missing_field.jsonl:1: .*'answer'"):
        load_gsm8k(str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_gsm8k(str(empty))


def test_killed_searcher_ends_run_nonzero_without_orphans(tmp_path, cache_dir):
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    children = _children(proc.pid)
    searchers = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert searchers, "no searcher process found"
    t0 = time.time()
    os.kill(searchers[0], signal.SIGKILL)
    rest, _ = proc.communicate(timeout=30)
    rc = proc.returncode
    assert rc != 0
    assert time.time() - t0 < 10, "the run should stop within 10 s of a searcher dying"
    assert "searcher-0" in rest and "died" in rest, rest[-2000:]
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)], "processes outlived the run"


@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False),
                                          (signal.SIGHUP, True), (signal.SIGTERM, True)])
def test_stop_signal_checkpoints_and_stops_everything(tmp_path, cache_dir, signum, group):
    # Ctrl-C reaches the whole process group; Slurm, Docker and systemd send SIGTERM to the trainer
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    children = _children(proc.pid)
    t0 = time.time()
    os.killpg(proc.pid, signum) if group else os.kill(proc.pid, signum)
    rest, _ = proc.communicate(timeout=60)
    seconds = time.time() - t0
    assert proc.returncode == 128 + signum, rest[-2000:]
    name = signal.Signals(signum).name
    last = rest.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {name}; checkpoint ") and "continue with --resume" in last, last
    assert "Traceback" not in rest and "resource_tracker" not in rest and "leaked" not in rest, rest[-2000:]
    assert seconds < 20, f"stopping took {seconds:.1f} s"
    step = int(re.search(r"step-(\d+)", last).group(1))
    assert json.load(open(tmp_path / "run" / "checkpoints" / f"step-{step:06d}" / "state.json"))["step"] == step
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)], "processes outlived the run"


@pytest.mark.parametrize("flags,message", [
    (["--m", "1.5"], "--m must be in"),
    (["--responses-per-prompt", "9", "--samples-per-prompt", "8"], "must be <= --samples-per-prompt"),
    (["--batch-size", "60", "--responses-per-prompt", "8"], "multiple of --responses-per-prompt"),
])
def test_config_errors_before_spawn(tmp_path, flags, message, capsys):
    assert gsm8k_cli(["--preset", "tiny", "--run-dir", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


def test_unknown_flag_is_an_error():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--no-such-flag", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: unrecognized flag --no-such-flag: did you mean --no-sync? (--help lists every flag; TRL's names: "
        "docs/tasks.md)"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _weights(model_dir):
    """The tensors of a save_pretrained directory."""
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_resume_in_sync_mode_reproduces_the_uninterrupted_run(tmp_path, cache_dir):
    common = ["--sync", "--trainer-threads", "1", "--eval-every", "0", "--lr", "1e-4"]
    straight = subprocess.run(tiny_args(tmp_path / "a", cache_dir, "--steps", "20", *common),
                              capture_output=True, text=True, timeout=180)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = subprocess.run(tiny_args(tmp_path / "b", cache_dir, "--steps", "10", *common),
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert open(tmp_path / "b" / "run" / "checkpoints" / "latest").read().strip() == "step-000010"
    resumed = subprocess.run(tiny_args(tmp_path / "b", cache_dir, "--steps", "20", *common,
                                       "--resume", str(tmp_path / "b" / "run")),
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "at step 10" in resumed.stdout
    a, b = _weights(tmp_path / "a" / "run" / "final"), _weights(tmp_path / "b" / "run" / "final")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from the straight run by {worst}"
    sft = _weights(json.load(open(tmp_path / "a" / "run" / "config.json"))["model"])
    moved = max((a[k] - sft[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the runs should have changed the weights at all"
    steps = [r["step"] for r in read_metrics(tmp_path / "b")]
    assert steps == list(range(20)), "metrics.jsonl continues across the resume"


def test_checkpoint_files_load_without_pickle(tmp_path, cache_dir):
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "6", "--checkpoint-every", "2", "--sync"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step-000004", "step-000006"], "the two newest are kept"
    for folder in (root / "step-000006" / "policy", tmp_path / "run" / "final"):
        mode = os.stat(folder / "model.safetensors").st_mode & 0o777
        assert mode == 0o666 & ~_umask(), f"{folder}/model.safetensors has mode {oct(mode)}"
    ckpt = root / "step-000006"
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    torch.load(ckpt / "rng.pt", weights_only=True)
    state = json.load(open(ckpt / "state.json"))
    assert state["step"] == 6 and json.load(open(ckpt / "buffer.json"))["items"]
    assert os.path.isfile(ckpt / "policy" / "model.safetensors") and os.path.isfile(ckpt / "ref" / "model.safetensors")


@pytest.mark.parametrize("policy", ["restart", "abort"])
def test_killed_searcher_restart_or_abort(tmp_path, cache_dir, policy):
    args = tiny_args(tmp_path, cache_dir, "--steps", "100000", "--on-searcher-failure", policy, "--num-searchers", "2")
    proc = _popen(args)
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"step\s+\d+ \| loss", line):
            break
    searchers = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert len(searchers) == 2
    os.kill(searchers[0], signal.SIGKILL)
    if policy == "abort":
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "searcher-0" in rest and "died with exit code -9" in rest
    else:
        for line in proc.stdout:  # the run goes on: wait for the restart and a few more steps
            lines.append(line)
            if "restarting it (1/3)" in line:
                break
        steps_after = 0
        for line in proc.stdout:
            if re.search(r"step\s+\d+ \| loss", line):
                steps_after += 1
                if steps_after == 3:
                    break
        assert steps_after == 3, "the run should continue after the restart"
        new = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(new) == 2 and searchers[0] not in new
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
        searchers = searchers + new
    watchdog.cancel()
    time.sleep(0.5)
    assert not [p for p in searchers if _alive(p)], "processes outlived the run"


RESTART_BEFORE_THE_JOB = """
import sys, time
sys.path.insert(0, {root!r})
from config import Config
from searcher import Searchers
if __name__ == "__main__":
    cfg = Config(num_searchers=1, backend="hf", searcher_device="cpu", searcher_dtype="float32", on_searcher_failure="restart")
    searchers = Searchers(cfg)
    searchers.procs[0].kill()  # searcher-0 dies before it reads its job
    searchers.procs[0].join()
    searchers.job, searchers.devices = {{"cfg": cfg, "task": None, "step": 0, "pad": b"x" * 1_000_000}}, ["cpu"]
    searchers.send_job(0)  # (1 MB, more than a pipe holds: the queue's sender thread waits for a reader)
    time.sleep(0.5)
    searchers.restart(0, silent=0.0)  # what check_alive does to a dead searcher
    searchers.close()
    print("closed", flush=True)
"""


def test_a_searcher_restarted_before_it_read_its_job_does_not_hold_the_trainers_exit(tmp_path):
    """A searcher killed while its job was still in the pipe (slow imports on a busy machine) is restarted; the job it
    never read does not keep the trainer from exiting (multiprocessing joins a queue's sender thread at exit)."""
    script = tmp_path / "restart.py"
    script.write_text(RESTART_BEFORE_THE_JOB.format(root=ROOT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr


def test_nonfinite_steps_are_skipped_then_abort(tmp_path, cache_dir):
    import config
    import run_gsm8k
    import tba
    from searcher import SyncSearch
    from ops.bookkeeping import NonFiniteError
    cfg = config.parse_config(run_gsm8k.GSM8KConfig, run_gsm8k.PRESETS, [
        "--preset", "tiny", "--cache-dir", str(cache_dir), "--run-dir", str(tmp_path / "run"), "--sync",
        *TINY_SFT, "--eval-size", "4",
        "--max-new-tokens", "8", "--steps", "50", "--max-nonfinite-steps", "3"])
    os.makedirs(cfg.run_dir)
    task = run_gsm8k.make_task(cfg)
    before = _weights(cfg.model)
    with pytest.raises(NonFiniteError, match="3 steps in a row"):
        tba.train(cfg, _NaNTask(task.prompts, task.metas, task.eval_prompts, task.eval_metas), SyncSearch(cfg))
    rows = read_metrics(tmp_path)
    assert [r["grad/skipped"] for r in rows] == [1, 1], "the two logged steps were skipped"
    assert not os.path.exists(tmp_path / "run" / "checkpoints"), "no checkpoint written from a failing run"
    cfg.run_dir = str(tmp_path / "unscored")
    os.makedirs(cfg.run_dir)
    with pytest.raises(RunError, match=r"no reward scored any of the last \d+ completions"):  # (the wait for data ends)
        tba.train(cfg, _UnscoredTask(task.prompts, task.metas, task.eval_prompts, task.eval_metas), SyncSearch(cfg))
    assert before.keys() and all(torch.isfinite(t).all() for t in before.values())


class _NaNTask(GSM8KTask):
    """Every reward infinite: every loss non-finite. (A NaN reward would mean "unscored": that completion is dropped.)"""

    def make_scorer(self, device="cpu"):
        return lambda prompts, completions, metas, **context: [float("inf")] * len(completions)


class _UnscoredTask(GSM8KTask):
    """No reward scores anything (every one None, for every completion)."""

    def make_scorer(self, device="cpu"):
        return lambda prompts, completions, metas, **context: [float("nan")] * len(completions)


def test_unwritable_run_dir_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--run-dir", str(blocker / "run")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--run-dir" in out.stderr and "not writable" in out.stderr
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--resume", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no checkpoint there" in out.stderr


def test_tokenizer_without_pad_or_eos(tmp_path):
    from ops.models import load_model
    from transformers import GPT2Config, GPT2LMHeadModel
    tokenizer = _bpe_tokenizer("gpt_neox", ["one two three four five six seven"] * 20)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "m")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "m")
    _, loaded = load_model(str(tmp_path / "m"))
    assert loaded.pad_token_id == loaded.eos_token_id, "no pad token: EOS pads (padding is masked anyway)"
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="has no EOS token"):
        load_model(str(tmp_path / "m"))


def test_long_prompts_are_skipped_and_counted(capsys):
    from ops.models import drop_long_prompts
    tokenizer = _bpe_tokenizer("gpt_neox", ["short words and a much longer question here"] * 20)
    rows = [{"question": q, "answer": "#### 1"} for q in ("short", "a much longer question here " * 20, "words")]
    task = drop_long_prompts(GSM8KTask.from_rows(rows, rows), tokenizer, max_tokens=40)
    assert len(task.prompts) == 2 and len(task.metas) == 2 and len(task.eval_prompts) == 2
    assert "skipped 1 of 3 training" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="leaves no training"):
        drop_long_prompts(GSM8KTask.from_rows(rows, rows), tokenizer, max_tokens=2)


def test_gsm8k_download_error_when_offline(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request
    from rewards import gsm8k_path

    def offline(url, filename):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlretrieve", offline)
    with pytest.raises(ConfigError, match="could not download GSM8K train .*pass --data-dir"):
        gsm8k_path("train", "", str(tmp_path))
    assert gsm8k_path("test", "/some/dir", str(tmp_path)) == "/some/dir/test.jsonl", "--data-dir wins, no download"


def _cli(tmp_path, *flags):
    """run_gsm8k's entry point in this process: (exit code, stderr lines)."""
    import multiprocessing
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        old, sys.stderr = sys.stderr, f
        try:
            rc = gsm8k_cli(list(flags))
        finally:
            sys.stderr = old
    assert not multiprocessing.active_children(), "a refused run spawned processes"
    return rc, err.read_text().strip().splitlines()


GPUS = torch.cuda.device_count()


@pytest.mark.parametrize("flags,message", [
    (["--responses-per-prompt", "0"], "--responses-per-prompt must be > 0"),
    (["--micro-batch-prompts", "0"], "--micro-batch-prompts must be > 0"),
    (["--log-every", "0"], "--log-every must be > 0"),
    (["--reward-temp", "0"], "--reward-temp must be a finite number > 0"),
    (["--prompts-per-search", "0"], "--prompts-per-search must be > 0"),
    (["--micro-batch", "0"], "--micro-batch must be > 0"),
    (["--searcher-device", f"cuda:{GPUS}"], f"--searcher-device cuda:{GPUS}: {GPUS} CUDA device(s) visible"),
    (["--device", f"cuda:{GPUS}"], f"--device cuda:{GPUS}: {GPUS} CUDA device(s) visible"),  # (one past the last)
    (["--device", "gpu"], "--device gpu: expected auto, cpu or cuda:N"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--capacity-per-prompt", "0"], "--capacity-per-prompt must be > 0"),
    (["--trainer-threads", "0"], "--trainer-threads must be > 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be > 0"),
    (["--objective", "ppo"], "--objective must be one of tb, rloo, grpo, dr_grpo"),
    (["--lr-decay", "step"], "--lr-decay must be one of cosine, linear"),
    (["--tb-correction", "ppo"], "--tb-correction must be one of none, trust-region"),
    (["--clip-eps", "1.5"], "--clip-eps must be in (0, 1)"),
    (["--model", "models/does-not-exist/v1"], "--model models/does-not-exist/v1: no such directory, and not a hub id"),
])
def test_every_bad_flag_is_one_line_before_anything_starts(tmp_path, flags, message):
    rc, err = _cli(tmp_path, "--run-dir", str(tmp_path / "run"), *flags)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not os.path.exists(tmp_path / "run"), "nothing is written for a refused run"


def test_model_directory_without_config_is_named(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    rc, err = _cli(tmp_path, "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path / "not-a-model"))
    assert rc == 2 and err == [f"error: --model {tmp_path / 'not-a-model'} is a directory without config.json; "
                               "expected a save_pretrained directory or a hub id"]


def test_data_files_utf8_bom_nonutf8_and_long_lines(tmp_path):
    from rewards import MAX_LINE_BYTES
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "q", "answer": "#### 1"}).encode() + b"\n")
    assert load_gsm8k(str(bom)) == [{"question": "q", "answer": "#### 1"}], "a UTF-8 byte-order mark is fine"
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(ConfigError, match=r"latin1.jsonl:2: not UTF-8"):
        load_gsm8k(str(latin))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "x" * (MAX_LINE_BYTES + 10), "answer": "#### 1"}) + "\n")
    with pytest.raises(ConfigError, match=r"long.jsonl:1: line longer than"):
        load_gsm8k(str(long))


def test_bad_data_dir_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), "--preset", "paper", "--device", "cpu",
                          "--searcher-device", "cpu", "--data-dir", str(bad), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == f"error: {bad / 'train.jsonl'}:2: not valid JSON " \
                                                         "(Expecting property name enclosed in double quotes)"


def test_run_dir_belongs_to_one_run(tmp_path, cache_dir):
    proc = _start_and_wait_for_training(tmp_path, cache_dir)
    try:
        second = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "2"), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip() == f"error: --run-dir {tmp_path / 'run'} is in use by another run (pid {proc.pid})"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "the first run was not disturbed by the second"
    # the directory now holds a run: a new one needs --resume or --overwrite, and a refused run writes nothing
    snapshot = lambda: {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
                        for p in (tmp_path / "run").rglob("*")}
    before = snapshot()
    assert (tmp_path / "run" / ".lock").read_text() == f"{proc.pid}\n"
    rc, err = _cli(tmp_path, *tiny_args(tmp_path, cache_dir)[2:])
    assert rc == 2 and err[0].startswith(f"error: --run-dir {tmp_path / 'run'} holds an earlier run (config.json, "
                                          "metrics.jsonl, samples.jsonl, checkpoints); continue it with --resume")
    assert snapshot() == before, "the refused run changed the run directory (its .lock keeps the first run's pid)"
    rc, err = _cli(tmp_path, "--resume", str(tmp_path / "nowhere"))
    assert rc == 2 and err[0].startswith(f"error: --resume {tmp_path / 'nowhere'}: no checkpoint there")
    assert not (tmp_path / "nowhere").exists(), "a refused resume left a directory behind"
    rc, err = _cli(tmp_path, "--resume", str(tmp_path / "run"), "--run-dir", str(tmp_path / "elsewhere"))
    assert rc == 2 and err == [f"error: --resume {tmp_path / 'run'} continues that run in its own directory; "
                               f"drop --run-dir {tmp_path / 'elsewhere'}"]


def test_resume_refuses_a_changed_run_accepts_harmless_changes_and_falls_back(tmp_path, cache_dir):
    run = tmp_path / "run"
    first = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "6", "--checkpoint-every", "2", "--eval-every", "0"),
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    resume = ["--resume", str(run), *tiny_args(tmp_path, cache_dir)[4:6], *tiny_args(tmp_path, cache_dir)[8:]]
    rc, err = _cli(tmp_path, *resume, "--lr", "1e-4", "--objective", "rloo")
    assert rc == 2 and err == [f"error: --resume {run}: the run was saved with --lr 2e-05 --objective tb, "
                               "now --lr 0.0001 --objective rloo; pass --allow-config-change to continue anyway"]
    rc, err = _cli(tmp_path, *resume, "--sync")
    assert rc == 2 and ("the run was saved with --sync-every 4 --m 0.95 --sync False, now --sync-every 1 --m 1.0 "
                        "--sync True") in err[0], err  # (--sync sets k = 1 and m = 1)
    # the newest checkpoint is corrupt: resume names the file and uses the one before; --steps may change
    (run / "checkpoints" / "step-000006" / "policy" / "model.safetensors").write_bytes(b"not a safetensors file")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run_gsm8k.py"), *resume, "--steps", "8", "--log-every", "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"cannot resume from {run / 'checkpoints' / 'step-000006' / 'policy' / 'model.safetensors'}" in out.stdout
    assert "resuming from" in out.stdout and "step-000004 at step 4" in out.stdout
    changes = next(line for line in out.stdout.splitlines() if line.startswith("resume: changed since the checkpoint: "))
    assert "--steps 6 -> 8" in changes and "--log-every 1 -> 2" in changes, changes
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7], "cut back to the checkpoint that was used, then made again: each step once"
    names = sorted(os.listdir(run / "checkpoints"))
    assert names == ["latest", "step-000006", "step-000008"], "the newest two by time: the rewritten 6 and 8"
    assert open(run / "checkpoints" / "latest").read().strip() == "step-000008"


def test_searchers_exit_when_the_trainer_is_killed_with_a_full_queue(tmp_path, cache_dir):
    # merging only at step 0 leaves the searcher blocked on a full queue of 2 batches
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "100000", "--sync-every", "100000", "--queue-size", "2"))
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    for line in proc.stdout:
        if re.search(r"step\s+5 \| loss", line):
            break
    watchdog.cancel()
    time.sleep(3)  # the searcher fills its queue and waits on put()
    family = _descendants(proc.pid)
    assert len(family) >= 2, "a searcher and multiprocessing's resource tracker"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    left = _wait_gone(family, 15)
    assert not left, f"processes outlived the trainer: {left}"


def test_searchers_exit_when_the_trainer_is_killed_before_their_job(tmp_path):
    proc, family = _start_in_the_warm_start(tmp_path)
    assert family, "the searcher starts before the warm start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not _wait_gone(family, 15), "processes outlived the trainer"


def test_ctrl_c_during_the_sft_warm_start_exits_cleanly(tmp_path):
    proc, family = _start_in_the_warm_start(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:  # (a run that ignored the signal is not left behind: one ran on for an hour after a failure here)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in rest, rest[-2000:]
    assert rest.strip().splitlines()[-1] == "stopped by SIGINT; nothing to resume; all processes stopped"
    left = os.listdir(tmp_path / "cache") if os.path.exists(tmp_path / "cache") else []
    assert not [n for n in left if ".tmp" in n], "no half-written warm start is left"
    assert not _wait_gone(family, 15)


def test_a_stop_signal_is_not_swallowed_by_a_librarys_except_exception(monkeypatch):
    """A Ctrl-C that lands while tqdm starts its monitor thread (it catches Exception there, and warns) still stops
    the run: Stopped is a BaseException, as KeyboardInterrupt is."""
    import tqdm.std

    from config import Stopped

    def signal_now(*args):
        raise Stopped(signal.SIGINT)
    monkeypatch.setattr(tqdm.std, "TMonitor", signal_now)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor", None)
    with pytest.raises(Stopped):
        tqdm.std.tqdm(total=1, disable=False, file=open(os.devnull, "w"))


def test_a_stopped_searcher_ends_the_run_naming_it(tmp_path, cache_dir):
    # SIGSTOP the searcher as soon as it exists: the initial fill never completes
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "50", "--searcher-timeout", "15"))
    family = []
    deadline = time.time() + 60
    while not family and time.time() < deadline:
        family = [p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        time.sleep(0.05)
    os.kill(family[0], signal.SIGSTOP)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, rest[-2000:]
    assert re.search(r"error: searcher-0 \(pid \d+\) sent nothing for \d+ s \(--searcher-timeout 15.0\)", rest), rest[-2000:]
    assert not _wait_gone(family, 15), "the stopped searcher was not cleaned up"


def test_an_empty_sync_is_logged(tmp_path, capsys):
    import tba
    from types import SimpleNamespace

    from config import Config
    from ops.bookkeeping import Bookkeeping

    class Silent:
        def poll(self):
            return [], []
    run = SimpleNamespace(searchers=Silent(), buffer=ReplayBuffer(4), start=0,
                          cfg=Config(run_dir=str(tmp_path), resume="x", report_to="none", sync_every=4, fresh_rounds=False,
                                     initial_completions=64))  # (resume: no metrics file made)
    run.books = Bookkeeping(run)
    tba.merge(run, 8)
    assert "sync at step 8: no new trajectories from the searchers" in capsys.readouterr().out
    assert run.books.counters.fresh_count == 0


def test_an_inconsistent_buffer_writes_no_checkpoint_and_keeps_the_last(tmp_path):
    from types import SimpleNamespace

    from buffer import Trajectory
    from config import Config, RunError
    from ops.bookkeeping import Bookkeeping
    last = tmp_path / "checkpoints" / "step-000004"
    last.mkdir(parents=True)
    (last / "state.json").write_text("{}")
    buffer = ReplayBuffer(4)
    buffer.add([Trajectory(prompt_id=0, response_ids=(1,), reward=0.0, policy_version=0)])
    buffer.latest[0] = [Trajectory(prompt_id=0, response_ids=(1,), reward=0.0, policy_version=0)]  # not the stored one
    run = SimpleNamespace(buffer=buffer, start=0, policy=torch.nn.Linear(2, 2), ref=torch.nn.Linear(2, 2),
                          cfg=Config(run_dir=str(tmp_path), resume="x", report_to="none"))
    with pytest.raises(RunError, match=r"^no checkpoint written at step 8: replay buffer invariant broken: every "
                                       r"latest-round trajectory is stored; the last complete one stays in "):
        Bookkeeping(run).save(8)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004"]


@pytest.mark.parametrize("report_to", ["tensorboard", "wandb"])
def test_metrics_reach_tensorboard_and_wandb_by_their_names_and_samples_are_kept(tmp_path, cache_dir, report_to):
    pytest.importorskip(report_to)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # (W&B's offline mode: files only)
    services = lambda: set(subprocess.run(["pgrep", "-f", "wandb"], capture_output=True, text=True).stdout.split())
    before = services()
    out = subprocess.run(tiny_args(tmp_path, cache_dir, "--steps", "4", "--report-to", report_to), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    if report_to == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
        losses = [(e.step, e.value) for e in events.Scalars("loss/train")]
        assert losses == [(r["step"], pytest.approx(r["loss/train"], rel=1e-6)) for r in rows]
        assert "eval/accuracy" in events.Tags()["scalars"]
    else:
        [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
        history = _wandb_history(run_file.read_bytes())
        logged, losses = [v for k, v in history if k == "loss/train"], [r["loss/train"] for r in rows]
        assert all(v in losses for v in logged) and all(v in logged for v in losses), "the same numbers, by name"
        # (each step's value appears twice in the file: as history and as the running summary)
        assert {"eval/accuracy", "staleness/mean", "perf/busy"} <= {k for k, _ in history}
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 4} and len(samples) == 2 * 20, "every held-out prompt, at each evaluation"
    assert set(samples[0]) == {"step", "prompt", "completion", "reward"}
    assert not [p for p in services() - before if _alive(int(p))], "W&B's service outlived the run"


def _wandb_history(data):
    """(name, value) of every history item in a W&B offline run file, read from its protobuf bytes (an item is
    field 2, the name, then field 16, the value as JSON; wandb 0.31 ships no reader for these files)."""
    items = []
    for m in re.finditer(rb"\x12([\x01-\x7f])", data):
        end = m.end() + m.group(1)[0]
        if data[end:end + 2] == b"\x82\x01" and data[end + 2] < 0x80:
            try:
                items.append((data[m.end():end].decode(), json.loads(data[end + 3:end + 3 + data[end + 2]])))
            except (UnicodeDecodeError, ValueError):
                continue
    return items


def test_an_evaluation_holds_the_searchers_and_a_stop_still_ends_them():
    """Searchers.pause(True) (the trainer evaluates) holds a searcher's loop in link.alive() until pause(False);
    a stop ends the wait; a held searcher is not taken for a silent one."""
    import multiprocessing
    from searcher import QueueLink
    ctx = multiprocessing.get_context("spawn")
    stop, pause = ctx.Event(), ctx.Event()
    link = QueueLink(None, None, None, stop, pause, os.getppid())
    pause.set()
    answers = []
    waiter = threading.Thread(target=lambda: answers.append((link.alive(), time.time())))
    waiter.start()
    time.sleep(0.3)
    assert not answers, "held while the trainer evaluates"
    released = time.time()
    pause.clear()
    waiter.join(timeout=5)
    assert answers and answers[0][0] and answers[0][1] >= released
    pause.set()
    stop.set()
    assert link.alive() is False, "a stop ends the wait"


# -----------------------------------------------------------------------------
# Never lose work, part 2: a full disk, a second signal, a closed terminal, kills and resumes

HAS_UNSHARE = subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def _run_on_a_small_disk(tmp_path, cache_dir, size, *flags):
    """A tiny run whose run directory is on a tmpfs of `size` (a private mount, this test's alone): its exit code,
    its output, and the files left on that disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = " ".join(tiny_args(disk, cache_dir, *flags))
    script = f"mount -t tmpfs -o size={size} tmpfs {disk} && {cmd} 2>&1; echo EXIT=$?; find {disk} | sort"
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600).stdout
    output, _, listing = out.partition("EXIT=")
    code, *files = listing.splitlines()
    return int(code), output, [os.path.relpath(f, disk / "run") for f in files if f.startswith(str(disk / "run") + "/")]


@pytest.mark.skipif(not HAS_UNSHARE, reason="needs a private mount namespace (unshare -m, as root)")
@pytest.mark.parametrize("size,kept", [("20m", ["step-000002", "step-000004"]), ("3m", [])])
def test_a_full_disk_is_one_line_and_keeps_the_last_complete_checkpoint(tmp_path, cache_dir, size, kept):
    """The disk fills while a checkpoint is written (the third, or the first): the run ends with one line naming the
    checkpoint and the space needed against free, exit 1; the checkpoints before it stay whole; nothing half-written."""
    code, output, files = _run_on_a_small_disk(tmp_path, cache_dir, size, "--steps", "12", "--checkpoint-every", "2")
    assert code == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert re.fullmatch(r"error: cannot write \S+/checkpoints/step-\d{6}: no space left on the device "
                        r"\([\d.]+ MB needed, [\d.]+ MB free\)", last), output[-3000:]
    assert "Traceback" not in output
    assert sorted(f.split("/")[1] for f in files if f.startswith("checkpoints/step-") and f.count("/") == 1) == kept
    assert all(f"checkpoints/{c}/state.json" in files for c in kept) and not [f for f in files if ".tmp" in f]


def test_a_second_signal_while_stopping_is_out_at_once_naming_the_last_complete_checkpoint(tmp_path, cache_dir):
    proc = _popen(tiny_args(tmp_path, cache_dir, "--steps", "100000", "--checkpoint-every", "2"))
    deadline = time.time() + 150
    while not os.path.exists(tmp_path / "run" / "checkpoints" / "latest") and time.time() < deadline:
        time.sleep(0.1)
    family = _descendants(proc.pid)
    t0 = time.time()
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)  # (while the stop's checkpoint is written, or just before)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.time() - t0 < 10, rest[-2000:]
    last = rest.strip().splitlines()[-1]
    match = re.fullmatch(r"stopped by SIGINT; (?:checkpoint (\S+); continue with --resume \S+|the last complete "
                         r"checkpoint is (\S+): continue with --resume \S+); all processes stopped", last)
    assert match, last
    from ops.checkpoint import checkpoints_newest_first
    assert (match.group(1) or match.group(2)) == checkpoints_newest_first(str(tmp_path / "run"))[0]
    assert not [n for n in os.listdir(tmp_path / "run" / "checkpoints") if ".tmp" in n]
    assert not _wait_gone(family, 10), "processes outlived the run"


def test_a_checkpoint_from_before_the_query_rename_resumes(tmp_path, cache_dir):
    """A checkpoint written with the names of before the query -> prompt rename (Trajectory.query_id, the config's
    responses_per_query, capacity_per_query, micro_batch_queries) resumes (it ended "no checkpoint could be read")."""
    args = tiny_args(tmp_path, cache_dir)
    out = subprocess.run(args + ["--steps", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    old = {"prompt_id": "query_id", "responses_per_prompt": "responses_per_query", "capacity_per_prompt": "capacity_per_query",
           "micro_batch_prompts": "micro_batch_queries"}
    path = tmp_path / "run" / "checkpoints" / "step-000002"
    buffer, state = json.loads((path / "buffer.json").read_text()), json.loads((path / "state.json").read_text())
    buffer["items"] = [{old.get(k, k): v for k, v in r.items()} for r in buffer["items"]]
    state["config"] = {old.get(k, k): v for k, v in state["config"].items()}
    assert "query_id" in buffer["items"][0] and "responses_per_query" in state["config"]
    (path / "buffer.json").write_text(json.dumps(buffer))
    (path / "state.json").write_text(json.dumps(state))
    resumed = subprocess.run(args[:args.index("--run-dir")] + args[args.index("--run-dir") + 2:]
                             + ["--resume", str(tmp_path / "run"), "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_imports_go_one_way_even_through_function_local_imports():
    """No cycle among the project's modules, counting every import statement (function-local ones included)."""
    import ast
    import glob
    files = [os.path.relpath(f, ROOT) for pattern in ("*.py", "ops/*.py", "tasks/*.py", "bench/*.py")
             for f in glob.glob(os.path.join(ROOT, pattern))]
    modules = {f[:-3].replace(os.sep, "."): f for f in files}
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        imports[name] = found - {name}

    def reaches(start, target, seen):
        return any(m == target or (m not in seen and reaches(m, target, seen | {m})) for m in imports[start])
    assert not [m for m in modules if reaches(m, m, {m})], "a cycle of imports"


def test_a_crashed_writes_leftovers_are_removed_when_a_run_claims_its_directory(tmp_path):
    """What a crash mid-write leaves (a step-N.tmpPID checkpoint folder, a file.tmpPID) is removed when a run claims
    the directory; complete checkpoints and what is not a leftover stay."""
    from config import Config
    from ops.checkpoint import checkpoints_newest_first, prepare_run_dir, release_run_dir, remove_leftovers
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "checkpoints" / "step-000004" / "state.json").write_text("{}")
    (run / "checkpoints" / "step-000006.tmp4242").mkdir()
    (run / "checkpoints" / "step-000006.tmp4242" / "model.safetensors").write_text("cut")
    (run / "notes.txt").write_text("mine")
    remove_leftovers(str(run))
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000004"] and (run / "notes.txt").exists()
    assert checkpoints_newest_first(str(run)) == [str(run / "checkpoints" / "step-000004")]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "result.json.tmp77").write_text("{")
    (fresh / "final.tmp77").mkdir()
    try:
        prepare_run_dir(Config(run_dir=str(fresh)), run_dir_given=True)
    finally:
        release_run_dir()
    assert sorted(os.listdir(fresh)) == [".lock"], "a run claiming its directory removes a crash's leftovers"


def test_a_second_signal_during_the_checkpoint_write_is_a_stop_not_a_failed_write(tmp_path, monkeypatch):
    """The second Ctrl-C landing inside save_checkpoint (here: raised where the files are made readable) ends it as
    a stop (Stopped, exit 130 and the last complete checkpoint named by the launcher), not as "cannot write ...:
    stopped by SIGINT" (exit 1, naming the checkpoint that does not exist); nothing half-written stays."""
    import ops.checkpoint
    from config import Stopped
    import tiny
    policy = tiny.tiny_llama(tiny.word_tokenizer(["a", "b"]), 32, 1, 16, seed=0)
    ref, opt = tiny.tiny_llama(tiny.word_tokenizer(["a", "b"]), 32, 1, 16, seed=0), torch.optim.AdamW(policy.parameters())

    def interrupted(path):
        raise Stopped(signal.SIGINT)
    monkeypatch.setattr(ops.checkpoint, "respect_umask", interrupted)
    with pytest.raises(Stopped) as stopped:
        ops.checkpoint.save_checkpoint(str(tmp_path), 7, policy, ref, opt, ReplayBuffer(4), {}, keep=2)
    assert stopped.value.exit_code == 130 and "cannot write" not in str(stopped.value)
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if ".tmp" in n]


def test_metrics_stay_strict_json_with_each_step_once_after_kills_and_resumes(tmp_path, cache_dir):
    """Killed twice (SIGKILL to the whole group, once with a cut line appended to each file, as a crash mid-write
    leaves it) and resumed each time: metrics.jsonl and samples.jsonl are strict JSON with each step once."""
    run = tmp_path / "run"
    args = tiny_args(tmp_path, cache_dir, "--steps", "14", "--checkpoint-every", "3", "--eval-every", "5")
    for stop_after, cut in ((7, True), (11, False)):
        proc = _popen(args + (["--resume", str(run)] if stop_after > 7 else []))
        deadline = time.time() + 150
        while time.time() < deadline and max((r["step"] for r in _lines(run / "metrics.jsonl")), default=-1) < stop_after:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if cut:
            with open(run / "metrics.jsonl", "a") as f:
                f.write('{"step": 8, "loss/tr')
            with open(run / "samples.jsonl", "a") as f:
                f.write('{"step": 5, "prom')
    out = subprocess.run(args + ["--resume", str(run)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path, evals=True)  # (strict: a bare NaN or a cut line fails here)
    assert [r["step"] for r in rows] == list(range(15)), "each step once, then the final evaluation"
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    steps = [s["step"] for s in samples]
    assert {0, 5, 10, 14} <= set(steps) and all(steps.count(s) == 20 for s in set(steps)), \
        "each evaluation's 20 held-out prompts once (a resume evaluates at its first step too)"
    assert not [n for n in os.listdir(run / "checkpoints") if ".tmp" in n]


def _lines(path):
    """The whole JSON lines of a file being written (a cut last line skipped)."""
    out = []
    for line in open(path) if os.path.exists(path) else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


# -----------------------------------------------------------------------------
# The shared weights' lock (issue 38.3: a searcher killed inside its pull blocked every later publish)

class _StuckLoad:
    """A pull target whose load_state_dict says it has begun, then never returns (a searcher killed mid-pull)."""

    def __init__(self, started):
        self.started = started

    def load_state_dict(self, tensors):
        self.started.set()
        time.sleep(3600)


def _pull_stuck(shared, tensors, started):
    shared.pull(_StuckLoad(started), tensors, have_version=-1)


def test_a_searcher_killed_holding_the_weights_lock_blocks_nobody():
    """A searcher killed while it holds the SharedWeights lock (inside its pull) used to block the trainer's next
    publish forever; now the publish takes the lock over within a fraction of a second, and a live holder that
    keeps it past --searcher-timeout ends the wait with SearcherDied naming its pid."""
    import torch.multiprocessing as mp
    from config import SearcherDied
    from ops.weights import SharedWeights
    ctx = mp.get_context("spawn")
    model = torch.nn.Linear(3, 2)
    shared = SharedWeights(ctx, timeout_s=3.0)
    shared.allocate(model, version=0, devices=["cpu"], dtype=torch.float32)
    shared.publish(model, version=1)
    started = ctx.Event()
    child = ctx.Process(target=_pull_stuck, args=(shared, shared.tensors["cpu"], started), daemon=True)
    child.start()
    assert started.wait(60), "the child began its pull"
    with pytest.raises(SearcherDied, match=f"pid {child.pid}"):  # alive and holding it: a bounded wait, then named
        shared.publish(model, version=2)
    assert shared.version.value == 1
    child.kill()
    child.join(10)
    t0 = time.time()
    with torch.no_grad():
        model.weight.fill_(5.0)
    shared.publish(model, version=3)  # the dead holder's lock is taken over
    assert time.time() - t0 < 2.0 and shared.version.value == 3
    assert shared.holder.value == 0 and shared.lock.acquire(timeout=1), "and released again"
    shared.lock.release()
    target = torch.nn.Linear(3, 2)
    assert shared.pull(target, shared.tensors["cpu"], have_version=1) == 3 and torch.all(target.weight == 5.0)


# -----------------------------------------------------------------------------
# A simulated GPU machine (issue 38: the GPU branches no CPU test reached)

class _RecordedProcess:
    """Stands in for a spawned searcher: keeps the arguments the process would be spawned with."""

    def __init__(self, target, name, daemon, args):
        self.name, self.pid, self.exitcode, self.args = name, 0, None, args

    def start(self):
        pass

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


class _Queue(list):
    """Stands in for a searcher's queues: what was put, unpickled."""
    put = list.append

    def cancel_join_thread(self):
        pass

    close = cancel_join_thread


def test_on_simulated_gpus_each_searcher_gets_its_own_gpus_copy_a_restarted_one_too_and_the_plan_counts_it(monkeypatch):
    """Three simulated GPUs, --backend hf, two searchers: the trainer's shared copies of the policy and the reference go
    to cuda:1 and cuda:2 in bfloat16, exactly the bytes the memory plan counts there; each searcher's job carries its
    own GPU's copy and no other, and a searcher restarted after the copies were allocated is spawned with none of them
    (it opened a CUDA context on every GPU) and receives its own GPU's copy with its job."""
    from config import Config
    from ops.devices import resolve_devices
    from ops.memory import BYTES, add_shared_copies
    from searcher import Searchers
    from tests.helpers import simulated_gpus
    allocated = simulated_gpus(monkeypatch, 3)
    cfg = resolve_devices(Config(num_searchers=2, backend="hf", on_searcher_failure="restart"), torch.cuda.device_count())
    assert (cfg.device, cfg.searcher_devices, cfg.searcher_dtype) == ("cuda:0", ["cuda:1", "cuda:2"], "bfloat16")
    spawn = torch.multiprocessing.get_context("spawn")
    recorded = types.SimpleNamespace(Event=spawn.Event, Value=spawn.Value, Lock=spawn.Lock, Process=_RecordedProcess,
                                     Queue=lambda maxsize: _Queue())  # (searchers' processes and queues recorded)
    monkeypatch.setattr(torch.multiprocessing, "get_context", lambda method: recorded)
    searchers = Searchers(cfg)
    try:
        policy, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        searchers.start(cfg, None, policy, ref, None, step=0)
        params = sum(t.numel() for t in policy.state_dict().values())
        processes = [("trainer", cfg.device, {})]
        add_shared_copies(cfg, types.SimpleNamespace(params=params), processes)
        planned = {device: est["weights shared with its searchers"] for _, device, est in processes[1:]}
        assert dict(allocated) == planned == {"cuda:1": 2 * params * BYTES["bfloat16"], "cuda:2": 2 * params * BYTES["bfloat16"]}
        for rank, device in enumerate(["cuda:1", "cuda:2"]):
            [job] = searchers.jobs[rank]
            assert all(job["weights"][k] is searchers.weights[k].tensors[device] for k in ("policy", "ref"))
            assert all(t.dtype == torch.bfloat16 for t in job["weights"]["policy"].values())
        searchers.procs[1].exitcode = 1  # searcher-1 dies: restarted
        searchers.check_alive()
        restarted = searchers.procs[1]
        spawned_with = restarted.args[5]  # (rank, jobs, queue, stop, pause, weights, parent pid): pickled as __getstate__
        assert searchers.restarts == 1 and all(w.__getstate__()["tensors"] == {} for w in spawned_with.values())
        [job] = searchers.jobs[1]
        assert all(job["weights"][k] is searchers.weights[k].tensors["cuda:2"] for k in ("policy", "ref"))
    finally:
        searchers.close()


def test_dev_shm_holds_what_the_plan_counts_for_the_host_copies():
    """On this CPU machine the trainer's shared copies (policy and reference, in the searchers' dtype) are in /dev/shm:
    what /dev/shm loses when they are allocated is what ops/memory.shared_memory_bytes counts for them (within 5%)."""
    import shutil

    import torch.multiprocessing as mp
    from config import Config
    from ops.memory import SHM, SHM_FLOOR, shared_memory_bytes
    from ops.weights import SharedWeights, allocate_shared
    cfg = Config(num_searchers=2, backend="hf", searcher_device="cpu", searcher_dtype="float32")
    policy, ref = torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)  # 4.2 M parameters: 16.8 MB a copy
    params = sum(t.numel() for t in policy.state_dict().values())
    ctx = mp.get_context("spawn")
    weights = {kind: SharedWeights(ctx) for kind in ("policy", "ref")}
    free = shutil.disk_usage(SHM).free
    allocate_shared(cfg, weights, policy, ref, 0, 0)
    used = free - shutil.disk_usage(SHM).free
    planned = shared_memory_bytes(cfg, params) - SHM_FLOOR
    assert planned == 2 * params * 4 and abs(used - planned) <= 0.05 * planned, (used, planned)


def test_a_run_dir_that_trained_nothing_is_started_afresh_one_that_trained_is_refused(tmp_path, capsys):
    """A start that ended before its first step (a reward that raised, a model that would not load) leaves config.json,
    metrics.jsonl and samples.jsonl: the same command starts afresh there (it asked for --overwrite). A step in
    metrics.jsonl, a checkpoint or a result is an earlier run: refused, naming --resume and --overwrite."""
    from config import Config
    from ops.checkpoint import prepare_run_dir, release_run_dir

    def claim(run, extra):
        run.mkdir()
        (run / "config.json").write_text("{}")
        (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n' + extra.get("metrics.jsonl", ""))
        for name in set(extra) - {"metrics.jsonl"}:
            (run / name).mkdir() if name == "checkpoints" else (run / name).write_text(extra[name])
        try:
            prepare_run_dir(Config(run_dir=str(run)), True)
        finally:
            release_run_dir()
    claim(tmp_path / "failed", {})
    assert f"{tmp_path / 'failed'}: an earlier start ended before its first step (config.json, metrics.jsonl); " \
           "starting afresh there" in capsys.readouterr().out
    assert not (tmp_path / "failed" / "config.json").exists(), "what the failed start wrote is gone"
    for i, earlier in enumerate([{"metrics.jsonl": '{"step": 0, "loss/train": 0.5}\n'}, {"checkpoints": ""},
                                 {"result.json": "{}"}]):
        with pytest.raises(ConfigError, match=r"holds an earlier run .*continue it with --resume .*, or pass --overwrite"):
            claim(tmp_path / f"run{i}", earlier)
