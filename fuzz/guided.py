"""One fuzz target under atheris: coverage-guided, its corpus kept in fuzz/corpus/TARGET.

`python guided.py TARGET RUNS CORPUS ARTIFACTS` lets libFuzzer mutate the bytes from which
hypothesis draws the target's input (`fuzz_one_input`), keeping in CORPUS every input that
reached new code of kuscale's, which alone is instrumented. It prints a progress line at
least every PROGRESS_SECONDS and, after RUNS inputs or at the first crash or invalid write,
one RESULT line of JSON for run.py; a finding also stops libFuzzer, which saves its input
in ARTIFACTS.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kuscale"]):
    from targets import MAX_LEN, RESULT, Counts, Tally, counted, playable, targets

PROGRESS_SECONDS = 20.0


class Finding(Exception):
    """A crash or an invalid write: libFuzzer stops and saves the input that made it."""


class Progress:
    def __init__(self, name: str, runs: int, tally: Tally) -> None:
        self.name = name
        self.runs = runs
        self.tally = tally
        self.done = 0
        self.started = self.printed = time.monotonic()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.printed >= PROGRESS_SECONDS:
            self.printed = now
            print(
                f"fuzz: {self.name}: {self.done} of {self.runs} inputs, {now - self.started:.0f} s",
                flush=True,
            )
        if self.done >= self.runs:
            self.result()

    def result(self) -> None:
        counts: Counts = {
            "target": self.name,
            "inputs": self.done,
            "crashes": self.tally.crashes,
            "invalid_writes": self.tally.invalid_writes,
            "examples": self.tally.examples,
        }
        print(RESULT + json.dumps(counts), flush=True)


def main(argv: list[str]) -> None:
    name, runs, corpus, artifacts = argv[1], int(argv[2]), Path(argv[3]), Path(argv[4])
    logging.disable(logging.CRITICAL)
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    tally = Tally()
    workdir = Path(tempfile.mkdtemp(prefix="kuscale-fuzz-", dir="/dev/shm"))
    try:
        strategy, target, _ = targets(workdir, tally)[name]
        one = counted(name, strategy, target, 1, tally).hypothesis.fuzz_one_input
        progress = Progress(name, runs, tally)

        def test_one_input(data: bytes) -> None:
            found = tally.crashes + tally.invalid_writes
            one(playable(data))
            progress.step()
            if tally.crashes + tally.invalid_writes != found:
                progress.result()
                raise Finding(tally.examples[-1])

        atheris.Setup(
            [
                argv[0],
                str(corpus),
                f"-runs={runs}",
                f"-max_len={MAX_LEN}",
                f"-artifact_prefix={artifacts}/",
                "-print_final_stats=0",
            ],
            test_one_input,
        )
        atheris.Fuzz()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
