"""Scenarios of ``autopar.data_parallel`` under torchrun, each checked against one process.

Run by ``tests/test_distributed.py`` as ``torchrun --nproc-per-node 2 _dist_cases.py``. In each
rank a twin of the model trains eagerly on the whole batch (what ``python script.py`` computes)
beside the one autopar trains on the rank's share; after every step the returned loss, the
parameters, their ``.grad``, the buffers and the optimizer state must be equal. Each case prints
``PASS name`` or ``FAIL name: why`` on every rank.
"""

import logging
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from _steps import module_step  # this file's folder: run as a script from tests/
from autopar.distributed.agree import RanksDisagree

TOL = dict(rtol=1e-4, atol=1e-6)


def same(a, b, what):
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    for name, x in a.items():
        torch.testing.assert_close(x, b[name], **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def state_of(model, opt, params_only=False):
    out = {f"param {n}": p.detach() for n, p in model.named_parameters()}
    if params_only:
        return out
    out |= {f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    out |= {f"buffer {n}": b for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        out |= {f"opt {names[id(p)]} {k}": v for k, v in s.items() if isinstance(v, torch.Tensor)}
    return out


def twins(make):
    torch.manual_seed(0)
    ours = make()
    torch.manual_seed(0)
    return ours, make()


def train(make, batches, step_of, steps=4):
    """Train a model eagerly on whole batches and one through autopar on shares; compare."""
    (model, opt, extra), (twin, twin_opt, twin_extra) = twins(make)
    ours = autopar.data_parallel(step_of(model, opt, extra))
    eager = step_of(twin, twin_opt, twin_extra)
    for k in range(steps):
        args = batches(k)
        got, want = ours(*args), eager(*args)
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **TOL,
                                   msg=lambda m, k=k: f"loss at step {k}: {m}")
        same(state_of(model, opt), state_of(twin, twin_opt), f"step {k}")


def mlp_bn(hidden=16):
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden, bias=False),
                                torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), None


def data(k, rows=7):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def case_uneven_shards_batch_norm_clip():
    """7 rows over 2 ranks (4 + 3), batch norm, AdamW, the global gradient norm clipped."""
    def step_of(model, opt, _):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss.detach()
        return step
    train(mlp_bn, data, step_of)


def case_masked_token_mean():
    """A cross-entropy over tokens with ignore_index: the ranks' shares hold other counts."""
    def make():
        model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    def batches(k):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 20, (5, 6), generator=g)
        labels = torch.where(torch.rand(5, 6, generator=g) < 0.3, ids, -100)
        labels[3:] = torch.where(torch.arange(6) < k, labels[3:], -100)  # step 0: none there
        return ids, labels

    def step_of(model, opt, _):
        def step(ids, labels):
            opt.zero_grad()
            loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    train(make, batches, step_of)


def case_grad_scaler():
    """GradScaler scales the loss (walked through) and every rank agrees on its inf check."""
    def make():
        model, opt, _ = mlp_bn()
        return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    def step_of(model, opt, scaler):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()
        return step
    train(make, data, step_of)


def case_parameters_as_arguments_sum_loss():
    """Tensors that require grad passed as arguments, a summed loss, a hand-written update."""
    torch.manual_seed(0)
    w = torch.randn(8, 3, requires_grad=True)
    twin = w.detach().clone().requires_grad_()

    def step(w, x, y):
        loss = ((x @ w - F.one_hot(y, 3).float()) ** 2).sum()
        loss.backward()
        with torch.no_grad():
            w -= 0.01 * w.grad
        w.grad = None
        return loss.detach()

    ours = autopar.data_parallel(step)
    for k in range(4):
        x, y = data(k)
        torch.testing.assert_close(ours(w, x, y), step(twin, x, y), **TOL)
        torch.testing.assert_close(w, twin, **TOL)


