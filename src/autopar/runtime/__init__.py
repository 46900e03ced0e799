"""autopar.runtime: the only package with threads, streams, events and pinned memory.

It obeys a Plan and never decides placement.
"""

from .executor import Executor, WorkerError
from .sequential import SequentialRunner

__all__ = ["Executor", "SequentialRunner", "WorkerError"]
