"""autopar: automatic parallelism for PyTorch.

Capture a function as a graph of ATen ops, predict each op's cost on every device, place ops
where the whole graph finishes soonest, and run the plan asynchronously.
"""

from __future__ import annotations

import torch

from .api import CompileOptions, Options, compile, data_parallel, parse_devices
from .backend import autopar_backend
from .doctor import DoctorReport, Finding, doctor
from .ir.graph import Graph, Node, TensorMeta
from .ir.logs import configure_from_env as _configure_logs
from .ir.logs import set_logs
from .report.explain import ExplainReport, explain

__all__ = ["CompileOptions", "DoctorReport", "ExplainReport", "Finding", "Graph", "Node",
           "Options", "TensorMeta", "compile", "data_parallel", "doctor", "explain",
           "parse_devices", "set_logs"]
__version__ = "0.1.0"


def _register_backend() -> None:
    from torch._dynamo import list_backends, register_backend  # lazy: slow to import

    if "autopar" not in list_backends(exclude_tags=()):
        register_backend(autopar_backend, name="autopar")


_register_backend()
_configure_logs()
del torch
