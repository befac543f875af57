"""``treeverify check``: run a tree_attention backend on random cases and compare to ground truth.

Every case is fresh random data: GQA, MHA and MLA heads, page sizes 1/16/64, ragged prefixes (one
empty), random topological trees up to 1025 nodes, pages assigned in shuffled order, the output
poisoned with NaN beforehand. The torch backend is compared to an independent float64 dense
computation (the reference is not compared with itself); other backends to the fp32 reference.
Exit code: 0 all cases pass, 1 any fails, 2 the backend or device is unavailable or a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from treeverify.kernels import api
from treeverify.kernels.reference import tree_attention_reference
from treeverify.strict_args import int_at_least, output_file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# ||out - ref|| / ||ref|| allowed per output dtype
TOLERANCE = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-5}
SCORE_STD = 2.5  # q is scaled so scores have about this spread: peaky softmax, mask errors show


@dataclass(frozen=True)
class Case:
    name: str
    hq: int
    hkv: int
    dqk: int
    dv: int
    mla: bool
    page_size: int
    prefix_lens: tuple[int, ...]
    tree_sizes: tuple[int, ...]


def _mla(name, hq, page_size, prefix_lens, tree_sizes) -> Case:
    return Case(name, hq, 1, 576, 512, True, page_size, prefix_lens, tree_sizes)


def cases(quick: bool, device: str) -> list[Case]:
    """The case list. MLA uses 2 query heads on the CPU (8 on a GPU: Kimi K2 at TP8)."""
    mla_hq = 8 if device == "cuda" else 2
    quick_cases = [
        Case("gqa8/2x64-p16", 8, 2, 64, 64, False, 16, (0, 37, 300), (1, 16, 64)),
        Case("mha4x64-p1", 4, 4, 64, 64, False, 1, (129, 5), (33, 7)),
        _mla(f"mla{mla_hq}x576/512-p64", mla_hq, 64, (200, 0), (16, 40)),
        Case("gqa32/8x128-p64", 32, 8, 128, 128, False, 64, (500, 64), (64, 16)),
        Case("gqa4/1x64-p16-tree1025", 4, 1, 64, 64, False, 16, (96,), (1025,)),
    ]
    if quick:
        return quick_cases
    return quick_cases + [
        Case("gqa8/2x64-p1-long", 8, 2, 64, 64, False, 1, (2048, 0), (16, 64)),
        Case("gqa8/2x64-p64-ragged", 8, 2, 64, 64, False, 64, (0, 1, 63, 64, 65, 700), (5,) * 6),
        Case("mha8x128-p16", 8, 8, 128, 128, False, 16, (1000, 17, 0), (64, 2, 33)),
        _mla(f"mla{mla_hq}x576/512-p1", mla_hq, 1, (300, 0, 45), (64, 3, 16)),
        _mla(f"mla{mla_hq}x576/512-p16-tree1025", mla_hq, 16, (40,), (1025,)),
        Case("gqa32/8x128-p16-b4", 32, 8, 128, 128, False, 16, (900, 0, 33, 256), (16,) * 4),
    ]


def random_parents(t: int, gen: np.random.Generator) -> list[int]:
    """parent[0] = -1 (root); parent[i] uniform in [0, i) — a random topological tree."""
    return [-1] + [int(gen.integers(0, i)) for i in range(1, t)]


def parents_to_mask_rows(parents: list[int], words: int) -> np.ndarray:
    """(T, words) int32: bit j of word j//32 in row i set iff node j is i or an ancestor of i."""
    t = len(parents)
    sees = np.zeros((t, 32 * words), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            sees[i] = sees[p]
        sees[i, i] = True
    return np.packbits(sees, axis=1, bitorder="little").view("<u4").view(np.int32)


def make_inputs(case: Case, dtype: torch.dtype, device: str, seed: int) -> dict:
    """Random tree_attention arguments for one case (on `device`, floats in `dtype`)."""
    gen = np.random.default_rng(seed)
    torch_gen = torch.Generator().manual_seed(seed)
    ps, sizes = case.page_size, case.tree_sizes
    words = -(-max(sizes) // 32)
    need = [-(-(p + t) // ps) for p, t in zip(case.prefix_lens, sizes, strict=True)]
    num_pages = sum(need) + 3  # a few pages nobody uses
    order = gen.permutation(num_pages)  # pages handed out in shuffled order
    table = np.full((len(sizes), max(need) + 1), -1, dtype=np.int32)  # unused entries: -1
    used = np.zeros((num_pages, ps), dtype=bool)
    start = 0
    for b, (p, t) in enumerate(zip(case.prefix_lens, sizes, strict=True)):
        table[b, : need[b]] = order[start : start + need[b]]
        start += need[b]
        pos = np.arange(p + t)
        used[table[b, pos // ps], pos % ps] = True
    mask = np.concatenate([parents_to_mask_rows(random_parents(t, gen), words) for t in sizes])

    def randn(*shape):
        return torch.randn(*shape, generator=torch_gen)

    k_cache = randn(num_pages, ps, case.hkv, case.dqk)
    v_cache = None if case.mla else randn(num_pages, ps, case.hkv, case.dv)
    garbage = torch.from_numpy(~used)  # slots no request owns: large values, must stay unread
    k_cache[garbage] *= 100.0
    if v_cache is not None:
        v_cache[garbage] *= 100.0
    q = randn(sum(sizes), case.hq, case.dqk) * SCORE_STD
    qo_indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    return {
        "q": q.to(device, dtype),
        "k_cache": k_cache.to(device, dtype),
        "v_cache": None if v_cache is None else v_cache.to(device, dtype),
        "block_table": torch.from_numpy(table).to(device),
        "prefix_lens": torch.tensor(case.prefix_lens, dtype=torch.int32, device=device),
        "qo_indptr": torch.from_numpy(qo_indptr).to(device),
        "tree_mask": torch.from_numpy(np.ascontiguousarray(mask)).to(device),
        "sm_scale": 1.0 / math.sqrt(case.dqk),
        "v_head_dim": case.dv if case.mla else None,
    }


def dense_float64(inputs: dict) -> torch.Tensor:
    """Independent ground truth: per request a dense (T, P+T) mask and a plain float64 softmax."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    q, k_cache, v_cache = cpu["q"].double(), cpu["k_cache"].double(), cpu["v_cache"]
    dv = cpu["v_head_dim"] if v_cache is None else v_cache.shape[-1]
    v_cache = k_cache[..., :dv] if v_cache is None else v_cache.double()
    ps, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    qo, prefix = cpu["qo_indptr"].tolist(), cpu["prefix_lens"].tolist()
    bits = np.unpackbits(cpu["tree_mask"].numpy().view(np.uint8), axis=1, bitorder="little")
    out = torch.empty(q.shape[0], hq, dv, dtype=torch.float64)
    for b in range(len(prefix)):
        r0, r1, p = qo[b], qo[b + 1], prefix[b]
        t = r1 - r0
        pos = torch.arange(p + t)
        page, slot = cpu["block_table"][b].long()[pos // ps], pos % ps
        k = k_cache[page, slot].repeat_interleave(hq // hkv, dim=1)  # (P+T, Hq, Dqk)
        v = v_cache[page, slot].repeat_interleave(hq // hkv, dim=1)  # (P+T, Hq, Dv)
        visible = torch.ones(t, p + t, dtype=torch.bool)
        visible[:, p:] = torch.from_numpy(bits[r0:r1, :t].astype(bool))
        scores = torch.einsum("thd,nhd->htn", q[r0:r1], k) * cpu["sm_scale"]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[r0:r1] = torch.einsum("htn,nhd->thd", probs, v)
    return out


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    rel_err: float  # ||out - ref|| / ||ref|| over the whole output
    row_err: float  # the same per (row, head) vector, worst one: a wrong mask row shows here
    bad: int  # elements NaN/inf in out: never written over the NaN poison, or not finite
    passed: bool


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Comparison:
    """A backend's (total_q, Hq, Dv) output vs ground truth. Passes when every element is finite,
    rel_err <= TOLERANCE[dtype] and row_err <= 2 * TOLERANCE[dtype]."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    bad = int((~torch.isfinite(out64)).sum())
    if bad:
        return Comparison(math.inf, math.inf, math.inf, bad, False)
    diff = out64 - ref64
    max_abs = float(diff.abs().max())
    rel_err = float(diff.norm() / ref64.norm())
    row_err = float((diff.norm(dim=-1) / ref64.norm(dim=-1)).max())
    tol = TOLERANCE[dtype]
    return Comparison(max_abs, rel_err, row_err, 0, rel_err <= tol and row_err <= 2 * tol)


def run_case(case: Case, backend: str, dtype: torch.dtype, device: str, seed: int) -> dict:
    inputs = make_inputs(case, dtype, device, seed)
    shape = (inputs["q"].shape[0], case.hq, case.dv)
    out = torch.full(shape, math.nan, dtype=dtype, device=device)  # poison: all must be written
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_table", "prefix_lens")]
    args += [inputs["qo_indptr"], inputs["tree_mask"], inputs["sm_scale"]]
    start = time.perf_counter()
    returned = api.tree_attention(*args, v_head_dim=inputs["v_head_dim"], out=out, backend=backend)
    seconds = time.perf_counter() - start
    if backend == "torch":
        ref = dense_float64(inputs)
    else:
        ref = tree_attention_reference(*args, v_head_dim=inputs["v_head_dim"])
    result = compare(out, ref, dtype)
    in_place = returned is out
    return {
        "case": case.name,
        "batch": len(case.tree_sizes),
        "prefix_lens": list(case.prefix_lens),
        "tree_sizes": list(case.tree_sizes),
        "page_size": case.page_size,
        "heads": f"{case.hq}/{case.hkv}x{case.dqk}/{case.dv}",
        "seed": seed,
        "seconds": round(seconds, 4),
        **asdict(result),
        "returned_out": in_place,
        "passed": result.passed and in_place,
    }


def _table(rows: list[dict], backend: str, dtype_name: str) -> str:
    head = (
        f"{'case':<30} {'backend':<7} {'dtype':<5} {'max abs':>9} {'rel err':>9} "
        f"{'worst row':>9} {'bad':>4}  pass"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:<30} {backend:<7} {dtype_name:<5} {r['max_abs']:>9.2e} "
            f"{r['rel_err']:>9.2e} {r['row_err']:>9.2e} {r['bad']:>4}  "
            f"{'ok' if r['passed'] else 'FAIL'}"
        )
    return "\n".join(lines)


def _json_number(value):
    """inf (an unwritten output) as null: strict JSON has no infinity."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


SEED_MAX = 2**32 - 1  # case i draws from seed * 1000 + i: must fit torch's 64-bit seed


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check",
        help="compare a tree_attention backend with ground truth on random cases",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--backend", choices=api.BACKENDS, default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if any")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument(
        "--seed", type=int_at_least(0, SEED_MAX), default=0, help=f"0..{SEED_MAX} (default: 0)"
    )
    p.add_argument("--quick", action="store_true", help="the five core cases only")
    p.add_argument(
        "--json", metavar="FILE", type=output_file, help="also write the results as JSON"
    )
    return p


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("treeverify check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.backend == "cuda" and device != "cuda":  # the kernel would refuse every case
        print("treeverify check: error: --backend cuda runs on a CUDA device only (--device cuda)",
              file=sys.stderr)  # fmt: skip
        return 2
    dtype = DTYPES[args.dtype]
    backend = api.resolve_backend(args.backend, torch.device(device), dtype)
    if backend == "triton" and device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's own switch: run interpreted
    if backend in ("cuda", "triton"):
        try:
            api.cuda_backend() if backend == "cuda" else api.triton_backend()
        except RuntimeError as exc:
            print(f"treeverify check: {exc}", file=sys.stderr)
            return 2

    rows = []
    for i, case in enumerate(cases(args.quick, device)):
        rows.append(run_case(case, backend, dtype, device, args.seed * 1000 + i))
    print(_table(rows, backend, args.dtype))
    failed = sum(not r["passed"] for r in rows)
    print(
        f"all {len(rows)} cases passed" if not failed else f"{failed} of {len(rows)} cases FAILED"
    )
    if args.json:
        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "backend": backend,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "dtype": args.dtype,
            "seed": args.seed,
            "torch": torch.__version__,
            "tolerance_rel_err": TOLERANCE[dtype],
            "cases": [{k: _json_number(v) for k, v in r.items()} for r in rows],
            "passed": failed == 0,
        }
        try:
            with open(args.json, "w") as fh:
                json.dump(record, fh, indent=2)
        except OSError as exc:  # checked up front; this is a disk full or a race
            print(f"treeverify check: --json: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    return 0 if failed == 0 else 1
