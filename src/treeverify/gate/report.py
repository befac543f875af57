"""The live timeline (one line per event: elapsed, phase, state, detail), the verdict table, and
the JSON / JUnit XML reports."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import xml.etree.ElementTree as ET

from treeverify.gate.codes import ExitCode, worst


@dataclasses.dataclass
class ProbeResult:
    name: str
    verdict: str  # pass | fail | skip
    detail: str = ""
    code: ExitCode = ExitCode.PASS  # what a failure means (ignored unless verdict == "fail")
    seconds: float = 0.0
    data: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["code"] = int(self.code) if self.verdict == "fail" else 0
        d["seconds"] = round(self.seconds, 3)
        return d


class Report:
    def __init__(self, stream=None, quiet: bool = False) -> None:
        self.t0 = time.monotonic()
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.events: list[dict] = []
        self.results: list[ProbeResult] = []
        self.meta: dict = {}
        self.frozen = False  # set when the run is abandoned at its deadline: late news is dropped
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def freeze(self) -> None:
        with self._lock:
            self.frozen = True

    def event(self, phase: str, state: str, detail: str = "") -> None:
        with self._lock:
            if not self.frozen:
                self._event(phase, state, detail)

    def _event(self, phase: str, state: str, detail: str) -> None:
        t = self.elapsed()
        self.events.append({"t": round(t, 3), "phase": phase, "state": state, "detail": detail})
        if not self.quiet:
            line = f"[{t:7.1f}s] {phase:<12} {state:<10} {detail}".rstrip()
            print(line, file=self.stream, flush=True)

    def add(self, result: ProbeResult) -> ProbeResult:
        with self._lock:
            if self.frozen:
                return result
            self.results.append(result)
            state = result.verdict.upper()
            if result.verdict == "fail":
                state += f"({int(result.code)})"
            self._event(result.name, state, result.detail)
        return result

    def exit_code(self) -> ExitCode:
        return worst(r.code for r in self.results if r.verdict == "fail")

    def table(self) -> str:
        w = max([len(r.name) for r in self.results] + [5])
        rows = [f"{'probe':<{w}}  verdict  exit  time    detail"]
        for r in self.results:
            code = str(int(r.code)) if r.verdict == "fail" else "-"
            rows.append(
                f"{r.name:<{w}}  {r.verdict:<7}  {code:<4}  {r.seconds:6.1f}s  {r.detail[:200]}"
            )
        code = self.exit_code()
        rows.append(f"GATE {'PASS' if code == 0 else 'FAIL'}: exit {int(code)} ({code.name})")
        return "\n".join(rows)

    def to_json(self) -> dict:
        code = self.exit_code()
        return {
            "verdict": "pass" if code == 0 else "fail",
            "exit_code": int(code),
            "exit_name": code.name,
            "elapsed_s": round(self.elapsed(), 3),
            **self.meta,
            "probes": [r.to_json() for r in self.results],
            "timeline": self.events,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    def write_junit(self, path: str) -> None:
        fails = sum(r.verdict == "fail" for r in self.results)
        skips = sum(r.verdict == "skip" for r in self.results)
        suite = ET.Element(
            "testsuite",
            name="treeverify.gate",
            tests=str(len(self.results)),
            failures=str(fails),
            errors="0",
            skipped=str(skips),
            time=f"{self.elapsed():.3f}",
        )
        for r in self.results:
            case = ET.SubElement(
                suite, "testcase", classname="gate", name=r.name, time=f"{r.seconds:.3f}"
            )
            if r.verdict == "fail":
                el = ET.SubElement(case, "failure", message=r.detail[:500], type=r.code.name)
                el.text = json.dumps(r.data, default=str)[:20000] if r.data else r.detail
            elif r.verdict == "skip":
                ET.SubElement(case, "skipped", message=r.detail[:500])
            else:
                ET.SubElement(case, "system-out").text = r.detail
        root = ET.Element("testsuites")
        root.append(suite)
        ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
