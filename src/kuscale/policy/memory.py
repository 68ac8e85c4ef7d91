"""Per-pod memory for rules that keep more than one number per pod across ticks.

The monitor hands rules only the pods with a valid sample this tick, in any order; the rows
here follow pods by key, and rows of pods that have not been seen for a while are reused.
"""

from __future__ import annotations

import numpy as np

from kuscale.policy.base import FloatArray

IntArray = np.ndarray


class PodRows:
    """One row of `shape` per pod, created zeroed on first sight."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.data: FloatArray = np.zeros((0, *shape))
        self._rows: dict[str, int] = {}
        self._free: list[int] = []

    def rows(self, keys: tuple[str, ...]) -> IntArray:
        """The rows of these pods, creating what is missing."""
        missing = [key for key in keys if key not in self._rows]
        if missing:
            self._allocate(missing)
        return np.fromiter((self._rows[key] for key in keys), dtype=np.intp, count=len(keys))

    def keep_only(self, keys: tuple[str, ...]) -> None:
        """Forget pods not in `keys`; their rows are zeroed and reused."""
        alive = set(keys)
        for key in [k for k in self._rows if k not in alive]:
            row = self._rows.pop(key)
            self.data[row] = 0.0
            self._free.append(row)

    def _allocate(self, keys: list[str]) -> None:
        fresh = max(0, len(keys) - len(self._free))
        if fresh:
            start = self.data.shape[0]
            self.data = np.concatenate([self.data, np.zeros((fresh, *self.shape))])
            self._free.extend(range(start, start + fresh))
        for key in keys:
            self._rows[key] = self._free.pop()
