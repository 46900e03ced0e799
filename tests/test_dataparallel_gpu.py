"""``autopar.data_parallel`` on two real GPUs: training steps equal eager on one GPU, replicas
stay resident between steps. Skips cleanly without two CUDA devices."""

from __future__ import annotations

import pytest
import torch

import autopar
from _steps import batches_on, bn_inputs, bn_step, mlp_inputs, module_step, small_net
from autopar.bench.workloads import w6_train_step

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GPUS = "cuda:0,cuda:1"


def on_gpu(tensors: tuple) -> tuple:
    return tuple(t.detach().to("cuda:0").requires_grad_(t.requires_grad) for t in tensors)


def assert_same(got, want, tol: float = 1e-4) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.device == w.device
        torch.testing.assert_close(g.detach(), w.detach(), rtol=tol, atol=tol)


def test_twenty_w6_steps_over_two_gpus_equal_eager_on_one():
    ref = on_gpu(mlp_inputs(batch=301, d_in=64, hidden=128, classes=10))
    mine = on_gpu(mlp_inputs(batch=301, d_in=64, hidden=128, classes=10))
    step = autopar.data_parallel(w6_train_step, devices=GPUS, shards=2)
    for _ in range(20):
        loss = step(*mine)
        want = w6_train_step(*ref)
        assert loss.device == want.device
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    assert step.last.sharded.devices == ("cuda:0", "cuda:1")
    assert step.last.sharded.sizes == (151, 150)
    assert_same(mine, ref)
    assert all(p.grad is None for p in mine[:4])


def test_replicas_are_made_once_and_again_only_after_an_outside_change():
    ref = on_gpu(mlp_inputs(batch=64, d_in=32, hidden=64))
    mine = on_gpu(mlp_inputs(batch=64, d_in=32, hidden=64))
    step = autopar.data_parallel(w6_train_step, devices=GPUS, shards=2)
    for _ in range(5):
        step(*mine)
        w6_train_step(*ref)
    assert step.replica_copies == 4  # one per parameter, on the first call only
    with torch.no_grad():  # the user changes a parameter between steps
        mine[0].mul_(0.5)
        ref[0].mul_(0.5)
    torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-4, atol=1e-4)
    assert step.replica_copies == 5
    assert_same(mine, ref)
    mine[0].data.mul_(0.5)  # unseen: .data leaves the version as it was
    ref[0].data.mul_(0.5)
    step.refresh()
    torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-4, atol=1e-4)
    assert step.replica_copies == 9  # every parameter again
    assert_same(mine, ref)


def test_batch_norm_step_over_two_gpus_equals_eager():
    ref, mine = on_gpu(bn_inputs(batch=33)), on_gpu(bn_inputs(batch=33))
    step = autopar.data_parallel(bn_step, devices=GPUS, shards=2)
    for _ in range(5):
        torch.testing.assert_close(step(*mine), bn_step(*ref), rtol=1e-4, atol=1e-4)
    assert_same(mine, ref)


def test_inference_batch_split_over_two_gpus():
    def predict(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g).cuda() for s in ((1001, 64), (64, 256),
                                                                (256, 8)))
    step = autopar.data_parallel(predict, devices=GPUS, batch_argnums=(0,), shards=2)
    out = step(x, w1, w2)
    assert out.device == torch.device("cuda:0") and out.shape == (1001, 8)
    torch.testing.assert_close(out, predict(x, w1, w2), rtol=1e-4, atol=1e-4)


def test_cost_model_choice_runs_and_equals_eager():
    ref = on_gpu(mlp_inputs(batch=2048, d_in=512, hidden=1024, classes=10))
    mine = on_gpu(mlp_inputs(batch=2048, d_in=512, hidden=1024, classes=10))
    step = autopar.data_parallel(w6_train_step, devices="auto")
    for _ in range(3):
        torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-4, atol=1e-4)
    assert "unsplit" in step.last.choice.predicted
    assert_same(mine, ref)


def net() -> torch.nn.Module:
    return small_net("cuda:0")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_module_steps_with_cuda_graphs_over_two_gpus_equal_eager_on_one(optimizer):
    """Each GPU's segments replayed as CUDA graphs (``cuda_graphs=True``): parameters,
    replicas and optimizer state read where they live, .grads, new values and replicas' next
    values written back out of the graphs' memory; ten steps equal eager's on one GPU, and
    the segments are captured."""
    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-2) if optimizer == "adamw" else \
            torch.optim.SGD(ps, lr=1e-2, momentum=0.9)

    model, ref = net(), net()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    step = autopar.data_parallel(module_step(model, opt), devices=GPUS, shards=2, cuda_graphs=True)
    ref_step = module_step(ref, ref_opt)
    for x, y in batches_on("cuda:0", 10):
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-4)
    assert_same(list(model.parameters()), list(ref.parameters()))
    assert_same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    segs = step.last.run.segments
    assert segs and all(s.status == "captured" for s in segs)


def test_gradient_sums_as_collectives_over_two_gpus_equal_eager_with_identical_replicas():
    """W6 split over two GPUs with every sum one collective (``collectives=True``; the
    default keeps copies and adds over two): the executor runs the collectives' lane (NCCL
    where torch has it, else each GPU adding the parts); the step equals eager's on one GPU
    and both replicas' next values have home's bits."""
    from autopar.capture.step import capture_step
    from autopar.cost.model import CostModel
    from autopar.ir.collective import COMM
    from autopar.machine.presets import preset
    from autopar.passes.shard import shard
    from autopar.runtime import Executor
    from autopar.schedule.place import place
    from autopar.schedule.plan import make_plan

    inputs = on_gpu(mlp_inputs(batch=301, d_in=64, hidden=128, classes=10))
    step = capture_step(w6_train_step, inputs)
    g = step.graph
    s = shard(g, {g.inputs[4]: 0, g.inputs[5]: 0}, ["cuda:0", "cuda:1"],
              updates=step.updates, collectives=True)
    plan = make_plan(place(s.graph, CostModel(preset("h200x2")), pins=s.pins))
    assert COMM in plan.programs
    args = [t.detach() for t in inputs]
    replicas = [args[j].to(d) for j, d in s.replicas]
    want = w6_train_step(*[t.detach().clone().requires_grad_(t.requires_grad) for t in inputs])
    got = Executor(plan)(args + replicas)
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    updated = dict(zip(step.mutated, got[1:5]))
    for (j, _), replica in zip(s.replica_outputs, got[5:], strict=True):
        assert replica.device == torch.device("cuda:1")
        assert torch.equal(replica.cpu(), updated[j].cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs")
def test_module_step_over_three_gpus_reduces_by_collectives_and_equals_eager():
    ref, mine = net(), net()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, mine)]
    x, t = torch.randn(97, 32, device="cuda:0"), torch.randint(0, 8, (97,), device="cuda:0")
    eager, split = module_step(ref, opts[0]), autopar.data_parallel(
        module_step(mine, opts[1]), devices="cuda:0,cuda:1,cuda:2", shards=3)
    for _ in range(5):
        torch.testing.assert_close(split(x, t), eager(x, t), rtol=1e-4, atol=1e-4)
    assert_same(list(mine.parameters()), list(ref.parameters()))
    assert any(getattr(n.op, "__name__", "") == "all_reduce"
               for n in split.last.sharded.graph.ops)
