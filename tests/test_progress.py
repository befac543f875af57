"""Progress bars appear on a terminal only; the items pass through unchanged either way."""

from __future__ import annotations

import io
import sys

import pytest

from treeverify.progress import progress


def test_plain_off_a_terminal(capsys):
    items = [3, 1, 4, 1, 5]
    assert list(progress(items, "loading weights")) == items
    assert capsys.readouterr().err == ""


def test_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert list(progress(range(7), "capturing CUDA graphs", unit="bucket")) == list(range(7))
    assert "capturing CUDA graphs" in term.getvalue() and "/7" in term.getvalue()
