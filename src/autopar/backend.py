"""``torch.compile(fn, backend="autopar")``: the dynamo backend registered under that name (and
as the ``torch_dynamo_backends`` entry point), built on :func:`autopar.capture.dynamo.make_backend`
with :func:`autopar.api.make_runner`'s runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from .api import Options, make_runner
from .capture.dynamo import make_backend

__all__ = ["autopar_backend"]

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
    """
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
    return _BACKENDS[key](gm, example_inputs)
