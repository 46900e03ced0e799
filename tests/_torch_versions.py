"""What the torch under test can trace, as markers for the tests that need it."""

import pytest
import torch

# aot_autograd of torch 2.11 fails on slice bounds read in the graph (GuardOnDataDependentSymNode,
# W1's); 2.13's traces them. Where it fails, autopar.compile traces with graph breaks and the
# registered backend runs the graph as captured (tests/test_scalars.py, tests/test_backend.py)
aot_traces_bounds = pytest.mark.skipif(
    torch.__version__ < "2.13", reason="this torch's aot_autograd fails on slice bounds read "
    "in the graph (GuardOnDataDependentSymNode): measured on 2.11, traced on 2.13")

# dynamo of torch 2.11 keeps a module's graph traced with its parameters frozen after
# requires_grad_(True) (torch.compile's output then has no grad; measured on 2.11, re-guarded
# on 2.13): where autopar's own entry sends the call to dynamo, it gets that graph
dynamo_guards_requires_grad_of_parameters = pytest.mark.skipif(
    torch.__version__ < "2.13", reason="this torch's dynamo keeps a frozen module's graph after "
    "requires_grad_(True): measured on 2.11")

# dynamo of torch 2.11 refuses a compiled call made while another thread's compile runs
# aot_autograd's make_fx (FX's process-wide flag; "symbolically trace a dynamo-optimized
# function"): torch.compile(fn, backend="aot_eager") from 4 threads of varying sizes failed 17
# of 120 calls on 2.11, none on 2.13, which exempts calls while dynamo compiles
dynamo_calls_beside_other_threads_compiles = pytest.mark.skipif(
    torch.__version__ < "2.13", reason="this torch's dynamo refuses calls while another "
    "thread's compile traces (aot_eager itself: 17 of 120 calls on 2.11)")
