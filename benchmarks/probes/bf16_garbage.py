"""Probe of the bf16 failure (benchmarks/NOTES.md, 2026-12-02): does ``torch.compile``'s own
code for HF's ViT under bf16 autocast read memory it never wrote? The caching allocator's
free blocks are filled with NaN (or a large value) before each call; outputs that change
with that fill read uninitialized memory. No autopar code runs here but the model registry.

    PYTHONPATH=src python benchmarks/probes/bf16_garbage.py [cuda:0] [vit|timm-vit-tiny] [sdpa]

``sdpa``: instead, each attention kernel alone (eager and compiled), ten compiled calls each.
``configs``: Inductor's and cuDNN's switches one at a time, ``PROBE_CALLS`` compiled calls
each (default 8), only the settings named in ``PROBE_ONLY`` (comma-separated labels) if set.
"""
import os
import sys

import torch

from autopar.bench.models import MODELS, flat_tensors, inputs_for

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
m = MODELS[sys.argv[2] if len(sys.argv) > 2 else "vit"]
if os.environ.get("ONE_THREAD"):
    import torch._inductor.config as cfg
    cfg.compile_threads = 1
torch.manual_seed(0)
model = m.make("small").eval().to(dev)
args, kwargs = inputs_for(m, "small", batch=8, device=dev)


def outs(o):
    return [t.float() for t in flat_tensors(o)]


def err(got, want):
    return [f"{((g - w).norm() / w.norm()).item():.3g}" for g, w in zip(got, want)]


def dirty(value: float) -> None:
    """Fill the allocator's free memory (blocks it holds, and new ones it keeps) with value."""
    free = torch.cuda.mem_get_info()[0]
    held = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    n = int(min(held + (1 << 30), free // 2) // 4)
    xs = [torch.full((n // 8,), value, device=dev) for _ in range(8)]
    del xs


if len(sys.argv) > 3 and sys.argv[3] == "configs":  # Inductor's options, one at a time
    import torch._inductor.config as icfg
    def cudnn_det(on: bool) -> None:
        torch.backends.cudnn.deterministic = on

    def algos_det(on: bool) -> None:
        torch.use_deterministic_algorithms(on, warn_only=True)

    settings = [("as is", {}, None), ("layout_optimization off", {"layout_optimization": False},
                                      None),
                ("cudnn deterministic", {}, cudnn_det),
                ("deterministic algorithms", {}, algos_det),
                ("split_reductions off", {"split_reductions": False}, None),
                ("persistent_reductions off", {"triton.persistent_reductions": False}, None),
                ("pattern_matcher off", {"pattern_matcher": False}, None),
                # pytorch/pytorch#191433 (sm_120): a fused kernel's in-place buffer read back
                # after a bf16 result was mixed in
                ("inplace_buffers off", {"inplace_buffers": False}, None),
                ("allow_buffer_reuse off", {"allow_buffer_reuse": False}, None)]
    only = os.environ.get("PROBE_ONLY")  # e.g. "as is,cudnn deterministic"
    calls = int(os.environ.get("PROBE_CALLS", "8"))
    for label, patch, switch in settings:
        if only and label not in only.split(","):
            continue
        torch._dynamo.reset()
        if switch:
            switch(True)
        with icfg.patch(patch), torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            want = outs(model(*args, **kwargs))
            c = torch.compile(model)
            errs = [err(outs(c(*args, **kwargs)), want) for _ in range(calls)]
            print(f"{label}: max per output", [max(float(e[i]) for e in errs) for i in (0, 1)],
                  "least of output 0", min(float(e[0]) for e in errs), flush=True)
        if switch:
            switch(False)
    sys.exit(0)

if len(sys.argv) > 3 and sys.argv[3] == "sdpa":  # the attention kernel, one at a time
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]:
        torch._dynamo.reset()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), \
                sdpa_kernel([backend]):
            try:
                want = outs(model(*args, **kwargs))
                c = torch.compile(model)
                errs = [err(outs(c(*args, **kwargs)), want) for _ in range(10)]
                again = [err(outs(model(*args, **kwargs)), want) for _ in range(3)]
                print(backend.name, "compiled:", errs, "eager again:", again, flush=True)
            except RuntimeError as e:
                print(backend.name, "raised", str(e)[:120], flush=True)
    sys.exit(0)

with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    want = outs(model(*args, **kwargs))
    c = torch.compile(model)
    for fill in [None, None, float("nan"), 1e4, None, float("nan"), -3.0, None]:
        if fill is not None:
            dirty(fill)
        got = outs(c(*args, **kwargs))
        torch.cuda.synchronize()
        print("fill", fill, "rel err per output:", err(got, want), flush=True)
    # and eager itself, after a fill: eager never reads what it did not write
    dirty(float("nan"))
    print("eager after NaN fill:", err(outs(model(*args, **kwargs)), want), flush=True)
