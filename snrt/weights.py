"""Weights in and out: a run's parameters and BatchNorm statistics as a safetensors file or a
PyTorch state dict, and a run started from one.

Names are snrt's own with a dot, ``<node>.<name>`` (``conv2d0.weight``,
``batchnorm0.running_mean``): what `snrt export` writes. A file read with `--init-from` is
matched by those names when it has them all; otherwise by order and shape, the network's
parameters and statistics in graph order against the file's tensors in the file's order (a
PyTorch state dict keeps its module order; safetensors keeps no order, so it is matched by
name only). A file that matches neither way is one error listing the first tensors that do
not match; a tensor of integers, booleans or complex numbers, or one holding NaN or infinity,
is one error naming it. Optimizer state is neither written nor read: a run started from weights starts its
optimizer afresh.

Another framework's names: `snrt export --names-like FILE` writes the tensors under the names
of a weights file of the target model (torchvision's ``resnet50().state_dict()`` saved with
``torch.save``, say), paired by the same rule, in that file's order; entries snrt has no
tensor for, PyTorch's BatchNorm counters (``num_batches_tracked``), are written as that file
has them, so the result loads with ``load_state_dict(strict=True)``.

safetensors is in the `interop` extra; PyTorch files need PyTorch installed (never a run-time
dependency otherwise).
"""

from pathlib import Path

import numpy as np

from snrt.atomic import replace_atomically
from snrt.checkpoint import is_checkpoint
from snrt.errors import SnrtError

FORMATS = ("safetensors", "torch")
ROLES = ("parameter", "state")  # what weights are: trained parameters and normalization statistics
SHOWN = 5  # mismatching tensors named in an error
COUNTER = "num_batches_tracked"  # PyTorch's BatchNorm counter: no snrt tensor holds it


def _module(name, extra):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        raise SnrtError(f"{extra}: pip install {'torch' if name == 'torch' else repr('snrt[interop]')}") from None


def export(tensors, path, fmt):
    """Write `tensors` ({"node:name", or a name of another framework: array}, in the order to write)
    to `path` as `fmt`, atomically (snrt/atomic.py); OSError when it cannot be written."""
    named = {key.replace(":", ".", 1): np.ascontiguousarray(value) for key, value in tensors.items()}
    if fmt == "safetensors":
        data = _module("safetensors.numpy", "writing safetensors needs safetensors").save(named)
        replace_atomically(path, lambda partial: partial.write_bytes(data))
    elif fmt == "torch":
        torch = _module("torch", "writing a PyTorch state dict needs PyTorch")

        def write(partial):
            with open(partial, "wb") as f:
                torch.save({key: torch.from_numpy(value) for key, value in named.items()}, f)
        replace_atomically(path, write)
    else:
        raise SnrtError(f"unknown weights format {fmt!r}; expected one of {', '.join(FORMATS)}")


def read(path):
    """[(name, array)] of the weights file `path` (safetensors, or a PyTorch state dict), in
    the file's order (safetensors: by name); floating-point tensors as float32, or float64."""
    path = Path(path)
    if not path.is_file():
        raise SnrtError(f"{path}: no such weights file")
    try:
        open(path, "rb").close()
    except OSError as e:  # the file may be whole: say why it cannot be read, not that it is of another kind
        raise SnrtError(f"{path}: cannot read the weights file ({e.strerror})") from None
    if path.suffix == ".safetensors":
        try:
            loaded = _module("safetensors.numpy", "reading safetensors needs safetensors").load_file(str(path))
        except Exception as e:  # the library's own error types
            raise SnrtError(f"{path}: not a safetensors file ({e})") from None
        return sorted(loaded.items())
    if is_checkpoint(path):
        raise SnrtError(f"{path}: a checkpoint of snrt train, not a weights file; continue its run with --resume, or "
                        f"write its weights with `snrt export {path}` and start from those")
    torch = _module("torch", f"{path}: reading a PyTorch file needs PyTorch")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:  # pickle and zip errors alike (PyTorch's text suggests unsafe loading: not repeated)
        raise SnrtError(f"{path}: not a PyTorch state dict of tensors (a whole pickled model, or not a PyTorch file; "
                        "snrt loads with weights_only, running no code from the file); save the model's "
                        "state_dict(), or safetensors") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise SnrtError(f"{path}: expected a state dict (names to tensors), found a {type(state).__name__}")
    return [(key, _array(path, key, value)) for key, value in state.items() if hasattr(value, "numpy")]


