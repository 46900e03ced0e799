"""Training steps on every GPU of a machine, side by side: one GPU against torchrun.

    python benchmarks/distributed_steps.py [--models gpt2 resnet50 bert] [--gpus N]
        [--ways eager,compile-ro,autopar,ddp,ddp-compile,autopar-dist] [--size real|tiny]
        [--json out.json]

Ways, each in a process (or a torchrun world) of its own, on the same global batch:
- ``eager``, ``compile-ro`` (the whole step under ``torch.compile(mode="reduce-overhead")``)
  and ``autopar`` (``autopar.compile`` of the step): one GPU, the whole batch;
- ``ddp`` and ``ddp-compile``: ``torchrun --nproc-per-node N``, the usual script: the model
  under ``DistributedDataParallel`` (then ``torch.compile`` of it), each rank given its rows of
  the batch, as a ``DistributedSampler`` would;
- ``autopar-dist``: ``torchrun``, ``autopar.data_parallel(step)`` passed the global batch.

Each way runs ``--warm`` untimed steps (autopar's trials end in them), then ``--steps`` timed
steps, each synchronized; ``step_s`` is the slowest rank's median. ``peak_gib`` is the largest
rank's ``max_memory_allocated``. Every way's first ``CHECKED`` losses (the global batch's mean)
are checked against eager's before any time is reported. The table gives each way's speed-up
over the best one-GPU way on the same batch (strong scaling). TF32 off: fp32 throughout.
Models: GPT-2 small (124M, 16 x 512, AdamW), ResNet-50 (Hugging Face's, 256 x 224², SGD
momentum 0.9), BERT-base (masked LM, 16 x 256, AdamW); ``--size tiny`` for a CPU check.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("eager", "compile-ro", "autopar", "ddp", "ddp-compile", "autopar-dist")
ONE_GPU = ("eager", "compile-ro", "autopar")
LAUNCHED = ("ddp", "ddp-compile", "autopar-dist")
CHECKED = 3
LOSS_RTOL = 1e-3


# -- the models --------------------------------------------------------------------------------
def _model(name: str, size: str) -> tuple[torch.nn.Module, Any, Any]:
    """(model, optimizer factory, batch maker(device) -> kwargs of the model)."""
    import transformers

    tiny = size == "tiny"
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      **(dict(n_layer=2, n_head=2, n_embd=64, vocab_size=128,
                                              n_positions=64) if tiny else {}))
        model = transformers.GPT2LMHeadModel(cfg)
        rows, length = (4, 32) if tiny else (16, 512)

        def batch(device: torch.device) -> dict:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g).to(device)
            return {"input_ids": ids, "labels": ids}
        return model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), batch
    if name == "bert":
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      **(dict(num_hidden_layers=2, num_attention_heads=2,
                                              hidden_size=64, intermediate_size=128,
                                              vocab_size=128) if tiny else {}))
        model = transformers.BertForMaskedLM(cfg)
        rows, length = (4, 32) if tiny else (16, 256)

        def batch(device: torch.device) -> dict:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g)
            labels = torch.where(torch.rand(rows, length, generator=g) < 0.15, ids, -100)
            return {"input_ids": ids.to(device), "labels": labels.to(device)}
        return model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), batch
    if name == "resnet50":
        cfg = transformers.ResNetConfig(**(dict(embedding_size=16, hidden_sizes=[16, 32],
                                                depths=[1, 1], num_labels=10) if tiny else {}))
        model = transformers.ResNetForImageClassification(cfg)
        rows, side = (8, 32) if tiny else (256, 224)

        def batch(device: torch.device) -> dict:
            g = torch.Generator().manual_seed(1)
            return {"pixel_values": torch.randn(rows, 3, side, side, generator=g).to(device),
                    "labels": torch.randint(0, cfg.num_labels, (rows,), generator=g).to(device)}
        return model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), batch
    raise ValueError(f"unknown model {name!r}: gpt2, bert or resnet50")


# -- one way, in this process (one rank of a world where launched) ------------------------------
def _rows(n: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s rows of ``n``, as autopar splits them (the first ranks larger)."""
    from autopar.passes.shard import even_sizes  # (the worker runs with src/ on its path)

    sizes = even_sizes(n, size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def worker(a: argparse.Namespace) -> None:
    if os.environ.get("DUMP_STACKS_AFTER_S"):  # a hang shows where, before the driver's kill
        faulthandler.dump_traceback_later(float(os.environ["DUMP_STACKS_AFTER_S"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    launched = "LOCAL_RANK" in os.environ
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    import torch.distributed as dist

    model, make_opt, make_batch = _model(a.model, a.size)
    model = model.to(device).train()
    opt = make_opt(model)
    batch = make_batch(device)
    run: Any = model
    if a.way in ("ddp", "ddp-compile"):
        dist.init_process_group("nccl" if cuda else "gloo")
        run = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
        if a.way == "ddp-compile":
            run = torch.compile(run)
        mine = _rows(next(iter(batch.values())).shape[0], rank, size)
        batch = {k: v[mine] for k, v in batch.items()}

    def step(**kw: Any) -> torch.Tensor:
        opt.zero_grad()
        loss = run(**kw).loss
        loss.backward()
        opt.step()
        return loss.detach()

    if a.way == "compile-ro":
        step = torch.compile(step, mode="reduce-overhead")
    elif a.way == "autopar":
        import autopar
        step = autopar.compile(step)
    elif a.way == "autopar-dist":
        import autopar
        step = autopar.data_parallel(step)

    def loss_of(out: torch.Tensor) -> float:
        value = out.detach().double().clone()
        if a.way in ("ddp", "ddp-compile"):  # the rank's mean: the global batch's is their mean
            dist.all_reduce(value)
            value /= size
        return float(value)

    losses, times = [], []
    start = time.perf_counter()
    for k in range(a.warm + a.steps):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = step(**batch)
        if cuda:
            torch.cuda.synchronize(device)
        if k >= a.warm:
            times.append(time.perf_counter() - t)
        if k < CHECKED:
            losses.append(loss_of(out))
        if k == a.warm - 1:
            first_s = time.perf_counter() - start
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0],
                        dtype=torch.float64)
    if launched and dist.is_initialized():
        for t in (median, peak):
            t_ = t.to(device) if dist.get_backend() == "nccl" else t
            dist.all_reduce(t_, op=dist.ReduceOp.MAX)
            t.copy_(t_.cpu())
    if rank == 0:
        Path(a.json).write_text(json.dumps({
            "step_s": float(median), "peak_gib": float(peak), "losses": losses,
            "warm_s": first_s, "ranks": size,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__}))
    if launched and dist.is_initialized():
        dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------
def _launch(a: argparse.Namespace, model: str, way: str, gpus: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        args = [__file__, "--worker", "--model", model, "--way", way, "--size", a.size,
                "--warm", str(a.warm), "--steps", str(a.steps), "--json", str(out)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(gpus), *args] if way in LAUNCHED \
            else [sys.executable, *args]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                   PYTHONFAULTHANDLER="1", DUMP_STACKS_AFTER_S=str(max(a.timeout - 15, 5)))
        t = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:  # the agent and its ranks: none left behind
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            tail = text.strip().splitlines()[-12:]
            return {"error": f"timed out after {a.timeout} s: " + " | ".join(tail)}
        if proc.returncode or not out.exists():
            tail = text.strip().splitlines()[-12:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
        row = json.loads(out.read_text())
        row["wall_s"] = time.monotonic() - t
        return row


def _check(rows: dict[str, dict], ways: list[str]) -> None:
    want = rows.get("eager", {}).get("losses")
    for way in ways:
        row = rows[way]
        if "error" in row or not want or way == "eager":
            continue
        off = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(row["losses"], want))
        row["loss_rel_err"] = off
        if off > LOSS_RTOL:
            row["error"] = f"losses {row['losses']} differ from eager's {want} ({off:.1e})"


def table(results: dict[str, dict[str, dict]], gpus: int) -> str:
    lines = ["| model | way | GPUs | step | vs best one-GPU way | peak GiB a GPU | losses |",
             "|---|---|---|---|---|---|---|"]
    for model, rows in results.items():
        ones = [r["step_s"] for w, r in rows.items() if w in ONE_GPU and "error" not in r]
        best = min(ones) if ones else None
        for way, r in rows.items():
            if "error" in r:
                lines.append(f"| {model} | {way} | | failed: {r['error'][:120]} | | | |")
                continue
            ratio = f"{best / r['step_s']:.2f}×" if best else ""
            err = r.get("loss_rel_err")
            lines.append(f"| {model} | {way} | {1 if way in ONE_GPU else gpus} | "
                         f"{r['step_s'] * 1e3:.2f} ms | {ratio} | {r['peak_gib']:.1f} | "
                         + ("eager's" if way == "eager" else f"within {err:.0e}") + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "resnet50", "bert"])
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}")
    ap.add_argument("--gpus", type=int, default=None,
                    help="ranks of the launched ways (default: every GPU, else 2 on a host)")
    ap.add_argument("--size", default="real", choices=("real", "tiny"))
    ap.add_argument("--warm", type=int, default=30, help="untimed steps (trials end in them)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--timeout", type=float, default=420, help="seconds a way")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--way", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    ways = [w.strip() for w in a.ways.split(",")]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        ap.error(f"unknown ways {unknown}: of {', '.join(WAYS)}")
    gpus = a.gpus or torch.cuda.device_count() or 2
    results: dict[str, dict[str, dict]] = {}
    for model in a.models:
        rows = results[model] = {}
        for way in ways:
            print(f"{model} {way} ...", flush=True)
            rows[way] = _launch(a, model, way, gpus)
            row = rows[way]
            print("  " + (row["error"] if "error" in row else f"{row['step_s'] * 1e3:.2f} ms"),
                  flush=True)
        _check(rows, ways)
    print(table(results, gpus))
    if a.json:
        Path(a.json).write_text(json.dumps({"gpus": gpus, "size": a.size, "argv": sys.argv,
                                            "results": results}, indent=1))


if __name__ == "__main__":
    main()
