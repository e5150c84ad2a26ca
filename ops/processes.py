"""
Starting and stopping the searcher processes robustly (searcher.Searchers calls these): a searcher starts with
stop signals ignored (they are the trainer's to handle: a Ctrl-C reaches the whole process group), and stopping
them is not interrupted by a second signal, ends within seconds, and never blocks on a queue nobody reads.
"""

import os
import queue
import time

from config import signals_ignored


def start_resource_tracker():
    """multiprocessing's resource tracker, started with stop signals ignored before the first queue or event is made
    (it outlives a closed terminal, and stays quiet)."""
    import multiprocessing.resource_tracker as tracker
    with signals_ignored():
        tracker.ensure_running()


def start_process(proc):
    """proc.start() with stop signals ignored, which the child inherits (they are the trainer's to handle)."""
    with signals_ignored():
        proc.start()


def stop_processes(stop_event, procs, queues, grace_s=5.0):
    """Ask every process to stop (stop_event), wait up to grace_s, then kill; a signal meanwhile does not
    interrupt it. Safe twice."""
    with signals_ignored():
        stop_event.set()
        deadline = time.time() + grace_s
        for p in procs:
            p.join(timeout=max(deadline - time.time(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in queues:
            q.cancel_join_thread()  # never block the trainer's exit on data nobody will read
            q.close()


def drain(q):
    """Every item a multiprocessing queue holds now, in order, without waiting."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


def get_until_stopped(q, stop_event, parent_pid):
    """The next item of a multiprocessing queue, waiting for it; None once stop_event is set or the parent is gone."""
    while not stop_event.is_set() and os.getppid() == parent_pid:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            continue
    return None
