"""How one set of outputs differs from another: the one comparison the measured choice's
results check (:func:`autopar.choose.results_differ`) and a CUDA graph's first replay
(:class:`autopar.runtime.cudagraphs.GraphedCall`) make.

Policy: the same structure (pytree), tensors of the same shape and dtype, floating ones within
a relative error in norm (computed in float64), others equal; non-tensor leaves are not
compared. The tolerance is the caller's: one for 16-bit outputs (or all under autocast), one
for the rest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["outputs_differ"]


def outputs_differ(got: Any, want: Any, tol: float, tol_16bit: float | None = None) -> str | None:
    """How ``got`` differs from ``want`` beyond ``tol`` (``tol_16bit`` for 16-bit outputs,
    default ``tol``), or None."""
    g, g_spec = tree_flatten(got)
    w, w_spec = tree_flatten(want)
    if g_spec != w_spec:
        return "another structure of outputs"
    for i, (a, b) in enumerate(zip(g, w)):
        if not isinstance(b, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is not a {b.dtype} tensor of shape {tuple(b.shape)}"
        if a.is_meta or b.is_meta:  # no values to compare
            continue
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        bound = tol_16bit if tol_16bit is not None and b.element_size() <= 2 else tol
        with torch.no_grad():
            a64, b64 = a.detach().double(), b.detach().double()
            err = float((a64 - b64).norm() / b64.norm().clamp_min(1e-12))
        if not err <= bound:
            return f"output {i}: relative error {err:.2e} > {bound:g}"
    return None
