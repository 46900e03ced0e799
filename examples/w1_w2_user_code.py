"""W1 and W2 as a user writes them: 0-dim CUDA tensors as slice bounds and as numbers.

    autopar doctor examples/w1_w2_user_code.py                   # on a machine with a GPU
    autopar doctor examples/w1_w2_user_code.py --machine h200x2  # anywhere: simulates the GPU

The doctor finds the four slice bounds read back to the host on every call of ``w1`` (a sync
each) and the GPU scalar ``a1`` of ``w2``, whose ``a1 ** 2`` is a kernel launch of its own.
The fix for both is the same: keep scalars Python numbers.
"""

import torch

__doctor__ = ["w1", "w2"]


def w1(A, B, r0, r1, c0, c1):
    """Copy a window of A into B; the window's bounds are 0-dim CUDA tensors."""
    B[:] = A[r0:r1, c0:c1]
    return B


def w2(A, a1):
    """Scale A by a scalar that lives on the GPU, and add its square."""
    return a1 * A + a1 ** 2


def example_inputs():
    A = torch.rand(600, 600, device="cuda")
    B = torch.rand(256, 256, device="cuda")
    r0, r1, c0, c1 = (torch.tensor(v, device="cuda") for v in (100, 356, 100, 356))
    a1 = torch.tensor(10.0, device="cuda")
    return {"w1": (A, B, r0, r1, c0, c1), "w2": (A, a1)}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a GPU; without one, run: "
                         "autopar doctor examples/w1_w2_user_code.py --machine h200x2")
    inputs = example_inputs()
    print("w1:", w1(*inputs["w1"]).sum().item(), " w2:", w2(*inputs["w2"]).sum().item())
