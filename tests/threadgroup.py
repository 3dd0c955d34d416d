"""A test double of snrt.parallel's MPI group: N ranks as N threads of one process.

It is the reference the data-parallel runs are checked against: one process that runs the N
micro-batches (each rank's part of the batch, each with its own BatchNorm statistics) and
sums their gradients in rank order (the executor's addition), the exchange being plain copies
between the threads' arrays.
"""

import threading

import numpy as np


class ThreadGroup:
    """Rank `rank` of `size` threads that share `room` (one ThreadGroup.room(size) per run)."""

    def __init__(self, room, rank):
        self.room, self.rank, self.size = room, rank, room["size"]

    @staticmethod
    def room(size):
        return {"size": size, "barrier": threading.Barrier(size), "posted": {}}

    def _exchange(self, mine, combine):
        """Everyone posts `mine`; returns combine(list of everyone's, in rank order)."""
        barrier, posted = self.room["barrier"], self.room["posted"]
        posted[self.rank] = mine
        barrier.wait()
        out = combine([posted[r] for r in range(self.size)])
        barrier.wait()  # nobody posts the next value before all have read this one
        return out

    def sum(self, values):
        mine = np.asarray(values, dtype=np.float64)
        return self._exchange(mine, lambda all_: np.sum(all_, axis=0))

    def broadcast(self, value):
        return self._exchange(value, lambda all_: all_[0])

    def start_allgather(self, array):
        group = self

        class Request:
            def Test(self):  # the threads exchange only when every one waits
                return False

            def Wait(self):
                def fill(arrays):
                    for r, other in enumerate(arrays):
                        if r != group.rank:
                            array[r] = other[r]
                group._exchange(array, fill)
        return Request()

    def abort(self, code):
        raise SystemExit(code)


def run_ranks(size, work):
    """[work(group) for each rank], each rank in a thread of its own; re-raises a rank's error."""
    room = ThreadGroup.room(size)
    results, errors = [None] * size, []

    def run(rank):
        try:
            results[rank] = work(ThreadGroup(room, rank))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            room["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
