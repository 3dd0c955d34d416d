"""The processes that train together (data parallel), and what they say to each other.

`world()` is the group this process was started in. `mpiexec -n 4 snrt train ...` starts four
processes; each learns its rank and the group's size from MPI's world communicator (through
mpi4py, the `mpi` extra: pip install 'snrt[mpi]'). A plain `snrt train` is a group of one and
never loads MPI. Whether a launcher started the process is read from the variables every MPI
launcher sets for its processes (PMI_SIZE for MPICH's and Intel's, OMPI_COMM_WORLD_SIZE for
Open MPI's); they are the launcher's, not a setting of snrt.

The gradient exchange itself is the backend's (`Backend.start_exchange`): MPI's
non-blocking allgather on the CPU, NCCL through CuPy on GPUs. The group carries the small
host-side agreements: the iteration's loss and accuracy over all samples, whether to stop,
and ending the whole job when one process fails.
"""

import os

import numpy as np

from snrt.errors import SnrtError

LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")
LAUNCHER_LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")  # rank among this host's
LAUNCHER_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")  # processes on this host


class Solo:
    """A group of one: the plain run. Every agreement is this process's own value."""

    rank, size = 0, 1

    def sum(self, values):
        """`values` (float64) summed over the group's processes."""
        return np.asarray(values, dtype=np.float64)

    def broadcast(self, value):
        """Rank 0's `value`, on every rank."""
        return value

    def abort(self, code):
        """End every process of the group with exit status `code`."""
        raise SystemExit(code)


class MpiGroup:
    """The processes of an MPI communicator (mpi4py's `comm`)."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def sum(self, values):
        from mpi4py import MPI

        mine = np.ascontiguousarray(values, dtype=np.float64)
        total = np.empty_like(mine)
        self.comm.Allreduce(mine, total, op=MPI.SUM)
        return total

    def broadcast(self, value):
        return self.comm.bcast(value, root=0)

    def start_allgather(self, array):
        """Start exchanging the rows of host `array` (ranks, n) in place: row r is rank r's
        contribution; returns the request (`Wait()` completes it)."""
        from mpi4py import MPI

        return self.comm.Iallgather(MPI.IN_PLACE, array)

    def abort(self, code):
        self.comm.Abort(code)


def launcher_size():
    """The number of processes an MPI launcher started this one among (1 without a launcher)."""
    return _launcher_value(LAUNCHER_SIZE_VARIABLES, 1)


def launcher_rank():
    """This process's rank among those an MPI launcher started (0 without a launcher)."""
    return _launcher_value(LAUNCHER_RANK_VARIABLES, 0)


def launcher_local_rank():
    """This process's rank among the processes the launcher started on this host (its GPU)."""
    return _launcher_value(LAUNCHER_LOCAL_RANK_VARIABLES, 0)


def launcher_local_size():
    """The number of processes the launcher started on this host (1 without a launcher)."""
    return _launcher_value(LAUNCHER_LOCAL_SIZE_VARIABLES, 1)


def _launcher_value(names, default):
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return default


def first_failing_rank(group, failed):
    """The lowest rank whose set-up `failed`, or None when every rank is ready to train.

    A collective: every rank calls it once, after its set-up (config, output folder, plan,
    checkpoint) succeeded or failed and before the first iteration, so that a rank that cannot
    start never leaves the others waiting in a gradient exchange.
    """
    flags = np.zeros(group.size)
    flags[group.rank] = bool(failed)
    failing = np.flatnonzero(group.sum(flags))
    return int(failing[0]) if len(failing) else None


def world():
    """The group this process belongs to: Solo, or an MpiGroup over MPI's world communicator."""
    if launcher_size() <= 1:
        return Solo()
    try:
        from mpi4py import MPI
    except ImportError:
        raise SnrtError("this process was started by an MPI launcher (mpiexec) as one of several, but mpi4py is "
                        "not installed: pip install 'snrt[mpi]' (mpi4py and MPICH's mpiexec)") from None
    return MpiGroup(MPI.COMM_WORLD)
