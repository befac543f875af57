"""Compile the Triton kernels for a GPU arch without a GPU and report their resources.

    python -m treeverify.kernels.triton.aot_check [--arch 90] [--family gqa128 ...]

For every family the backend serves (the tile config `choose_config` picks at the grid's
capacities) this lowers tree_attn_fwd / tree_attn_merge through Triton's own pipeline to a cubin
with the bundled ptxas, then prints shared memory (from Triton's metadata) and registers /
spills (from `ptxas -v`). Catches compile errors and register spills on a CPU-only machine;
says nothing about speed. Pointers and strides are declared 16-divisible, as the runtime
specialises them for aligned caches.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch

# (name, hq, hkv, dqk, dv, mla, max_tree, page_size)
FAMILIES = [
    ("gqa128-n16", 32, 8, 128, 128, False, 16, 16),
    ("gqa128-n64", 32, 8, 128, 128, False, 64, 16),
    ("gqa64", 8, 2, 64, 64, False, 16, 1),
    ("gqa256", 16, 4, 256, 256, False, 16, 64),
    ("mla-tp8", 8, 1, 576, 512, True, 16, 64),
    ("mla-tp1", 64, 1, 576, 512, True, 16, 1),
]
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _compile(fn, signature, constexprs, aligned, arch, num_warps, num_stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def _ptxas_usage(ptx: str, arch: int) -> str:
    from triton.backends.nvidia import compiler as nv

    try:  # the ptxas Triton itself uses for this arch (the API differs across 3.x)
        ptxas = nv.get_ptxas(arch).path
    except TypeError:
        tool = nv.get_ptxas()
        ptxas = getattr(tool, "path", tool)
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm}", path, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
        )
    text = res.stderr + res.stdout
    if res.returncode:
        return f"ptxas failed: {text.strip()[-500:]}"
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return f"regs={regs[-1] if regs else '?'} spill_stores={spill[-1] if spill else '?'}B"


def check(arch: int = 90, families=None, dtypes=(torch.bfloat16,), override=None,
          balanced: bool = False) -> list[str]:  # fmt: skip
    """One line per compiled kernel; `override` (dict of TritonConfig fields) replaces the
    chosen tile config's fields, for sweeps; `balanced`: the kernels as a balanced plan
    compiles them (kernels/splits.py: with the batch sum of 16 lanes), else as every other."""
    from dataclasses import replace

    from treeverify.kernels.triton.runner import choose_config
    from treeverify.kernels.triton.tree_attention import tree_attn_fwd, tree_attn_merge

    block_b = 16 if balanced else 0

    lines = []
    for name, hq, hkv, dqk, dv, mla, max_tree, page in FAMILIES:
        if families and name not in families:
            continue
        for dtype in dtypes:
            ty = _TY[dtype]
            cfg = choose_config(hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla, max_tree=max_tree,
                                dtype=dtype)  # fmt: skip
            if override:
                cfg = replace(cfg, **override)
            fwd_sig = {
                "Q": f"*{ty}", "K": f"*{ty}", "V": f"*{ty}", "Out": f"*{ty}",
                "PartO": "*fp32", "PartLse": "*fp32", "BlockTable": "*i32",
                "PrefixLens": "*i32", "QoIndptr": "*i32", "TreeMask": "*i32",
                "scale_log2": "fp32",
            }  # fmt: skip
            for n in tree_attn_fwd.arg_names:
                fwd_sig.setdefault(n, "i32")
            consts = dict(G=hq // hkv, PAGE_SIZE=page, DV=dv, DR=dqk - dv, V_FROM_K=mla,
                          BM=cfg.bm, BN=cfg.bn, PREC="tf32x3" if ty == "fp32" else "tf32",
                          INTERP_BF16=False, BLOCK_B=block_b)  # fmt: skip
            aligned = [n for n, t in fwd_sig.items() if t.startswith("*")]
            aligned += ["stride_qt", "stride_qh", "stride_kp", "stride_kh", "stride_vp",
                        "stride_vh", "stride_ot", "stride_oh"]  # fmt: skip
            if page > 1:
                aligned += ["stride_ks", "stride_vs"]
            tag = f"{name} {ty} BM={cfg.bm} BN={cfg.bn} w={cfg.num_warps} s={cfg.num_stages}"
            try:
                k = _compile(tree_attn_fwd, fwd_sig, consts, aligned, arch, cfg.num_warps,
                             cfg.num_stages)  # fmt: skip
                ptx = k.asm["ptx"]
                mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
                lines.append(
                    f"fwd   {tag}: smem={k.metadata.shared}B {_ptxas_usage(ptx, arch)} {mma}"
                )
            except Exception as exc:  # report, keep going
                lines.append(f"fwd   {tag}: FAILED {type(exc).__name__}: {exc}"[:2000])
        merge_sig = {"Out": f"*{_TY[dtypes[0]]}", "PartO": "*fp32", "PartLse": "*fp32",
                     "PrefixLens": "*i32", "QoIndptr": "*i32"}  # fmt: skip
        for n in tree_attn_merge.arg_names:
            merge_sig.setdefault(n, "i32")
        consts = dict(DV=dv, LOG_B=6, INTERP_BF16=False, BLOCK_B=block_b)
        try:
            k = _compile(tree_attn_merge, merge_sig, consts, ["Out", "PartO", "PartLse"], arch,
                         4 if dv >= 256 else 2, 1)  # fmt: skip
            lines.append(f"merge {name} DV={dv}: {_ptxas_usage(k.asm['ptx'], arch)}")
        except Exception as exc:
            lines.append(f"merge {name}: FAILED {type(exc).__name__}: {exc}"[:2000])
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--family", action="append", help="limit to these families")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--balanced", action="store_true", help="the balanced plans' build")
    for field in ("bm", "bn", "num_warps", "num_stages"):
        ap.add_argument(f"--{field}", type=int, help="override the chosen config")
    args = ap.parse_args(argv)
    override = {
        f: getattr(args, f)
        for f in ("bm", "bn", "num_warps", "num_stages")
        if getattr(args, f) is not None
    }
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    dtypes = ({v: k for k, v in _TY.items()}[args.dtype],)
    lines = check(args.arch, args.family, dtypes, override, balanced=args.balanced)
    print("\n".join(lines))
    return 1 if any("FAILED" in ln for ln in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
