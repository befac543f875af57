"""The SASS lines an ncu report's warps sit on most, with their two main stall reasons.

Reads the per-instruction table `ncu --page source --print-source sass --csv` writes (what
scripts/ncu-cases saves as ncu_<case>_sass.csv) and prints the top lines by warp-stall samples,
each as its share of all samples. This is how the GQA kernel's consumers were seen waiting on
their full barrier (docs/performance.md, seventeenth and eighteenth sessions): the try-wait
loop's branch, a named barrier's BSSY, `WARPGROUP.DEPBAR` for wgmma waits.

Usage: python3 scripts/ncu_top.py ncu_<case>_sass.csv [TOP]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def top_lines(path: Path, top: int = 20) -> list[tuple[str, float, str, list[str]]]:
    """(address, share of all samples, SASS, two main stall reasons) for the top lines."""
    rows = list(csv.reader(path.open()))
    # The first row names the kernel; the header follows.
    header_at = next(i for i, r in enumerate(rows) if SAMPLES in r)
    header, data = rows[header_at], rows[header_at + 1 :]
    i_addr, i_src, i_samples = (
        header.index("Address"),
        header.index("Source"),
        header.index(SAMPLES),
    )
    stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]

    def samples(r: list[str]) -> float:
        return float(r[i_samples] or 0)

    total = sum(samples(r) for r in data) or 1.0
    out = []
    for r in sorted(data, key=samples, reverse=True)[:top]:
        reasons = sorted(((float(r[i] or 0), header[i][6:]) for i in stalls), reverse=True)[:2]
        out.append((r[i_addr], samples(r) / total, r[i_src].strip(), [n for v, n in reasons if v]))
    return out


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 20
    for addr, share, sass, reasons in top_lines(Path(sys.argv[1]), top):
        print(f"{addr[-5:]:>6} {share:6.1%}  {sass[:60]:<60} {', '.join(reasons)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
