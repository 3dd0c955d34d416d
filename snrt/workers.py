"""Worker processes that prepare training batches (`--workers N`, train.data.workers).

Batch i is a pure function of (seed, i) (snrt/data.py's Batches.get), so any process may make
it: N worker processes (started with "spawn": no copy of the trainer's threads) each take batch
numbers from a queue, decode and augment into one of `ahead` slots of shared memory, and say
which slot holds which batch; the trainer reads the batches in order, straight from their
slots, and hands each slot back when it asks for the next batch. The batch at iteration i is
the same for any number of workers. Nothing is pickled but the batch numbers and the Batches
recipe, sent once.

A worker that dies, or that spends more than `HANG_S` on one batch, stops the run with one line
naming the worker and the file it was reading (each worker records it in a shared string), as
a DataError, which the trainer answers by saving its checkpoint. Workers whose trainer was
killed (SIGKILL: it could not stop them) end themselves within `POLL_S`.
"""

import multiprocessing
import os
import queue
import signal
import time

import numpy as np

from snrt.errors import SnrtError

MAX_WORKERS = 512  # more worker processes than this is a typo (each is a Python process of its own)
HANG_S = 120.0  # a batch taking longer than this is a hung worker
POLL_S = 0.1
PATH_BYTES = 1024  # the longest file name a worker can report


class DataError(SnrtError):
    """A worker process failed: the run stops with its checkpoint saved."""


class WorkerBatches:
    """The batches of `batches` (a snrt.data.Batches) from `start` on, made by `workers`
    processes, at most `ahead` (two per worker) in flight. Iterate it; `close()` stops them.

    Each batch is arrays over its slot of shared memory, not a copy: it stays valid until the
    next batch is asked for, when its slot goes back to the workers."""

    def __init__(self, batches, workers):
        self.batches, self.workers = batches, int(workers)
        self.ahead = 2 * self.workers
        self.received = 0  # batches the workers have made
        part, dataset = batches.batch // batches.ranks, batches.dataset
        self.shapes = (((part, *dataset.shape), np.dtype(np.float32)), ((part, *dataset.y.shape[1:]), np.dtype(np.int64)))
        context = multiprocessing.get_context("spawn")
        self.slot_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self.shapes)
        self.memory = context.RawArray("b", self.slot_bytes * self.ahead)
        self.tasks, self.done = context.Queue(), context.Queue()
        self.reading = [context.RawArray("c", PATH_BYTES) for _ in range(self.workers)]
        self.processes = [context.Process(target=_work, name=f"snrt-data-{k}", daemon=True,
                                          args=(batches, self.memory, self.slot_bytes, self.tasks, self.done,
                                                self.reading[k], k, os.getpid()))
                          for k in range(self.workers)]
        for p in self.processes:
            p.start()

    def __iter__(self):
        i, free = self.batches.start, list(range(self.ahead))
        issued, ready = i, {}
        while True:
            while free and issued < i + self.ahead:
                self.tasks.put((issued, free.pop()))
                issued += 1
            while i not in ready:
                ready.update(self._next_done())
            slot = ready.pop(i)
            yield self._arrays(slot)
            free.append(slot)  # the caller asked for the next batch: it is done with this one
            i += 1

    def _next_done(self):
        """{batch: slot} of the next batch a worker finished; DataError when one died or hung."""
        started = time.monotonic()
        while True:
            try:
                message = self.done.get(timeout=POLL_S)
            except queue.Empty:
                for k, p in enumerate(self.processes):
                    if not p.is_alive():
                        raise DataError(f"data worker {k} died (exit code {p.exitcode})"
                                        f"{self._while_reading(k) or self._at_start()}") from None
                if time.monotonic() - started > HANG_S:
                    busy = next((k for k in range(self.workers) if self.reading[k].value), 0)
                    raise DataError(f"data worker {busy} made no batch in {HANG_S:.0f} s"
                                    f"{self._while_reading(busy)}") from None
                continue
            if message[0] == "error":
                raise DataError(message[1])
            self.received += 1
            return {message[1]: message[2]}

    def _at_start(self):
        """Why a worker may die before any batch: spawn runs the main script again."""
        if self.received:
            return ""
        return (" before any batch was made; workers are started with spawn, which imports the main script again: "
                "a script that trains with workers must start under `if __name__ == \"__main__\":` (or set "
                "train.data.workers to 0)")

    def _while_reading(self, k):
        path = os.fsdecode(self.reading[k].value)
        return f" while reading {path}" if path else ""

    def _arrays(self, slot):
        """(x, y): arrays over `slot`'s shared memory, not copies."""
        (xs, xt), (ys, yt) = self.shapes
        view = np.frombuffer(self.memory, np.uint8, self.slot_bytes, slot * self.slot_bytes)
        x = view[:int(np.prod(xs)) * xt.itemsize].view(xt).reshape(xs)
        return x, view[x.nbytes:].view(yt).reshape(ys)

    def close(self):
        """Stop the workers."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=5)
        self.processes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _work(batches, memory, slot_bytes, tasks, done, reading, k, trainer):
    """A worker's loop: make batch i into its slot, say so, until killed, or until the trainer
    (process id `trainer`, given: a worker still starting when the trainer is killed is adopted
    before it could ask for its parent) is gone (killed itself, by the OOM killer say, it cannot
    stop its workers)."""
    from snrt import images  # the image decoder reports each file it opens

    # Ctrl-C at a terminal signals every process of the command: the trainer stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    images.on_open = lambda path: setattr(reading, "value", os.fsencode(path)[:PATH_BYTES - 1])  # any name
    view = np.frombuffer(memory, np.uint8)
    while True:
        try:
            i, slot = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != trainer:  # an orphan, adopted by another process
                return
            continue
        try:
            x, y = batches.get(i)
        except Exception as e:  # noqa: BLE001  (handed to the trainer, which stops the run)
            done.put(("error", f"data worker {k}: {e}"))
            return
        reading.value = b""
        start = slot * slot_bytes
        x, y = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(y, np.int64)
        view[start:start + x.nbytes] = x.reshape(-1).view(np.uint8)
        view[start + x.nbytes:start + x.nbytes + y.nbytes] = y.reshape(-1).view(np.uint8)
        done.put(("batch", i, slot))
