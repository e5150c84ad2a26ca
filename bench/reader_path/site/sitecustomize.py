"""(A copy of the team's tool, ../shared/reader_path, kept with the project so that a reader can run it.)
Loaded by every Python process that reader_path.py starts (the trainer and each spawned searcher), through
PYTHONPATH. Records which of the project's functions run, and whether each was reached along the reader's path:
from a root (a task script's or tba.py's `main`, or the top function of a spawned process) through the
project's core files only, never through ops/, bench/ or tasks/ (operations a reader may skip) and never under
the task's own set-up (`make_task`: data and warm start). Library frames in between are transparent.
Writes one JSON file per process into $READER_PATH_OUT at exit."""
import atexit
import json
import os
import sys
import threading
import time

_ROOT = os.environ.get("READER_PATH_ROOT")
_OUT = os.environ.get("READER_PATH_OUT")

if _ROOT and _OUT:
    _ROOT = os.path.realpath(_ROOT) + os.sep
    _SKIP_DIRS = ("ops" + os.sep, "bench" + os.sep, "tasks" + os.sep, "tests" + os.sep, ".venv")
    _TASK_SETUP = {"make_task"}
    _seen = {}  # (relpath, firstlineno, name) -> "path" | "ops" | "setup" | "outside"
    _rank = {"outside": 0, "setup": 1, "ops": 2, "path": 3}

    _SELF = os.path.dirname(os.path.realpath(__file__)) + os.sep  # (this copy lives in the project: not counted)

    def _rel(code):
        f = code.co_filename
        if not f.startswith(_ROOT) or f.startswith(_SELF):
            return None
        return f[len(_ROOT):]

    def _is_root(rel, name):
        return name == "main" and os.sep not in rel and (rel.startswith("run_") or rel == "tba.py")

    def _classify(frame):
        """How the reader reaches this project frame: walk up to the nearest root."""
        f = frame
        while f is not None:
            rel = _rel(f.f_code)
            if rel is not None and f.f_code.co_name != "<module>":
                name = f.f_code.co_name
                if rel.startswith(_SKIP_DIRS) or rel == "conftest.py":
                    return "ops"
                if name in _TASK_SETUP and rel.startswith("run_"):
                    return "setup"
                if _is_root(rel, name):
                    return "path"
            f = f.f_back
        # no root above: the top project frame of a spawned process is a root of its own
        top = None
        f = frame
        while f is not None:
            rel = _rel(f.f_code)
            if rel is not None and f.f_code.co_name != "<module>":
                top = rel
            f = f.f_back
        if top is not None and not top.startswith(_SKIP_DIRS) and _spawned:
            return "path"
        return "outside"

    _spawned = False

    def _profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        rel = _rel(code)
        if rel is None or code.co_name == "<module>":
            return
        key = (rel, code.co_firstlineno, code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
        old = _seen.get(key)
        if old == "path":
            return
        kind = _classify(frame)
        if old is None or _rank[kind] > _rank[old]:
            _seen[key] = kind
            _dirty[0] = True

    _last, _dirty = [time.monotonic()], [False]

    def _dumper():  # a searcher may be killed at the end, past atexit: dump as we go
        while True:
            time.sleep(0.5)
            if _dirty[0]:
                _dirty[0] = False
                _dump(final=False)

    def _dump(final=True):
        if final:
            sys.setprofile(None)
        _last[0] = time.monotonic()
        path = os.path.join(_OUT, f"calls-{os.getpid()}.json")
        with open(path, "w") as fh:
            json.dump({"spawned": _spawned, "argv": sys.argv, "calls": [[*k, v] for k, v in dict(_seen).items()]}, fh)

    # a spawned child starts as `python -c "from multiprocessing.spawn import spawn_main; ..."`
    _spawned = bool(sys.argv) and sys.argv[0] in ("-c", "") or "--multiprocessing-fork" in sys.argv
    atexit.register(_dump)
    # multiprocessing children leave through os._exit, past atexit: dump from the process's own exit path too
    try:
        import multiprocessing.process as _mpp
        _orig_bootstrap = _mpp.BaseProcess._bootstrap

        def _bootstrap(self, *a, **kw):
            try:
                return _orig_bootstrap(self, *a, **kw)
            finally:
                _dump()
        _mpp.BaseProcess._bootstrap = _bootstrap
    except Exception:
        pass
    threading.Thread(target=_dumper, daemon=True, name="reader-path-dump").start()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
