"""Let torch >= 2.6 load fairseq checkpoints without turning safe loading off.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``: only tensors,
containers and allow-listed classes may be unpickled. fairseq checkpoints also hold the
training arguments (an ``argparse.Namespace``), and checkpoints written with
``--eval-bleu`` or a numeric best-checkpoint metric hold numpy scalars and arrays. We
allow-list exactly those types, process-wide, when the plugin is imported (fairseq's
command-line tools import ``--user-dir`` before they load any checkpoint); everything
else in a checkpoint is still refused by torch's safe unpickler.
"""

import argparse

import numpy as np
import torch


def _numpy_globals():
    """The numpy callables and classes that pickled numpy scalars/arrays refer to."""
    found = [np.ndarray, np.dtype]
    # Array reconstruction lives in numpy.core (numpy 1.x) or numpy._core (numpy 2.x);
    # pickles written by either version name their own module, so allow both spellings.
    for module_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            module = __import__(module_name, fromlist=["_reconstruct", "scalar"])
        except ImportError:
            continue
        for name in ("_reconstruct", "scalar"):
            obj = getattr(module, name, None)
            if obj is not None:
                found.append((obj, f"{module_name}.{name}"))
    # dtype classes (numpy >= 1.25 pickles dtypes through numpy.dtypes.*DType)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            obj = getattr(dtypes, name)
            if isinstance(obj, type) and name.endswith("DType"):
                found.append(obj)
    # scalar types such as numpy.float64 that appear as metric values
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                 "uint8", "bool_"):
        found.append(getattr(np, name))
    return found


def allow_fairseq_checkpoints() -> None:
    """Allow-list what fairseq checkpoints contain for ``weights_only`` loading."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4 loads everything anyway
        return
    add([argparse.Namespace] + _numpy_globals())
