"""Files written whole or not at all: the new version goes to a temporary beside the file and
replaces it in one rename, so a reader, or a run interrupted while it writes, sees the old file
or the new one, never part of one."""

import contextlib
import os
from pathlib import Path

from snrt.errors import SnrtError


def replace_atomically(path, write):
    """`write(temporary)` (a Path beside `path`), then the temporary renamed over `path`; the
    temporary is removed when either fails (an interrupt included), and the error raised (an
    OSError about the temporary, or about no file, as a full disk's write, names `path`, the
    file the caller asked for)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # one never made (its folder is a file, say) must not hide the error
            partial.unlink(missing_ok=True)
        if isinstance(error, OSError) and (error.filename is None or Path(error.filename) == partial):
            error.filename = str(path)
        raise


def save_figure(fig, path, dpi=110):
    """Save matplotlib figure `fig` to `path` atomically, in the format its suffix names (PNG
    without one); SnrtError for a suffix matplotlib does not write."""
    fmt = Path(path).suffix[1:].lower() or "png"
    formats = fig.canvas.get_supported_filetypes()
    if fmt not in formats:
        raise SnrtError(f"{path}: cannot draw a picture as .{fmt}; name it .png (or one of "
                        f"{', '.join('.' + f for f in sorted(formats))})")
    replace_atomically(path, lambda partial: fig.savefig(partial, dpi=dpi, format=fmt))
