"""fp16 steps with a ``GradScaler`` split on one device, against the same step run eagerly
(NOTES 2026-12-05 (d)): six steps, the fifth with an inf in its batch, for fused and foreach
AdamW, with and without CUDA graphs. Per case: each call's loss, scale and whether it split;
the largest parameter difference; a failure's traceback (the plan's, kept by the step); and
where the plan put every ``_foreach_add``, ``where`` and ``lift_fresh_copy`` with the routes
of their inputs.

    PYTHONPATH=src python benchmarks/probes/scaler_steps.py [--device cuda] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

import autopar
from autopar.ir.routing import index_of, route

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _steps import batches_on, scaler_step, small_net


def placed(compiled) -> list:
    plan = compiled.choice.plan
    dev, ix = plan.placement.device, index_of(plan.placement, plan.graph)
    rows = []
    for n in plan.graph.ops:
        name = str(n.op)
        if any(k in name for k in ("_foreach_add", "where", "lift_fresh")):
            rows.append([n.name, name, dev.get(n), [
                (i.name, i.device, dev.get(i), route(i, dev[i], dev[n], ix))
                for i in n.inputs[:3]]])
    return rows[:40]


def case(device: str, fused: bool, graphs: bool) -> dict:
    model, ref = small_net(device), small_net(device)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
                    for m in (model, ref))
    kind = device.split(":")[0]
    scaler, ref_scaler = (torch.amp.GradScaler(kind, init_scale=2.0 ** 8) for _ in range(2))
    cpus = kind == "cpu"
    dtype = torch.bfloat16 if cpus else torch.float16
    step = autopar.data_parallel(scaler_step(model, opt, scaler, kind, dtype),
                                 devices="cpu:0,cpu:1" if cpus else device,
                                 shards=2 if cpus else 1, cuda_graphs=graphs)
    ref_step = scaler_step(ref, ref_opt, ref_scaler, kind, dtype)
    out: dict = {"calls": []}
    try:
        for k, (x, y) in enumerate(batches_on(device, 6)):
            if k == 4:
                x = x.clone()
                x[0, 0] = float("inf")
            got, want = step(x, y), ref_step(x, y)
            out["calls"].append([k, step.last is not None, float(got), float(want),
                                 scaler.get_scale(), ref_scaler.get_scale()])
        with torch.no_grad():
            out["max_param_diff"] = max(float((p - q).abs().max())
                                        for p, q in zip(model.parameters(), ref.parameters()))
    except Exception:
        out["error"] = traceback.format_exc()
    for c in step._compiled.values():
        if c is not None:
            if c.failed is not None:
                out["failed"] = "".join(traceback.format_exception(c.failed))
            out["placed"] = placed(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {}
    for fused in (False, True):
        for graphs in (False, True):
            key = f"fused={fused} cuda_graphs={graphs}"
            results[key] = r = case(a.device, fused, graphs)
            split = sum(c[1] for c in r["calls"])
            print(f"{key}: {len(r['calls'])} calls, {split} split, max param diff "
                  f"{r.get('max_param_diff')}, error: {'error' in r}, plan failed: "
                  f"{'failed' in r}")
            for k in ("error", "failed"):
                if k in r:
                    print(r[k][-2500:])
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
