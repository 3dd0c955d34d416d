"""Copy streams on the CPU: one worker thread per stream, a FIFO queue, and events.

NumPy copies of large arrays release the GIL, so a copy on a stream really overlaps the
kernels running on the calling thread. With `lazy=True` (the executor's check mode) a copy
runs only when someone waits for it, so a step that reads a prefetched buffer before its
wait sees the poison instead of data that happened to arrive in time.
"""

import queue
import threading
import time

from snrt.backends.base import CopyEvent


class ThreadCopyEvent(CopyEvent):
    """Completion of one copy queued on a CopyStream; `wait` blocks until it is done and
    re-raises the copy's error, if any."""

    def __init__(self, copy=None):
        self._done = threading.Event()
        self._copy = copy  # set only for lazy copies: run at wait time
        self.error = None
        self.seconds = 0.0  # how long the copy itself took

    def _run(self, copy):
        start = time.perf_counter()
        try:
            copy()
        except BaseException as e:  # reported to the waiter
            self.error = e
        finally:
            self.seconds = time.perf_counter() - start
            self._done.set()

    def wait(self):
        if self._copy is not None:
            copy, self._copy = self._copy, None
            self._run(copy)
        self._done.wait()
        if self.error is not None:
            raise self.error


class CopyStream:
    """A FIFO of copies run by one daemon thread (or at wait time when `lazy`)."""

    def __init__(self, name, lazy=False):
        self.name, self.lazy = name, lazy
        self._queue = queue.Queue()
        self._thread = None

    def submit(self, copy, inline=False):
        """Queue `copy` (a no-argument callable); returns its ThreadCopyEvent. With `inline`, run
        it now on the calling thread instead (a small copy takes less time than the queue's round
        trip; every copy has its own event, so one may overtake queued ones)."""
        if self.lazy:
            return ThreadCopyEvent(copy)
        if inline:
            event = ThreadCopyEvent()
            event._run(copy)
            return event
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"snrt-{self.name}", daemon=True)
            self._thread.start()
        event = ThreadCopyEvent()
        self._queue.put((copy, event))
        return event

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            copy, event = item
            event._run(copy)

    def close(self):
        """Finish queued copies and stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