def case_unknown_reduction_weighs_rows():
    """A sum of two means over rows: the reduction is unknown, rows weigh ranks (exact here),
    and the rank says so."""
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("autopar.dataparallel").addHandler(handler)

    def step_of(model, opt, _):
        def step(x, y):
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y) + 0.1 * (out ** 2).mean()
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    train(mlp_bn, data, step_of)
    assert any("AddBackward0" in m for m in seen), seen


def case_per_rank_batches_average():
    """batch="per_rank": each rank is passed its own batch, gradients are averaged (DDP)."""
    (model, opt, _), (twin, twin_opt, _) = twins(mlp_bn)
    ours = autopar.data_parallel(module_step(model, opt), batch="per_rank")
    eager = module_step(twin, twin_opt)
    rank = dist.get_rank()
    for k in range(3):
        x, y = data(k, rows=8)
        ours(x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
        eager(x, y)
        same(state_of(model, opt, True), state_of(twin, twin_opt, True), f"step {k}")


def case_ranks_disagree_on_a_shape():
    """Rank 1 passes another batch shape: every rank raises, naming rank 1 and the argument."""
    model, opt, _ = mlp_bn()
    ours = autopar.data_parallel(module_step(model, opt))
    ours(*data(0))
    said = ours.describe()
    assert f"rank {dist.get_rank()} of 2 on cpu (gloo)" in said and "1 batch-norm" in said, said
    x, y = data(1, rows=7 if dist.get_rank() == 0 else 6)
    try:
        ours(x, y)
    except RanksDisagree as e:
        assert "rank 1" in str(e) and "argument 0" in str(e) and "(6, 8)" in str(e), str(e)
        return
    raise AssertionError("no error")


def case_ranks_disagree_on_the_model():
    """Rank 1 built another model: every rank raises, naming the parameter."""
    model, opt, _ = mlp_bn(16 if dist.get_rank() == 0 else 12)
    try:
        autopar.data_parallel(module_step(model, opt))(*data(0))
    except RanksDisagree as e:
        assert "model" in str(e) and "0.weight" in str(e) and "rank 1" in str(e), str(e)
        return
    raise AssertionError("no error")


def case_children_called_directly():
    """The step runs a module's children, not its forward (DDP never arms its reducer): their
    gradients are still all-reduced."""
    def make():
        model = torch.nn.ModuleDict({"enc": torch.nn.Linear(8, 16), "head": torch.nn.Linear(16, 3)})
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    def step_of(model, opt, _):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model.head(model.enc(x).relu()), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    train(make, data, step_of)


def case_two_steps_share_a_model():
    """A training step and an evaluation step over one model: the second shares the first's
    replication."""
    (model, opt, _), (twin, twin_opt, _) = twins(mlp_bn)
    ours = autopar.data_parallel(module_step(model, opt))

    def evaluate_of(m):
        def evaluate(x, y):
            m.eval()
            with torch.no_grad():
                loss = F.cross_entropy(m(x), y)
            m.train()
            return loss
        return evaluate
    check = autopar.data_parallel(evaluate_of(model))
    eager, eager_check = module_step(twin, twin_opt), evaluate_of(twin)
    for k in range(3):
        torch.testing.assert_close(ours(*data(k)), eager(*data(k)), **TOL)
        torch.testing.assert_close(check(*data(k + 10)), eager_check(*data(k + 10)), **TOL)
        same(state_of(model, opt), state_of(twin, twin_opt), f"step {k}")


def case_a_parameter_used_in_some_steps_only():
    """A branch taken every other step: its parameters have no gradient in the others."""
    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    def make():
        model = Branch()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), None

    def batches(k):
        return (*data(k), k % 2 == 1)

    def step_of(model, opt, _):
        def step(x, y, use_b):
            opt.zero_grad()
            loss = F.cross_entropy(model(x, use_b), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    train(make, batches, step_of)


def case_compiled_regions_keep_the_measured_way():
    """Inductor among the candidates: the children run compiled under DDP's bucketing, the loss
    (masked tokens, computed in the module's own eager forward) keeps its weight, every rank
    keeps the same way after the trial, and each step equals the eager whole batch's."""
    from autopar.distributed.compiled import TIMED_CALLS, WARM_CALLS

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False),
                                            torch.nn.BatchNorm1d(16), torch.nn.ReLU())
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x, y):
            return F.cross_entropy(self.head(self.body(x)), y, ignore_index=-1)

    def make():
        model = Tagger()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), None

    def batches(k):
        x, y = data(k, rows=9)
        y[: 2 + k % 4] = -1  # rank 0's share loses more tokens than rank 1's
        return x, y

    def step_of(model, opt, _):
        def step(x, y):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    (model, opt, _), (twin, twin_opt, _) = twins(make)
    ours = autopar.data_parallel(step_of(model, opt, None), candidates="eager,inductor")
    eager = step_of(twin, twin_opt, None)
    compiled_calls = 0
    for k in range(2 * (WARM_CALLS + TIMED_CALLS) + 2):
        args = batches(k)
        got, want = ours(*args), eager(*args)
        compiled_calls += model.body._compiled_call_impl is not None
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"loss at step {k}: {m}")
        same(state_of(model, opt), state_of(twin, twin_opt), f"step {k}")
    assert not ours.ways.failed, ours.ways.failed
    # the region is read after each call: the inductor calls but the trial's last one
    assert compiled_calls >= WARM_CALLS + TIMED_CALLS - 1, compiled_calls
    assert len(ours.ways.times["inductor"]) == TIMED_CALLS, ours.ways.times
    kept = [None] * dist.get_world_size()
    dist.all_gather_object(kept, ours.ways.kept)
    assert kept[0] in ("eager", "inductor") and len(set(kept)) == 1, kept


