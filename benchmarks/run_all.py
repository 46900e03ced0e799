"""Run every benchmark family and write one result per machine and day.

    python benchmarks/run_all.py                  # -> benchmarks/results/<machine>-<date>.json, .md
    python benchmarks/run_all.py --readme benchmarks/README.md   # also refresh its table

Families are the scripts beside this one listed in ``FAMILIES`` (``workloads.py``,
``cost_model.py``, ``planning_time.py``, ``overhead.py``, ``scale.py``, ``data_parallel.py``, and
``parallel.py`` and ``launch.py`` on GPU hosts), each when present. ``--size`` is passed to
``workloads.py``, and to ``scale.py`` unless it is ``auto`` (scale's own default: full-size
predictions, measured where there are GPUs).
Each runs in its own process with ``--json``: it prints one JSON document on stdout, or writes
it to the path given after ``--json`` (``json_to_file``). A family that fails
is recorded with its error and the others go on. The markdown holds the workloads table, and
each other family's ``markdown`` field when its JSON has one. ``--readme`` replaces the text
between ``<!-- results:<key>:start -->`` and ``<!-- results:<key>:end -->`` (key ``cpu`` on a
host without GPUs, else the machine label such as ``2xH200``) with the workloads table and the
command that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import autopar  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from autopar.bench.harness import Report, fingerprint, machine_label

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCHEMA = "autopar-bench-all/1"


@dataclass(frozen=True)
class Family:
    script: str
    args: tuple[str, ...] = ()  # besides --json
    json_to_file: bool = False  # the script takes ``--json PATH`` (else prints JSON on stdout)
    needs_gpu: bool = False


FAMILIES: dict[str, Family] = {
    "workloads": Family("workloads.py"),
    "cost_model": Family("cost_model.py", ("--quick",)),
    "planning_time": Family("planning_time.py"),
    "overhead": Family("overhead.py", json_to_file=True),
    "parallel": Family("parallel.py", json_to_file=True, needs_gpu=True),
    # without GPUs it still predicts every GPU count on the presets
    "scale": Family("scale.py", json_to_file=True),
    "data_parallel": Family("data_parallel.py", json_to_file=True),  # predicted without GPUs
    "launch": Family("launch.py", json_to_file=True, needs_gpu=True),
}


def _parse_json(stdout: str) -> Any:
    """The JSON document a family printed (tolerating lines printed before it)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        start = stdout.find("\n{")
        if start < 0:
            raise
        return json.loads(stdout[start + 1:])


def run_family(name: str, family: Family, extra: list[str], timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / f"{name}.json"
        json_args = ["--json", str(target)] if family.json_to_file else ["--json"]
        cmd = [sys.executable, str(HERE / family.script), *json_args, *family.args, *extra]
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            return {"error": f"exit status {done.returncode} (see its stderr above)",
                    "seconds": elapsed}
        try:
            text = target.read_text() if family.json_to_file else done.stdout
            return {"result": _parse_json(text), "seconds": elapsed}
        except (OSError, json.JSONDecodeError) as e:
            return {"error": f"left no JSON document: {e}", "seconds": elapsed}


def to_markdown(doc: dict[str, Any]) -> str:
    parts = [f"# Benchmarks on {doc['label']}\n"]
    for name, fam in doc["families"].items():
        parts.append(f"\n## {name}\n")
        if "error" in fam:
            parts.append(f"\nnot measured: {fam['error']}\n")
        elif name == "workloads":
            parts.append("\n" + Report.from_json(fam["result"]).to_markdown())
        elif isinstance(fam["result"], dict) and "markdown" in fam["result"]:
            parts.append("\n" + fam["result"]["markdown"] + "\n")
        else:
            parts.append(f"\nsee `{doc['label']}-{doc['date']}.json` (families.{name}).\n")
    return "".join(parts)


def readme_key(machine: dict[str, Any]) -> str:
    return machine_label(machine) if machine.get("gpus") else "cpu"


def update_readme(path: Path, key: str, text: str) -> bool:
    """Replace the block between this key's markers; False when the markers are absent."""
    start, end = f"<!-- results:{key}:start -->", f"<!-- results:{key}:end -->"
    old = path.read_text()
    i, j = old.find(start), old.find(end)
    if i < 0 or j < i:
        return False
    path.write_text(old[: i + len(start)] + "\n" + text.strip() + "\n" + old[j:])
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="auto", choices=("auto", "full", "small"),
                   help="workload sizes (auto: full with a GPU, small without)")
    p.add_argument("--only", default="", help="comma-separated families (default: all)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--readme", type=Path, help="refresh the results block of this README")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per family")
    args = p.parse_args(argv)

    if args.readme is not None and not args.readme.is_file():
        p.error(f"--readme {args.readme}: no such file")
    only = {f for f in args.only.split(",") if f}
    unknown = only - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose among {sorted(FAMILIES)}")
    machine = fingerprint(["python", "benchmarks/run_all.py", *(argv or sys.argv[1:])])
    doc: dict[str, Any] = {"schema": SCHEMA, "label": machine_label(machine),
                           "date": machine["date"][:10], "machine": machine, "families": {}}
    for name, family in FAMILIES.items():
        if (only and name not in only) or not (HERE / family.script).exists():
            continue
        if family.needs_gpu and not machine.get("gpus"):
            continue
        sized = name == "workloads" or (name == "scale" and args.size != "auto")
        extra = ["--size", args.size] if sized else []
        doc["families"][name] = run_family(name, family, extra, args.timeout)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{doc['label']}-{doc['date']}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    markdown = to_markdown(doc)
    (args.out / f"{stem}.md").write_text(markdown)
    print(f"wrote {args.out / stem}.json and .md", file=sys.stderr)
    workloads = doc["families"].get("workloads", {})
    if args.readme and "result" in workloads:
        report = Report.from_json(workloads["result"])
        report.machine["command"] = machine["command"]  # the one command that remakes it
        table = report.to_markdown()
        key = readme_key(machine)
        if not update_readme(args.readme, key, table):
            print(f"{args.readme} has no <!-- results:{key}:start/end --> markers: not updated",
                  file=sys.stderr)
    print(markdown)
    return 0 if all("result" in f for f in doc["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
