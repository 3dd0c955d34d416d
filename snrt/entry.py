"""The `snrt` command's entry point: signals are answered quietly from the first moment,
before the command's modules (numpy, rich, the layers) load."""

import signal
import sys


def _quit(signum, frame):
    """SIGINT or SIGTERM before the command runs: nothing to save yet, so just stop."""
    sys.stderr.write(f"error: {'interrupted' if signum == signal.SIGINT else 'terminated'}\n")
    raise SystemExit(128 + signum)


def main(argv=None):
    signals = (signal.SIGINT, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # a parent may have blocked them; we handle them
    for signum in signals:
        signal.signal(signum, _quit)
    if getattr(sys.stdout, "errors", None) == "strict":  # a UTF-8 locale's: a path's bytes that are not UTF-8
        sys.stdout.reconfigure(errors="surrogateescape")  # print as they are (as in the C locale), no traceback
    from snrt.cli import main as run  # the command's handlers take over from here

    return run(argv)
