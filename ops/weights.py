"""
How the trainer's weights reach the searchers.

One machine (searcher.Searchers): `SharedWeights`, one copy of the state dict per searcher device, in the
searchers' dtype, shared through torch.multiprocessing: shared memory on a CPU, a CUDA buffer shared between
processes on a GPU. A publish is one copy into it (the cast to the searchers' dtype included, device to device),
a pull one copy out of it: no trip through host memory on a GPU, nothing pickled. Exception: a vLLM searcher on a
GPU sees only its own GPU (ops/devices.claim_gpu), and CUDA IPC needs both processes to number the GPUs alike,
so its copy is kept in host shared memory (ops/memory.shared_device).

A torchrun job (ops/distributed.py): the state dict packed into one byte tensor (cast to the searchers' dtype),
sent to every searcher rank with gloo point-to-point on a background thread, and unpacked there as views (no
copy) for load_state_dict. Trainer and searchers check that they agree on the layout (names, dtypes, shapes)
before any tensor is loaded.
"""

import contextlib
import datetime
import hashlib
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from config import SearcherDied


def one_line(e):
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# -----------------------------------------------------------------------------
# One machine: shared through torch.multiprocessing

class SharedWeights:
    """A state dict shared with the searcher processes and a version counter: the trainer publishes, searchers pull.
    `tensors` holds one copy per searcher device (`allocate`); the counter and the lock travel to each searcher as
    it is spawned, its device's copy with its job. A process killed while it holds the lock (a searcher killed
    inside its pull) does not block the others: the next process that waits for the lock takes it over."""

    def __init__(self, ctx, timeout_s=300.0):
        self.version = ctx.Value("q", -1)  # the trainer step whose weights the copies hold
        self.lock = ctx.Lock()
        self.holder = ctx.Value("q", 0)  # the pid of the process holding `lock` (0: none); its own lock guards takeovers
        self.timeout_s = timeout_s  # waiting longer than this for the lock is a failure (--searcher-timeout)
        self.tensors = {}  # device -> {name: tensor}

    def __getstate__(self):
        """What a searcher process is spawned with: the counter and the lock, not the copies (its own device's copy
        comes with its job): a searcher restarted after `allocate` would otherwise map every device's copy."""
        return {**self.__dict__, "tensors": {}}

    def allocate(self, model, version, devices, dtype):
        """A copy of `model`'s state dict on each device, floating-point tensors in `dtype`."""
        for device in dict.fromkeys(devices):
            copy = {n: t.detach().to(device, dtype if t.is_floating_point() else t.dtype, copy=True)
                    for n, t in model.state_dict().items()}
            self.tensors[device] = {n: t.share_memory_() for n, t in copy.items()} if device == "cpu" else copy
        self.version.value = version

    def publish(self, model, version):
        """Copy `model`'s weights into every searcher device's copy, as `version`; returns the seconds it took."""
        t0 = time.time()
        with self.locked():
            state = model.state_dict()
            for copy in self.tensors.values():
                for n, t in copy.items():
                    t.copy_(state[n].detach())  # (device to device, cast to the searchers' dtype)
            synchronize(state, *self.tensors.values())  # (CUDA copies are asynchronous: done before the version says so)
            self.version.value = version
        return time.time() - t0

    def pull(self, target, tensors, have_version):
        """Copy `tensors` (this searcher's copy) into `target` (a model, or a generator: anything with load_state_dict
        and state_dict) if newer than have_version; the version it holds."""
        if self.version.value == have_version:
            return have_version
        with self.locked():
            target.load_state_dict(tensors)
            synchronize(tensors, target.state_dict())
            return self.version.value

    @contextlib.contextmanager
    def locked(self):
        """Hold the lock; from a process that died holding it, take it over (its copy may be half-written: the
        trainer's publish rewrites every copy, and a searcher reads only after a publish). Waiting more than
        timeout_s for a live holder raises SearcherDied naming it."""
        if not self.lock.acquire(timeout=0.1):
            self.wait_for_lock()
        self.holder.value = os.getpid()
        try:
            yield
        finally:
            self.holder.value = 0
            self.lock.release()  # (a multiprocessing Lock may be released by a process that did not acquire it)


    def wait_for_lock(self):
        """`locked`'s wait for a lock another process holds: until it is free, or taken over from a dead holder."""
        deadline = time.time() + self.timeout_s
        while not self.lock.acquire(timeout=0.1):
            with self.holder.get_lock():  # (one process takes over, never two)
                holder = self.holder.value
                if holder and not process_alive(holder):
                    self.holder.value = os.getpid()
                    return  # the lock is ours now
            if time.time() > deadline:
                raise SearcherDied(f"the shared weights' lock has been held for more than {self.timeout_s:g} s "
                                   f"(--searcher-timeout) by {f'pid {holder}' if holder else 'a process that died taking it'}")


