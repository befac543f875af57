"""scripts/step_kinds.py, run small in a real process on the CPU: every step of a pass is kept
by kind with its wall time and its wait for the device, and `--profile-rounds` writes each kind's
cProfile (a round's, the step after one, other plain steps) after the timed passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_kinds_rows_and_the_rounds_profile(tmp_path: Path) -> None:
    out, prof = tmp_path / "kinds.json", tmp_path / "rounds.txt"
    cmd = [sys.executable, str(ROOT / "scripts" / "step_kinds.py"), "--n", "1", "--tokens", "12",
           "--repeat", "1", "--configs", "none,DDTREE(dflash) adaptive<=64",
           "--profile-rounds", str(prof), "--json", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "DDTREE(dflash) adaptive<=64"}
    for r in rows.values():
        kinds = [k for k, _, _ in r["steps"]]
        assert kinds[0] == "prefill" and len(kinds) >= 2
        assert all(us > 0 and waited >= 0 for _, us, waited in r["steps"])
    adaptive = rows["DDTREE(dflash) adaptive<=64"]
    assert "controller" in adaptive and "controller" not in rows["none"]
    # the adaptive engine starts at the top bucket: its first decode step is a round
    assert adaptive["steps"][1][0].startswith("round")
    text = prof.read_text()  # (the profiled pass, after the timed one, may hold no round)
    assert "===== none: plain steps" in text
    assert "===== DDTREE(dflash) adaptive<=64: plain steps" in text
    assert "cumulative us" in text  # the header: each kind's functions, by cumulative time


def _kept(profiles, kinds: tuple[str, ...]):
    """`profiles` after keeping one small cProfile per step of these kinds, in order."""
    import cProfile

    trace = []
    for kind in kinds:
        prof = cProfile.Profile()
        prof.enable()
        sum(range(100))
        prof.disable()
        profiles.keep(kind, trace, prof)
        trace.append((kind, 1.0, 0.0))
    return profiles


def test_step_profiles_keep_each_step_by_kind(tmp_path: Path, monkeypatch) -> None:
    """A round's profile, the next step's ("after round") and other plain steps' go apart;
    prefills are left out."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from step_kinds import StepProfiles

    profiles = _kept(StepProfiles(), ("prefill", "round b=64", "plain read-first",
                                      "plain steady", "round b=4", "plain read-first"))  # fmt: skip
    assert dict(profiles.steps) == {"round": 2, "after round": 2, "plain": 1}
    path = tmp_path / "p.txt"
    profiles.write(path, "x")
    text = path.read_text()
    for key, n in (("round", 2), ("after round", 2), ("plain", 1)):
        assert f"===== x: {key} steps ({n} of them)" in text


def test_step_profiles_keep_named_steps_alone(monkeypatch) -> None:
    """`alone` step indexes get a profile each (the prefill too), the others stay by kind."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from step_kinds import StepProfiles

    profiles = _kept(
        StepProfiles(frozenset({0, 3})),
        ("prefill", "plain steady", "plain steady", "plain steady", "round b=4"),
    )
    assert dict(profiles.steps) == {"step 0 (prefill)": 1, "plain": 2,
                                    "step 3 (plain steady)": 1, "round": 1}  # fmt: skip
