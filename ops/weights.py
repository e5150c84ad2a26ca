"""
The weights' path of a torchrun job (ops/distributed.py): the trainer's state dict packed into one byte
tensor, sent to every searcher rank with gloo point-to-point on a background thread, and unpacked there as
views (no copy) for load_state_dict. Trainer and searchers check that they agree on the layout (names, dtypes,
shapes) before any tensor is loaded.
"""

import datetime
import hashlib
import json
import threading

import torch
import torch.distributed as dist

from config import SearcherDied


def one_line(e):
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__



def layout(model):
    """Where each state-dict tensor lies in the packed byte tensor: [(name, dtype, shape, offset, nbytes)],
    and the packed size. Every tensor starts at a multiple of 16 bytes, so its bytes view back as its dtype."""
    entries, offset = [], 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        entries.append((name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // 16) * 16
    return entries, offset


def digest(entries):
    """A fingerprint of a layout (names, dtypes, shapes): trainer and searchers must agree on it."""
    return hashlib.sha1(json.dumps([(n, str(d), s) for n, d, s, _, _ in entries]).encode()).hexdigest()[:16]


def pack(model, entries, out):
    """Copy the state dict into `out`, a (size,) uint8 CPU tensor, at the offsets of `entries`."""
    state = model.state_dict()
    for name, _, _, offset, nbytes in entries:
        out[offset:offset + nbytes].copy_(state[name].detach().reshape(-1).view(torch.uint8))
    return out


def unpack(flat, entries):
    """{name: tensor} views into a packed byte tensor (no copy), for load_state_dict."""
    return {name: flat[offset:offset + nbytes].view(dtype).view(shape) for name, dtype, shape, offset, nbytes in entries}


class WeightSender:
    """Rank 0's side of the weights: pack on the caller's thread (one copy), send on a background thread."""

    def __init__(self, store, ranks, timeout_s):
        self.store, self.ranks, self.timeout_s = store, ranks, timeout_s  # store: this thread's own client
        self.thread, self.error, self.publishes, self.skipped = None, None, 0, 0
        self.buffers = {}  # kind -> the byte tensor its transfers are packed into (reused while the size holds)

    def busy(self):
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout_s):
        if self.thread is not None:
            self.thread.join(timeout_s)

    def send(self, items, wait=False):
        """Send [(kind, version, model)] to every searcher. While a transfer is in flight this is skipped
        (returns False), or with wait=True waits for it first (at most timeout_s)."""
        self.publishes += 1
        if self.busy() and not wait:
            self.skipped += 1
            return False
        self.join(self.timeout_s)
        if self.busy():
            raise SearcherDied(f"a weight transfer took longer than --searcher-timeout {self.timeout_s:g} s")
        messages = [(kind, version, *self._pack(kind, model)) for kind, version, model in items]
        self.thread = threading.Thread(target=self._transfer, args=(messages,), name="weights-sender", daemon=True)
        self.thread.start()
        return True

    def _pack(self, kind, model):
        entries, size = layout(model)
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
