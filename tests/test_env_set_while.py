"""treeverify.env.set_while: switches set for a block (an A/B builds its variant inside) and
restored after it, a variable that was unset unset again, also when the block raises."""

from __future__ import annotations

import os

import pytest

from treeverify import env


def test_switches_are_set_inside_and_restored_after(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_CONTEXT_LAZY", "1")
    monkeypatch.delenv("TREEVERIFY_MAPPED_READBACK", raising=False)
    with env.set_while({"TREEVERIFY_CONTEXT_LAZY": "0", "TREEVERIFY_MAPPED_READBACK": "1"}):
        assert not env.context_lazy() and env.mapped_readback()
    assert env.context_lazy() and "TREEVERIFY_MAPPED_READBACK" not in os.environ
    with pytest.raises(RuntimeError), env.set_while({"TREEVERIFY_CONTEXT_LAZY": "0"}):
        raise RuntimeError("a build that failed")
    assert os.environ["TREEVERIFY_CONTEXT_LAZY"] == "1"
