"""``torch.compile(fn, backend="autopar")``: the dynamo backend registered under that name (and
as the ``torch_dynamo_backends`` entry point), built on :func:`autopar.capture.dynamo.make_backend`
with :func:`autopar.api.make_runner`'s runner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from .api import Options, make_runner
from .capture.dynamo import data_dependent, make_backend
from .ir.logs import first_line

__all__ = ["autopar_backend"]

log = logging.getLogger("autopar.capture")

_BACKENDS: dict[tuple, Callable] = {}  # options -> its backend: one runner per set of options


def autopar_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    options: dict[str, Any] | None = None, **kwargs: Any):
    """The ``torch.compile(fn, backend="autopar")`` entry point.

    Options come as ``torch.compile(fn, backend="autopar", options={...})`` (the convention
    every backend shares) or as keyword arguments; both are validated as
    :func:`autopar.compile`'s. One runner (one machine and cost model) serves every graph
    compiled with the same options in this process.

    ``guards``: only "all". A backend is called from inside dynamo's frame, whose guards it does
    not decide; ``guards="arguments"`` is :func:`autopar.compile`'s (its calls skip the frame).

    A graph that reads values dynamo captured (``capture_scalar_outputs``: ``.item()``, tensor
    slice bounds) which this torch's aot_autograd fails on (torch 2.11 on W1's bounds:
    ``GuardOnDataDependentSymNode``) runs as dynamo captured it, op by op, logged: a backend
    can't ask dynamo to trace again with graph breaks (:func:`autopar.compile` does), and
    the error would reach a user whose code runs eagerly.
    """
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        raise ValueError(
            f"torch.compile's mode={mode!r} is Inductor's: autopar chooses CUDA graphs itself "
            "(option cuda_graphs: 'auto', True or False, e.g. torch.compile(fn, "
            "backend='autopar', options={'cuda_graphs': True})); leave mode out")
    merged = {**(options or {}), **kwargs}
    key = tuple(sorted((k, repr(v)) for k, v in merged.items()))
    if key not in _BACKENDS:
        opts = Options.parse(merged)
        if opts.guards != "all":
            raise ValueError(
                f"guards={opts.guards!r} is autopar.compile's: torch.compile(backend='autopar') "
                "calls go through dynamo's frame and guards, which a backend does not decide; "
                f"write autopar.compile(fn, guards={opts.guards!r})")
        _BACKENDS[key] = make_backend(make_runner(opts))
    try:
        return _BACKENDS[key](gm, example_inputs)
    except Exception as e:
        if not data_dependent(e):
            raise
        log.warning("autopar: a graph reads values captured in it that this torch's "
                    "aot_autograd can't trace (%s: %s); it runs as captured, op by op",
                    type(e).__name__, first_line(e))
        return gm.forward
