"""engine/mapped_readback.py's kernel on the CPU interpreter (TRITON_INTERPRET=1): each launch
writes the values into the row of the device flip and turns the flip over, and the host's
mirror (`MappedRows.launched`) names the row each launch wrote, through a capture's warm-up
write and `reset`. tests/test_decode_ahead_gpu.py runs it compiled, inside the step graphs, with
the rows in pinned host memory."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_decode_ahead_gpu.py")

from treeverify.engine import mapped_readback  # noqa: E402

interpreted_kernels = cache_cleared(mapped_readback._kernel)


@pytest.mark.parametrize("n", [1, 5, 16, 40])
def test_each_launch_writes_the_row_its_parity_names(n):
    rows = mapped_readback.MappedRows(n, torch.device("cpu"))
    rows.rows.fill_(-7)  # poisoned: a row never written keeps it
    g = torch.Generator().manual_seed(n)
    rows.write(torch.randint(0, 1000, (n,), generator=g))  # a capture's warm-up
    rows.reset()
    assert int(rows.flip) == 0 and rows.parity == 0
    for _ in range(5):
        values = torch.randint(0, 50_000, (n,), generator=g)
        rows.write(values)  # (a replay of the graph whose last node this is)
        other = rows.rows[1 - rows.parity].clone()
        got = rows.launched()
        assert torch.equal(got, values)
        assert torch.equal(rows.rows[rows.parity], other)  # the other row untouched
        assert int(rows.flip) == rows.parity  # device flip and host mirror agree


def test_shapes_are_checked_by_name():
    rows = mapped_readback.MappedRows(4, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected \\(2, 3\\)"):
        mapped_readback.put_rows(torch.zeros(3, dtype=torch.int64), rows.rows, rows.flip)