def process_alive(pid):
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def allocate_shared(cfg, weights, policy, ref, step, ref_version):
    """The searchers' shared weights (`weights`: kind -> SharedWeights) allocated from the trainer's models, a copy
    per searcher device in the searchers' dtype; the reference only for objectives that read it. /dev/shm is
    checked first, now that the model's size is known. Returns where each searcher's copy is."""
    from ops.memory import check_shared_memory, shared_device
    from ops.models import dtype_of
    check_shared_memory(cfg, params=sum(t.numel() for t in policy.state_dict().values()))
    devices = [shared_device(cfg, d) for d in cfg.searcher_devices]
    weights["policy"].allocate(policy, step, devices, dtype_of(cfg.searcher_dtype))
    if "ref_logp" in cfg.needs:  # (the searchers score the reference only for objectives that read it)
        weights["ref"].allocate(ref, ref_version, devices, dtype_of(cfg.searcher_dtype))
    return devices


def synchronize(*state_dicts):
    """Wait for the CUDA devices the state dicts live on (copies between them are asynchronous)."""
    for device in {t.device for state in state_dicts for t in state.values() if t.is_cuda}:
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------
# A torchrun job: packed, sent over gloo


def layout(model, dtype=None):
    """Where each state-dict tensor lies in the packed byte tensor: [(name, dtype, shape, offset, nbytes)],
    and the packed size; floating-point tensors cast to `dtype` if given (the searchers'). Every tensor starts at a
    multiple of 16 bytes, so its bytes view back as its dtype."""
    entries, offset = [], 0
    for name, t in model.state_dict().items():
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * kind.itemsize
        entries.append((name, kind, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // 16) * 16
    return entries, offset


def digest(entries):
    """A fingerprint of a layout (names, dtypes, shapes): trainer and searchers must agree on it."""
    return hashlib.sha1(json.dumps([(n, str(d), s) for n, d, s, _, _ in entries]).encode()).hexdigest()[:16]


def pack(model, entries, out):
    """Copy the state dict into `out`, a (size,) uint8 CPU tensor, at the offsets of `entries`."""
    state = model.state_dict()
    for name, dtype, _, offset, nbytes in entries:
        out[offset:offset + nbytes].copy_(state[name].detach().to(dtype).reshape(-1).view(torch.uint8))
    return out


def unpack(flat, entries):
    """{name: tensor} views into a packed byte tensor (no copy), for load_state_dict."""
    return {name: flat[offset:offset + nbytes].view(dtype).view(shape) for name, dtype, shape, offset, nbytes in entries}


class WeightSender:
    """Rank 0's side of the weights: pack on the caller's thread (one copy), send on a background thread."""

    def __init__(self, store, ranks, timeout_s, dtype=None):
        self.store, self.ranks, self.timeout_s = store, ranks, timeout_s  # store: this thread's own client
        self.dtype = dtype  # the searchers' dtype: floating-point tensors are cast to it as they are packed
        self.thread, self.error = None, None
        self.buffers = {}  # kind -> the byte tensor its transfers are packed into (reused while the size holds)

    def busy(self):
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout_s):
        if self.thread is not None:
            self.thread.join(timeout_s)

    def send(self, items, wait=False):
        """Send [(kind, version, model)] to every searcher. While a transfer is in flight nothing is sent (returns
        False: the caller sends it later, ops/distributed.DistSearchers), or with wait=True it waits for that
        transfer first (at most timeout_s)."""
        if self.busy() and not wait:
            return False
        self.join(self.timeout_s)
        if self.busy():
            raise SearcherDied(f"a weight transfer took longer than --searcher-timeout {self.timeout_s:g} s")
        messages = [(kind, version, *self._pack(kind, model)) for kind, version, model in items]
        self.thread = threading.Thread(target=self._transfer, args=(messages,), name="weights-sender", daemon=True)
        self.thread.start()
        return True

    def _pack(self, kind, model):
        entries, size = layout(model, self.dtype)
        if kind not in self.buffers or self.buffers[kind].numel() != size:
            self.buffers[kind] = torch.empty(size, dtype=torch.uint8)
        return pack(model, entries, self.buffers[kind]), digest(entries)

    def _transfer(self, messages):
        """Announce, then send, each message to every searcher; an error is kept for DistSearchers.check_alive."""
        rank = None
        try:
            for kind, version, flat, fingerprint in messages:
                header = json.dumps({"kind": kind, "version": version, "nbytes": flat.numel(), "layout": fingerprint})
                works = []
                for rank in self.ranks:
                    self.store.queue_push(f"weights/{rank}", header)
                    works.append((rank, dist.isend(flat, dst=rank)))
                for rank, work in works:
                    work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # any failure: the run ends at the trainer's next check_alive, naming the rank
            self.error = f"sending weights to searcher rank {rank} failed ({one_line(e)})"
