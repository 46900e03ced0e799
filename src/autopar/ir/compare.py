"""How one set of outputs differs from another: the one comparison the measured choice's
results check (:func:`autopar.choose.results_differ`) and a CUDA graph's first replay
(:class:`autopar.runtime.cudagraphs.GraphedCall`) make.

Policy: the same structure (pytree), tensors of the same shape and dtype, floating and complex
ones within a relative error in norm (computed in float64 or complex128), others equal; sparse
ones by their dense values; non-tensor leaves are not compared. The tolerance is the caller's:
one for 16-bit outputs (or all under autocast), one for the rest.
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
        if b.layout != torch.strided:  # sparse: its values, densely
            a, b = a.to_dense(), b.to_dense()
        inexact = b.is_floating_point() or b.is_complex()
        if not inexact:
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        part = b.element_size() // (2 if b.is_complex() else 1)  # complex32: two 16-bit parts
        bound = tol_16bit if tol_16bit is not None and part <= 2 else tol
        wide = torch.complex128 if b.is_complex() else torch.float64
        with torch.no_grad():
            a64, b64 = a.detach().to(wide), b.detach().to(wide)
            err = float((a64 - b64).norm() / b64.norm().clamp_min(1e-12))
        if not err <= bound:
            return f"output {i}: relative error {err:.2e} > {bound:g}"
    return None
