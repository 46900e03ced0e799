"""Data parallelism on torch.distributed, run for real: torchrun and gloo on this machine.

- The loss's reduction is read from its autograd graph (a table of small losses, in process).
- Scenarios under ``torchrun --nproc-per-node 2`` (``_dist_cases.py``): every step's loss,
  parameters, gradients, buffers and optimizer state equal a twin trained on the whole batch.
- The three Hugging Face scripts of ``examples/distributed`` give one process's losses,
  weights and optimizer state on two ranks and on two nodes (two torchrun agents, a c10d
  rendezvous on 127.0.0.1).
- A rank that raises or is killed ends the run, with its error, in under 60 s; Ctrl-C leaves
  no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.distributed.launch import host_processes, torchrun_args
from autopar.distributed.loss import reduction_of

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SCRIPTS = ROOT / "examples" / "distributed"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


# -- the loss's reduction, in process ------------------------------------------------------------
def _x():
    torch.manual_seed(0)
    return torch.randn(4, 3, requires_grad=True)


LOSSES = {  # name: (loss, expected (kind, count) or None)
    "mean": (lambda x: x.mean(), ("mean", 12.0)),
    "sum": (lambda x: x.sum(), ("sum", 1.0)),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 0])), ("mean", 4.0)),
    "ignore_index": (lambda x: F.cross_entropy(x, torch.tensor([0, -100, 2, -100])),
                     ("mean", 2.0)),
    "class_weights": (lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 0]),
                                                weight=torch.tensor([1.0, 2.0, 0.5])),
                      ("mean", 4.5)),
    "mse": (lambda x: F.mse_loss(x, torch.zeros(4, 3)), ("mean", 12.0)),
    "mse_sum": (lambda x: F.mse_loss(x, torch.zeros(4, 3), reduction="sum"), ("sum", 1.0)),
    "bce_logits": (lambda x: F.binary_cross_entropy_with_logits(x, torch.ones(4, 3)),
                   ("mean", 12.0)),
    "scaled_mean": (lambda x: x.float().mean() * 1024.0 / 4, ("mean", 12.0)),
    "mean_by_tensor": (lambda x: x.mean() * torch.tensor(3.0), ("mean", 12.0)),
    "sum_over_rows_by_hand": (lambda x: x.sum() / x.shape[0], None),
    "two_losses": (lambda x: x.mean() + x.sum(), None),
    "unknown_op": (lambda x: x.mean().exp(), None),
}


@pytest.mark.parametrize("name", LOSSES)
def test_the_loss_reduction_is_read_from_its_graph(name):
    make, expected = LOSSES[name]
    found = reduction_of(make(_x()))
    if expected is None:
        assert found is None
    else:
        assert (found.kind, float(found.count)) == expected


# -- the launcher's defaults ---------------------------------------------------------------------
def test_autopar_run_adds_torchruns_defaults_only_where_unset():
    args, n = torchrun_args(["train.py", "--lr", "1"])
    assert args[-3:] == ["train.py", "--lr", "1"] and "--standalone" in args
    expected = torch.cuda.device_count() if torch.cuda.is_available() else host_processes()
    assert f"--nproc-per-node={expected}" in args and n == expected
    args, n = torchrun_args(["--nproc_per_node=3", "--nnodes", "2", "--rdzv-endpoint", "h:1",
                             "train.py", "--nnodes", "9"])
    assert args == ["--nproc_per_node=3", "--nnodes", "2", "--rdzv-endpoint", "h:1",
                    "train.py", "--nnodes", "9"] and n == 3


# -- under torchrun --------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # a collective that hangs raises after 2 minutes, not torch's 30; the host's path (gloo),
    # also on a machine with a GPU (two ranks can't share one under NCCL)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "AUTOPAR_DIST_TIMEOUT": "120", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"}


def _communicate(proc: subprocess.Popen, timeout: float) -> str:
    """``proc``'s output; past ``timeout`` its whole session (the agent and its ranks) is
    killed, so that no rank outlives the test."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        raise AssertionError(f"timed out after {timeout} s:\n{out[-4000:]}") from None


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{(out + err)[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _standalone(script: Path, *args: str) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), *args]


def _two_nodes(script: Path, *args: str, timeout: float = 300
               ) -> tuple[int, str, float]:
    """Two torchrun agents, one process each, on one c10d rendezvous over loopback: (exit
    code, both agents' output, seconds)."""
    port, start = _port(), time.monotonic()
    agents = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"test{port}", str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
        start_new_session=True)
        for node in (0, 1)]
    try:
        outs = [_communicate(a, timeout) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    code = max(abs(a.returncode) for a in agents)
    return code, "\n".join(outs), time.monotonic() - start


@pytest.fixture(scope="module")
def cases() -> str:
    done = _run(_standalone(TESTS / "_dist_cases.py"))
    return done.stdout + done.stderr


CASES = ["uneven_shards_batch_norm_clip", "masked_token_mean", "grad_scaler",
         "parameters_as_arguments_sum_loss", "unknown_reduction_weighs_rows",
         "per_rank_batches_average", "ranks_disagree_on_a_shape",
         "ranks_disagree_on_the_model", "children_called_directly", "two_steps_share_a_model",
         "a_parameter_used_in_some_steps_only", "compiled_regions_keep_the_measured_way",
         "sharded_by_fsdp2_equals_one_process", "a_grad_scaler_refuses_sharding"]


@pytest.mark.parametrize("case", CASES)
def test_a_step_under_torchrun_equals_one_process(cases, case):
    assert cases.count(f"PASS {case}") == 2, cases[-4000:]


def test_every_case_is_run():
    source = (TESTS / "_dist_cases.py").read_text()
    assert sorted(CASES) == sorted(line[9:line.index("(")] for line in source.splitlines()
                                   if line.startswith("def case_"))


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-4) -> None:
    """Equal within ``rtol`` of the tensor's norm (summation orders differ across ranks)."""
    if not want.is_floating_point():
        assert torch.equal(got, want), what
        return
    err = float((got.double() - want.double()).norm())
    assert err <= rtol * float(want.double().norm()) + 1e-12, \
        f"{what}: relative error {err / max(float(want.double().norm()), 1e-30):.2e}"


