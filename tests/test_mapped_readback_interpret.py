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


@pytest.mark.parametrize("shape", [(1,), (5,), (16,), (4, 34), (9, 300)],
                         ids=["b1", "b5", "b16", "round-4x34", "round-9x300"])  # fmt: skip
def test_each_launch_writes_the_row_its_parity_names(shape):
    """A plain step's (b,) tokens and a whole round's packed (b, 2 + 2K) rows (9 x 300: more
    than one 1024-wide piece of the kernel's loop)."""
    rows = mapped_readback.MappedRows(shape, torch.device("cpu"))
    rows.rows.fill_(-7)  # poisoned: a row never written keeps it
    g = torch.Generator().manual_seed(sum(shape))
    rows.write(torch.randint(0, 1000, shape, generator=g))  # a capture's warm-up
    rows.reset()
    assert int(rows.flip) == 0 and rows.parity == 0
    for _ in range(5):
        values = torch.randint(0, 50_000, shape, generator=g)
        rows.write(values)  # (a replay of the graph whose last node this is)
        other = rows.rows[1 - rows.parity].clone()
        got = rows.launched()
        assert torch.equal(got, values)
        assert torch.equal(rows.rows[rows.parity], other)  # the other row untouched
        assert int(rows.flip) == rows.parity  # device flip and host mirror agree


def test_shapes_are_checked_by_name():
    rows = mapped_readback.MappedRows((4,), torch.device("cpu"))
    with pytest.raises(ValueError, match="put_rows: values \\(3,\\), rows \\(2, 4\\)"):
        mapped_readback.put_rows(torch.zeros(3, dtype=torch.int64), rows.rows, rows.flip)
    with pytest.raises(ValueError, match="MappedRows.write: values \\(4, 2\\), expected \\(4,\\)"):
        rows.write(torch.zeros(4, 2, dtype=torch.int64))
    two = mapped_readback.MappedRows((3, 4), torch.device("cpu"))
    with pytest.raises(ValueError, match="contiguous"):
        two.write(torch.zeros(4, 3, dtype=torch.int64).t())
