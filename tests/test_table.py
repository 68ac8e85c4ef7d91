"""The table's row moves give plain indexing's bytes, NaN payloads and signed zeros included."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kuscale.model import Resource
from kuscale.monitor.table import PodTable, put_rows, take_rows

SPECIAL = st.sampled_from([-0.0, 0.0, 1.0, np.nan, -np.nan, np.inf, -np.inf, 5e-324])
VALUES = st.one_of(SPECIAL, st.floats(allow_nan=True, allow_infinity=True))
ROWS = st.integers(1, 40).flatmap(
    lambda size: st.tuples(
        st.just(size), st.lists(st.integers(0, size - 1), unique=True, max_size=size)
    )
)


@given(ROWS, st.data())
def test_rows_move_as_plain_indexing_moves_them(
    table_rows: tuple[int, list[int]], data: st.DataObject
) -> None:
    size, picked = table_rows
    rows = np.array(picked, dtype=np.int64)
    for dtype, elements in ((np.float64, VALUES), (np.bool_, st.booleans())):
        column = data.draw(arrays(dtype, (size, 2), elements=elements))
        values = data.draw(arrays(dtype, (rows.size, 2), elements=elements))
        assert take_rows(column, rows).tobytes() == column[rows].tobytes()
        expected = column.copy()
        expected[rows] = values
        put_rows(column, rows, values)
        assert column.tobytes() == expected.tobytes()


def test_the_usage_ring_keeps_the_last_window_of_each_row() -> None:
    table = PodTable(window=3, rows=4)
    rows = np.array([2, 0], dtype=np.int64)
    for tick in range(5):
        table.record_history(rows, np.array([[tick, -0.0], [10.0 + tick, np.nan]]))
    assert table.history(2, Resource.CPU) == [2.0, 3.0, 4.0]
    assert table.history(0, Resource.CPU) == [12.0, 13.0, 14.0]
    assert str(table.history(2, Resource.GPU)) == "[-0.0, -0.0, -0.0]"
    assert table.history(1, Resource.CPU) == []
