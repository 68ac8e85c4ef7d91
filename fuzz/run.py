"""`make fuzz`: FUZZ_INPUTS generated inputs (default 1,000,000) over every target, then the
line `fuzz: N inputs, C crashes, W invalid writes`; exit 1 when either count is not 0."""

from __future__ import annotations

import logging
import os
import sys
import time

from targets import run


def main() -> int:
    total = int(os.environ.get("FUZZ_INPUTS", "1000000"))
    logging.disable(logging.CRITICAL)
    started = time.monotonic()
    tally = run(total)
    for example in tally.examples:
        print(example)
    print(f"({time.monotonic() - started:.0f} s)")
    print(
        f"fuzz: {tally.inputs} inputs, {tally.crashes} crashes, "
        f"{tally.invalid_writes} invalid writes"
    )
    return 1 if tally.crashes or tally.invalid_writes else 0


if __name__ == "__main__":
    sys.exit(main())
