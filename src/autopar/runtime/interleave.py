"""One thread for the host's program and every GPU's: their steps interleaved once, at build time.

Policy
- GPU work is asynchronous: the thread that launches a GPU's ops can also launch another GPU's
  and run the host's ops, as eager PyTorch (and a hand-written data-parallel step) does. A
  value crossing between them then costs its copy and a CUDA event, with no thread hand-off.
  (Between threads, each crossing cost the executor 100-160 µs on the 2xH200 host, against
  ~20 µs for the copy and event alone: ``benchmarks/NOTES.md``; on a worker thread of its
  own, W6's cuda:1 started its first GEMM ~0.2 ms after the copy it waited for had landed.)
- Lanes: the host's program (the first CPU worker's; there may be none) and every GPU's. Other
  CPU workers keep their own threads: their ops compute, they don't just launch.
- Order: a merge of the lanes' step lists that keeps each list's order, in which every Wait comes
  after the Send or Record that issues its event, whichever program issues it. Programs that
  keep their threads are advanced in step as far as their own Waits allow, so a Wait on their
  events is placed only where their thread is sure to have issued it: the merge never creates a
  cycle that the separate threads would not have had.
- A GPU step goes before the host's whenever its Waits are satisfied: launches return at once,
  so the thread issues all the GPU work it can before it computes on the host or blocks on a
  copy to the host. Among the GPUs, the step the plan starts first goes first (a stream wait,
  Record or Free at once), so each GPU gets its work in the order the plan runs it. Host steps
  fill in where the GPUs' next steps wait for them. Exception, given the plan's predicted
  times (``times``): a host step that never blocks and is short (a Send,
  Record or Free, or an op predicted to take at most ``SHORT_S``) goes first when it is
  predicted to start no later than the GPU's next step: another program may be waiting for it
  (a value the host computes for another GPU at the start of a step), and the GPU loses
  little. Likewise a host Wait for a copy goes first when the copy is predicted to land no
  later than the GPU's next step starts: the thread blocks only for a copy the plan has done
  by then, and the host steps behind it (often short, often feeding another GPU) are not held
  back behind every launch the GPU has left.
- No order exists only for a plan whose programs deadlock anyway; :func:`interleave` then
  returns None and the programs stay on their own threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..schedule.steps import Free, Record, Run, Send, Wait

SHORT_S = 50e-6
"""A host op predicted to take at most this long may go before the GPU's next launch."""

Times = Callable[[Any], "tuple[float, float] | None"]


def interleave(programs: Mapping[str, Sequence[Any]], host: str | None,
               gpus: str | Sequence[str], times: Times | None = None
               ) -> list[tuple[str, Any]] | None:
    """The steps of ``host`` (None: no host program) and of ``gpus`` as one list of
    ``(device, step)``, or None if no order keeps every Wait after its event (see the module
    docstring). ``times(step)``: the plan's predicted ``(start, end)`` of a Run or Send, of
    the copy a Wait waits for, None where it has none."""
    gpus = [gpus] if isinstance(gpus, str) else list(gpus)
    lanes = gpus + ([host] if host is not None else [])
    issued: set[int] = set()
    pos = dict.fromkeys(programs, 0)
    others = [d for d in programs if d not in lanes]

    def ready(step: Any) -> bool:
        return not isinstance(step, Wait) or step.event in issued

    def issue(step: Any) -> None:
        if isinstance(step, Send | Record):
            issued.add(step.event)

    def advance(device: str) -> bool:
        steps, moved = programs[device], False
        while pos[device] < len(steps) and ready(steps[pos[device]]):
            issue(steps[pos[device]])
            pos[device] += 1
            moved = True
        return moved

    def start(step: Any) -> float:  # a GPU step's planned start; -inf: only enqueues, goes now
        t = times(step) if times is not None and isinstance(step, Run | Send) else None
        return -math.inf if t is None else t[0]

    def host_first(h: Any, g: Any) -> bool:
        if times is None:
            return False
        th = times(h)
        tg = None if isinstance(g, Wait) else times(g)  # times of a Wait are the host's
        if tg is None:
            return False
        if isinstance(h, Wait):  # th: the planned copy the host waits for
            return th is not None and th[1] <= tg[0]
        if isinstance(h, Run):
            return th is not None and th[0] <= tg[0] and th[1] - th[0] <= SHORT_S
        return isinstance(h, Send | Record | Free) and (th is None or th[0] <= tg[0])

    merged: list[tuple[str, Any]] = []
    while True:
        moved = any([advance(d) for d in others])
        nxt = {d: programs[d][pos[d]] for d in lanes
               if pos[d] < len(programs[d]) and ready(programs[d][pos[d]])}
        if nxt:
            ready_gpus = [d for d in gpus if d in nxt]
            device = min(ready_gpus, key=lambda d: (start(nxt[d]), gpus.index(d))) \
                if ready_gpus else host
            if device != host and host in nxt and host_first(nxt[host], nxt[device]):
                device = host
            assert device is not None
            issue(nxt[device])
            pos[device] += 1
            merged.append((device, nxt[device]))
            moved = True
        if all(pos[d] == len(programs[d]) for d in lanes):
            return merged
        if not moved:
            return None
