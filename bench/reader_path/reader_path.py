#!/usr/bin/env python3
"""(A copy of the team's tool, ../shared/reader_path, kept with the project so that a reader can run it.)
The reader's path, measured by running it: which of the project's functions a reader must read to follow one
run of a task script from its `main` (spawn, set-up, merge, sample, loss, step, publish, reference reset) and
each searcher process from its top function (weights in, generate, score, send), without opening ops/, bench/
or tasks/ and without the task's own data and warm start (`make_task`). It counts what runs: code in a thread
of the trainer's, at module level, or reached only through ops/ is not on the path.

    python bench/reader_path/reader_path.py                  # run_gsm8k.py, tiny preset, a few steps
    python bench/reader_path/reader_path.py --script run_tldr.py
    python bench/reader_path/reader_path.py -- --steps 6 --no-share-prompt   # your own flags for the run
    python bench/reader_path/reader_path.py --list           # also every function on the path, with its lines

Every process the run starts loads reader_path/site/sitecustomize.py (through PYTHONPATH), which records the
project functions that run and how they were reached. Lines are whole function definitions (docstring and
comments included; a function inside another counts once). Run it in the project root, with the project's
Python (`python` on PATH, or --python). The warm start is built first without tracing (cached as usual).
Prints a table per file: lines on the reader's path, lines reached only through operations; then totals."""
import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def spans(path):
    """(firstlineno, qualname) -> (start, end) for every function of a file (decorators included)."""
    out = {}
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return out

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    out[(child.lineno, qual)] = (first, child.end_lineno)
                    out.setdefault((first, qual), (first, child.end_lineno))
                    visit(child, qual + ".<locals>.")
                else:
                    visit(child, qual + ".")
            else:
                visit(child, prefix)
    visit(tree, "")
    return out


def union_length(intervals):
    total, end = 0, -1
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end + 1) + 1
        end = b
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default="run_gsm8k.py")
    ap.add_argument("--python", default="python")
    ap.add_argument("--list", action="store_true", help="list every function on the path")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("args", nargs="*", help="after --: the script's own flags (default: a short run)")
    a = ap.parse_args()
    root = os.getcwd()
    work = tempfile.mkdtemp(prefix="reader-path-")
    # (a reference reset every 3 steps, so that TBA's reset is on the path; --eval-size 8 keeps evaluation short)
    flags = a.args or ["--steps", "6", "--eval-every", "0", "--eval-size", "8", "--log-every", "1", "--ref-reset-every", "3"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    # 1. the warm start (and anything else cached), untraced: a 1-step run
    warm = subprocess.run([a.python, a.script, *flags, "--steps", "1", "--run-dir", os.path.join(work, "warm")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=a.timeout)
    if warm.returncode != 0:
        sys.exit(f"reader_path: the untraced warm-up run failed (rc={warm.returncode}): "
                 f"{(warm.stderr or warm.stdout).strip().splitlines()[-1:]}")
    # 2. the traced run
    out = os.path.join(work, "calls")
    os.makedirs(out)
    tenv = dict(env, READER_PATH_ROOT=root, READER_PATH_OUT=out,
                PYTHONPATH=os.pathsep.join([os.path.join(HERE, "site")] + [p for p in [env.get("PYTHONPATH")] if p]))
    run = subprocess.run([a.python, a.script, *flags, "--run-dir", os.path.join(work, "run")], cwd=root, env=tenv,
                         capture_output=True, text=True, timeout=a.timeout)
    if run.returncode != 0:
        sys.exit(f"reader_path: the traced run failed (rc={run.returncode}): "
                 f"{(run.stderr or run.stdout).strip().splitlines()[-3:]}")
    rank = {"outside": 0, "setup": 1, "ops": 2, "path": 3}
    seen, procs = {}, 0
    for f in glob.glob(os.path.join(out, "calls-*.json")):
        data = json.load(open(f))
        if data["calls"]:
            procs += 1
        for rel, line, qual, kind in data["calls"]:
            key = (rel, line, qual)
            if rank[kind] > rank.get(seen.get(key), -1):
                seen[key] = kind
    by_file = {}
    for (rel, line, qual), kind in seen.items():
        if kind not in ("path", "ops"):
            continue
        sp = spans(os.path.join(root, rel)).get((line, qual))
        if sp is None:  # (a lambda or comprehension: inside a function that is counted anyway)
            continue
        by_file.setdefault(rel, {"path": [], "ops": []})[kind].append((sp, qual))
    rows, total_path, total_ops, files_path = [], 0, 0, 0
    for rel in sorted(by_file):
        p = union_length([sp for sp, _ in by_file[rel]["path"]])
        o = union_length([sp for sp, _ in by_file[rel]["ops"] + by_file[rel]["path"]]) - p
        rows.append((rel, p, o, len(by_file[rel]["path"])))
        total_path += p
        total_ops += o
        files_path += p > 0
    print(f"reader path of `python {a.script} {' '.join(flags)}` ({procs} processes traced)")
    print("| file | lines on the reader's path | functions | lines reached only through operations |")
    print("|---|---|---|---|")
    for rel, p, o, n in sorted(rows, key=lambda r: -r[1]):
        print(f"| {rel} | {p} | {n} | {o} |")
    if a.list:
        for rel in sorted(by_file):
            for (s, e), qual in sorted(by_file[rel]["path"]):
                print(f"  {rel}:{s}-{e} {qual} ({e - s + 1})")
    print(f"reader path: {total_path} lines in {files_path} files; {total_ops} more lines run only through operations")


if __name__ == "__main__":
    main()