def case_sharded_by_fsdp2_equals_one_process():
    """sharding="shard": the blocks (a ModuleList) and the model under FSDP2, the optimizer
    repointed to the shards; 7 rows (4 + 3), a masked-token mean, the global norm clipped.
    Losses, the gathered parameters, gradients and AdamW state equal the eager whole batch's."""
    from torch.distributed.tensor import DTensor

    from autopar.distributed import full_state_dict

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
                torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3))
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    def make():
        model = Stack()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), None

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def state(model, opt):
        out = {f"param {n}": full(p.detach()) for n, p in model.named_parameters()}
        out |= {f"grad {n}": full(p.grad) for n, p in model.named_parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        for p, s in opt.state.items():
            out |= {f"opt {names[id(p)]} {k}": full(v) for k, v in s.items() if v.dim()}
        return out

    def step_of(model, opt, _):
        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y, ignore_index=-1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss.detach()
        return step

    (model, opt, _), (twin, twin_opt, _) = twins(make)
    ours = autopar.data_parallel(step_of(model, opt, None), sharding="shard")
    eager = step_of(twin, twin_opt, None)
    for k in range(4):
        x, y = data(k)
        y[:1 + k % 3] = -1
        got, want = ours(x, y), eager(x, y)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"loss at step {k}: {m}")
        same(state(model, opt), state(twin, twin_opt), f"step {k}")
    assert isinstance(next(model.parameters()), DTensor)
    assert "sharded by FSDP2 (3 blocks" in ours.describe(), ours.describe()
    same(full_state_dict(model), twin.state_dict(), "full_state_dict")


def case_a_grad_scaler_refuses_sharding():
    """A GradScaler's inf check would see each rank's shards only: sharding it raises, on
    every rank, naming the model and the scaler."""
    model, opt, _ = mlp_bn()
    scaler = torch.amp.GradScaler("cpu")

    def step(x, y):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    try:
        autopar.data_parallel(step, sharding="shard")(*data(0))
    except ValueError as e:
        assert "'model' is to be sharded" in str(e) and "'scaler'" in str(e), e
    else:
        raise AssertionError("sharding beside a GradScaler did not raise")


CASES = {name[5:]: f for name, f in dict(globals()).items() if name.startswith("case_")}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        try:
            CASES[name]()
            print(f"PASS {name}", flush=True)
        except Exception:
            print(f"FAIL {name}: {traceback.format_exc()}", flush=True)