def _array(path, key, tensor):
    """The NumPy array of the file `path`'s tensor `key`: floating point as float32 (float64 as it is), a sparse tensor
    dense; SnrtError for one without values (on PyTorch's meta device) or that NumPy cannot hold
    (a quantized tensor, say)."""
    tensor = tensor.detach()
    if tensor.is_meta:
        raise SnrtError(f"{path}: {key} holds no values: a tensor of PyTorch's meta device, saved before the model "
                        "was given weights")
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    try:
        narrow = tensor.is_floating_point() and tensor.element_size() < 8  # float64 as is: `matched` checks its range
        return (tensor.float() if narrow else tensor).numpy()
    except (TypeError, RuntimeError) as e:
        raise SnrtError(f"{path}: {key} is a tensor NumPy cannot hold ({e}); save it as a dense float tensor") from None


def _weights(found):
    """`found` ([(name, array)]) without PyTorch's BatchNorm counters."""
    return [(name, array) for name, array in found if not name.endswith(COUNTER)]


def matched(wanted, found, path):
    """{(node, name): array} of the file `path`'s tensors `found` ([(name, array)]) for the
    network's `wanted` ([((node, name), shape)] in graph order), by name or else by order and
    shape; a SnrtError listing the first mismatches when neither fits, or naming the first
    tensor that is not finite floating-point numbers, which every parameter and statistic is."""
    found = _weights(found)
    arrays = dict(found)
    paired = _paired(wanted, found, Path(path))
    for name in paired.values():
        if arrays[name].dtype.kind != "f":
            raise SnrtError(f"{path}: {name} holds {arrays[name].dtype} values, not the floating-point numbers "
                            "of a parameter or statistic")
        if not np.isfinite(arrays[name]).all():
            raise SnrtError(f"{path}: {name} holds NaN or infinite values (saved from a run that diverged?)")
        largest = float(np.abs(arrays[name]).max(initial=0))
        if largest > float(np.finfo(np.float32).max):  # a wider float's value that float32 parameters would hold as inf
            raise SnrtError(f"{path}: {name} holds values beyond float32's range (largest magnitude {largest:.3g}), "
                            "which the parameters and statistics are kept in")
    return {key: arrays[name] for key, name in paired.items()}


def named_like(tensors, path):
    """{file name: array} of `tensors` ({"node:name": array}, in graph order) under the names
    of the weights file `path`, in that file's order, paired as `matched` pairs them; the
    file's BatchNorm counters are copied as they are."""
    found = read(path)
    wanted = [(tuple(key.split(":", 1)), value.shape) for key, value in tensors.items()]
    name_of = {name: "{}:{}".format(*key) for key, name in _paired(wanted, _weights(found), Path(path)).items()}
    return {name: tensors[name_of[name]] if name in name_of else array for name, array in found}


def _paired(wanted, found, path):
    """{(node, name): the file's name of it}: `wanted` against `found` by snrt's names, or else
    (a state dict) by order and shape; a SnrtError listing the first mismatches otherwise."""
    by_name = dict(found)
    names = [f"{node}.{name}" for (node, name), _ in wanted]
    if all(n in by_name for n in names):
        wrong = [f"{n}: file {list(by_name[n].shape)}, network {list(shape)}" for n, (_, shape) in zip(names, wanted)
                 if tuple(by_name[n].shape) != tuple(shape)]
        if wrong:
            raise SnrtError(f"{path}: {len(wrong)} tensors have another shape than the network's: "
                            + "; ".join(wrong[:SHOWN]))
        return {key: n for n, (key, _) in zip(names, wanted)}
    if path.suffix != ".safetensors" and len(found) == len(wanted) and all(
            tuple(a.shape) == tuple(shape) for (_, a), (_, shape) in zip(found, wanted)):
        return {key: fname for (key, _), (fname, _) in zip(wanted, found)}
    missing = [n for n in names if n not in by_name]
    message = (f"{path}: does not match the network by name ({len(missing)} of its {len(names)} tensors missing, "
               f"first {', '.join(missing[:SHOWN])})")
    if path.suffix != ".safetensors":  # a state dict: say where the order fails too
        if len(found) != len(wanted):
            message += f"; nor by order: the file has {len(found)} tensors, the network {len(wanted)}"
        else:
            wrong = [f"#{i} {fname} {list(a.shape)} against {n} {list(shape)}"
                     for i, ((fname, a), n, (_, shape)) in enumerate(zip(found, names, wanted))
                     if tuple(a.shape) != tuple(shape)]
            message += "; nor by order: " + "; ".join(wrong[:SHOWN])
    raise SnrtError(message)
