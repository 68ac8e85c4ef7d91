"""`make fuzz`: FUZZ_INPUTS inputs (default 1,000,000) over every target, coverage-guided by
atheris, then the line `fuzz: N inputs, C crashes, W invalid writes`; exit 1 when either
count is not 0.

Each target runs in a process of its own (libFuzzer owns the process it fuzzes), as many at
once as the machine has cores, with its share of the inputs. Every input that reached new
code is kept in corpus/TARGET, which `make test` replays; what a finding was made of is left
in findings/ beside this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from targets import RESULT, Counts, Tally, targets

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
FINDINGS = HERE / "findings"
TAIL_LINES = 30


def shares() -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as workdir:
        return {name: share for name, (_, _, share) in targets(Path(workdir), Tally()).items()}


def fuzz_target(name: str, runs: int) -> Counts:
    """One target's worker; its progress lines are passed on as they come."""
    command = [
        sys.executable,
        str(HERE / "guided.py"),
        name,
        str(runs),
        str(CORPUS / name),
        str(FINDINGS / name),
    ]
    worker = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE
    )
    assert worker.stdout is not None
    result: Counts | None = None
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    for line in worker.stdout:
        if line.startswith(RESULT):
            result = json.loads(line.removeprefix(RESULT))
        elif line.startswith("fuzz: "):
            print(line, end="", flush=True)
        tail.append(line)
    worker.wait()
    if result is None or (worker.returncode != 0 and not found(result)):
        last = "".join(tail)
        return {
            "target": name,
            "inputs": 0,
            "crashes": 1,
            "invalid_writes": 0,
            "examples": [f"{name}: the worker exited {worker.returncode}:\n{last}"],
        }
    return result


def found(result: Counts) -> int:
    return result["crashes"] + result["invalid_writes"]


def main() -> int:
    total = int(os.environ.get("FUZZ_INPUTS", "1000000"))
    started = time.monotonic()
    plan = {name: max(1, round(total * share)) for name, share in shares().items()}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda item: fuzz_target(*item), plan.items()))
    for result in results:
        print(
            f"  {result['target']}: {result['inputs']} inputs, {result['crashes']} crashes, "
            f"{result['invalid_writes']} invalid writes"
        )
        for example in result["examples"]:
            print(f"    {example}")
    inputs = sum(r["inputs"] for r in results)
    crashes = sum(r["crashes"] for r in results)
    invalid = sum(r["invalid_writes"] for r in results)
    print(f"({time.monotonic() - started:.0f} s)")
    print(f"fuzz: {inputs} inputs, {crashes} crashes, {invalid} invalid writes")
    return 1 if crashes or invalid else 0


if __name__ == "__main__":
    sys.exit(main())
