"""A training run's output folder, which protects what it holds.

One run at a time: the folder is locked (an advisory lock on `.lock`, released by the
operating system when the process ends, however it ends), so a second run on the same folder
is refused instead of overwriting the first one's checkpoint. A folder that already holds a
run is never silently started over: the caller says `resume` (continue it) or `overwrite`
(delete its files, which the caller does once the new run is set up, so that a run that
cannot start leaves the earlier one whole). Temporary files of checkpoint writes that were
killed are removed when the lock is taken, and on resume metrics.jsonl is cut back to the
iterations before the checkpoint, so it never holds an iteration twice.
"""

import contextlib
import errno
import fcntl
import json
import os
from pathlib import Path

from snrt.atomic import replace_atomically
from snrt.checkpoint import remove_stale_temporaries
from snrt.errors import SnrtError

CHECKPOINT, METRICS, LOCK = "checkpoint.npz", "metrics.jsonl", ".lock"
RUN_FILES = (CHECKPOINT, METRICS, "summary.json", "config.yaml", "memory.png", "metrics.png", "classes.json")


class RunFolderError(SnrtError):
    """The output folder cannot be used: not a folder, not writable, in use, or holding a run."""


class RunFolder:
    """The locked output folder `path` of one run; `close()` (or the end of the process)
    unlocks it."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"{self.path}: the output folder is an existing file; choose another --out")
        self._made = not self.path.exists()  # removed again by close() if the run leaves nothing in it
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.path / LOCK, "a+")
        except OSError as e:
            raise RunFolderError(f"{self.path}: cannot use this output folder ({e.strerror}); choose another "
                                 "--out") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # no lock to be had here (a file system without)
                self._lock.close()
                raise RunFolderError(f"{self.path}: cannot lock this output folder ({LOCK}: {e.strerror}), so a "
                                     "second run could write over this one's files; choose an --out on a local "
                                     "disk") from None
            self._lock.seek(0)
            owner = self._lock.read().strip() or "unknown"
            self._lock.close()
            raise RunFolderError(f"{self.path}: another snrt run (process {owner}) is using this output folder; "
                                 "wait for it to finish or choose another --out") from None
        try:
            self._lock.truncate(0)
            self._lock.write(f"{os.getpid()}\n")
            self._lock.flush()
        except OSError as e:  # a full disk: the lock is taken, its note of the owner not written
            with contextlib.suppress(OSError):  # closing flushes the note again, and fails again
                self.close()
            raise RunFolderError(f"{self.path}: cannot use this output folder ({LOCK}: {e.strerror}); free some "
                                 "space or choose another --out") from None
        remove_stale_temporaries(self.checkpoint)

    @property
    def checkpoint(self):
        return self.path / CHECKPOINT

    @property
    def metrics(self):
        return self.path / METRICS

    def open_metrics(self):
        """metrics.jsonl opened for appending, one JSON line per iteration."""
        return self.metrics.open("a")

    def holds_run(self):
        """True when an earlier run left a checkpoint or metrics here."""
        return self.checkpoint.exists() or (self.metrics.exists() and self.metrics.stat().st_size > 0)

    def prepare(self, resume, overwrite, elsewhere=None):
        """Refuse to start over a run the folder holds unless `resume` (keep it) or `overwrite`
        (the caller calls `start_over` once the new run is set up), and both at once. `elsewhere`
        is the checkpoint of another run this one continues (--resume OTHER_RUN): the folder's
        own run is not continued, so it is started over only when `overwrite` says so."""
        if resume and overwrite:
            raise RunFolderError(f"{self.path}: --overwrite would delete the checkpoint that --resume continues; "
                                 "give one of them")
        if self.holds_run() and not resume and not overwrite:
            if elsewhere:
                raise RunFolderError(f"{self.path}: holds an earlier run ({self._describe_run()}), not the one of "
                                     f"{elsewhere} that --resume continues; start over here with --overwrite, or "
                                     "choose another --out")
            raise RunFolderError(f"{self.path}: holds an earlier run ({self._describe_run()}); continue it with "
                                 "--resume, start over with --overwrite, or choose another --out")

    def start_over(self):
        """Delete the files of the run the folder holds."""
        for name in RUN_FILES:
            (self.path / name).unlink(missing_ok=True)

    def _metric_lines(self):
        """metrics.jsonl's lines; a byte that is not UTF-8 (a damaged disk block) spoils its line
        only. OSError when the file cannot be read."""
        return self.metrics.read_text(errors="replace").splitlines()

    def _describe_run(self):
        """What the folder holds, for an error: the iterations in metrics.jsonl, or its checkpoint."""
        try:
            lines = self._metric_lines()
        except OSError:
            lines = []
        return f"{len(lines)} iterations in {METRICS}" if lines else f"a {CHECKPOINT}"

    def truncate_metrics(self, iteration):
        """Keep only metrics.jsonl's lines of iterations before `iteration` (where a resumed run
        continues), rewritten atomically; lines that are not metrics are dropped. A file that
        cannot be read (a failing disk) stays as it is: it is not taken for one with no lines."""
        if not self.metrics.exists():
            return
        try:
            lines = self._metric_lines()
        except OSError as e:
            raise RunFolderError(f"{self.metrics}: cannot read it to cut it back to iteration {iteration} "
                                 f"({e.strerror}); the run is as it was") from None
        kept = []
        for line in lines:
            try:
                if json.loads(line)["iteration"] < iteration:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        replace_atomically(self.metrics, lambda partial: partial.write_text("".join(line + "\n" for line in kept)))

    def close(self):
        """Unlock the folder; one this run made and left with nothing in it (a run that could
        not start) is removed, while still locked."""
        if self._lock.closed:
            return
        with contextlib.suppress(OSError):
            if self._made and [p.name for p in self.path.iterdir()] == [LOCK]:
                (self.path / LOCK).unlink()
                self.path.rmdir()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