def _noise_only(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` without the elements whose gradient is zero in exact arithmetic: attention's key
    biases (softmax ignores a constant added to every key's score; GPT-2 keeps them in the
    middle third of ``c_attn.bias``). AdamW turns their float noise into steps of up to
    ``lr``, in any two summation orders (DDP's as well)."""
    if name.endswith("attention.self.key.bias") and x.dim():
        return x[:0]
    if name.endswith("attn.c_attn.bias") and x.dim():
        third = x.shape[-1] // 3
        return torch.cat([x[..., :third], x[..., 2 * third:]], -1)
    return x


def _same(one: Path, other: Path) -> None:
    a, b = torch.load(one), torch.load(other)
    _close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), "losses")
    names = a["parameters"]
    for name, x in a["model"].items():
        _close(_noise_only(name, b["model"][name]), _noise_only(name, x), name)
    for p, state in a["opt"]["state"].items():
        for key, x in state.items():
            _close(_noise_only(names[p], b["opt"]["state"][p][key]), _noise_only(names[p], x),
                   f"optimizer state {key} of {names[p]}")


SCRIPT_NAMES = ["gpt2_adamw", "bert_adamw", "resnet_sgd"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    out = {}
    for name in SCRIPT_NAMES:
        path = tmp_path_factory.mktemp("one") / f"{name}.pt"
        done = _run([sys.executable, str(SCRIPTS / f"{name}.py"), "--out", str(path)])
        assert done.returncode == 0, done.stderr[-4000:]
        out[name] = path
    return out


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_on_two_ranks_equals_one_process(one_process, name, tmp_path):
    path = tmp_path / "two.pt"
    done = _run(_standalone(SCRIPTS / f"{name}.py", "--out", str(path)))
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-4000:]
    _same(one_process[name], path)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_on_two_nodes_equals_one_process(one_process, name, tmp_path):
    path = tmp_path / "nodes.pt"
    code, out, _ = _two_nodes(SCRIPTS / f"{name}.py", "--out", str(path))
    assert code == 0, out[-4000:]
    _same(one_process[name], path)


# -- faults --------------------------------------------------------------------------------------
def test_a_rank_that_raises_ends_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    done = _run(_standalone(TESTS / "_dist_faults.py", "raise", str(tmp_path)), timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 60
    out = done.stdout + done.stderr
    assert "a bad batch, on purpose" in out and "raised on rank 1 of 2" in out
    summary = out[out.index("Root Cause"):]
    assert "rank      : 1" in summary and "a bad batch, on purpose" in summary, summary


def test_a_rank_that_raises_on_another_node_ends_the_run(tmp_path):
    code, out, seconds = _two_nodes(TESTS / "_dist_faults.py", "raise", str(tmp_path),
                                    timeout=120)
    assert code != 0 and seconds < 60 and "a bad batch, on purpose" in out


def test_a_killed_rank_ends_the_run(tmp_path):
    start = time.monotonic()
    done = _run(_standalone(TESTS / "_dist_faults.py", "kill", str(tmp_path)), timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "Signal 9" in done.stdout + done.stderr or "SIGKILL" in done.stdout + done.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_every_process(tmp_path):
    agent = subprocess.Popen(_standalone(TESTS / "_dist_faults.py", "wait", str(tmp_path)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=_env(), cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # both ranks in the loop
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    agent.send_signal(signal.SIGINT)
    agent.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids))


def test_autopar_run_launches_a_script(tmp_path):
    path = tmp_path / "run.pt"
    done = _run([sys.executable, "-m", "autopar.cli", "run", "--nproc-per-node", "2",
                 str(SCRIPTS / "resnet_sgd.py"), "--steps", "2", "--out", str(path)])
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(torch.load(path)["losses"]) == 2


def test_a_run_restarted_after_a_failure_resumes_from_its_checkpoint(tmp_path):
    script = SCRIPTS / "resume.py"
    whole = _run([sys.executable, str(script), "--checkpoint", str(tmp_path / "one.pt"),
                  "--out", str(tmp_path / "one-final.pt")])
    assert whole.returncode == 0, whole.stderr[-4000:]
    done = _run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 str(script), "--checkpoint", str(tmp_path / "two.pt"), "--fail-at", "5",
                 "--out", str(tmp_path / "two-final.pt")])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "fails at step 5, once, on purpose" in out and "from step 4" in out
    one, two = torch.load(tmp_path / "one-final.pt"), torch.load(tmp_path / "two-final.pt")
    for name, x in one["model"].items():
        _close(two["model"][name], x, name)
