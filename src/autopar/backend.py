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

_DEFAULT_BACKEND: list[Callable] = []


def autopar_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any):
    """The ``torch.compile(fn, backend="autopar")`` entry point.

    With default options, one runner (one machine and cost model) serves every graph of the
    process; options given through ``torch.compile(..., options=...)`` get a runner of their own.
    """
    if options:
        return make_backend(make_runner(Options.parse(options)))(gm, example_inputs)
    if not _DEFAULT_BACKEND:
        _DEFAULT_BACKEND.append(make_backend(make_runner(Options.parse({}))))
    return _DEFAULT_BACKEND[0](gm, example_inputs)
