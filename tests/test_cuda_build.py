"""The CUDA backend without a GPU: every variant compiles (NVRTC) for every target arch, the
launcher's shared-memory sizes agree with the kernels (they static_assert it), variant choice
and the split policy follow their rules."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda extra (cuda-python + NVRTC)")

from treeverify.kernels.cuda.variants import (  # noqa: E402
    ALL_ARCHES,
    SMEM_LIMIT,
    GqaSm90Variant,
    MlaSm90Variant,
    all_variants,
    fwd_variant,
)


def test_kernels_build_every_arch_from_the_cli(tmp_path):
    """`treeverify kernels build` for all six arches: exit 0, a row per variant, no spills."""
    out = tmp_path / "build.json"
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "treeverify", "kernels", "build", "--arch", ",".join(ALL_ARCHES),
         "--json", str(out)],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = json.loads(out.read_text())["variants"]
    assert len(rows) == sum(len(all_variants(a)) for a in ALL_ARCHES)
    for row in rows:
        assert "error" not in row, row
        # the 256-row CTA (v21) keeps a few floats of softmax state in local memory (L1)
        spill_ok = 160 if "_pp2_d128" in row["variant"] else 0
        assert row["registers"] > 0 and row["spill_bytes"] <= spill_ok, row
        assert row["smem_bytes"] <= SMEM_LIMIT[row["arch"]], row
        if re.search(r"_pp([dstap]|t2)?q?_", row["variant"]):  # setmaxnreg 56 + 2 x 224: 168
            assert row["registers"] == 168, row  # (the persistent kernel: 104 + 2 x 200)
    assert "built, 0 failed" in proc.stdout
    # GQA ping-pong, seven producers (pp, ppd, pps, ppt, ppt2, ppa, ppp) and four with Q in
    # registers (ppq, pptq, ppt2q, ppaq): d64/d128, 2 dtypes each
    assert sum(bool(re.search(r"_pp([dstap]|t2)?q?_", row["variant"])) for row in rows) == 44


def test_params_struct_matches_the_device_struct():
    """launch.Params (ctypes) and TreeAttnParams (device_common.cuh) list the same fields in
    the same order with the same kinds: a mismatch shifts every field after it on the GPU."""
    import ctypes
    import re

    from treeverify.kernels.cuda.launch import Params

    src = Path(__file__).resolve().parents[1] / "src/treeverify/kernels/cuda/device_common.cuh"
    body = re.search(r"struct TreeAttnParams \{(.*?)\n\};", src.read_text(), re.S).group(1)
    device = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        kind = ("ptr" if "*" in decl else "i64" if decl.startswith("long long")
                else "f32" if decl.startswith("float") else "i32")  # fmt: skip
        names = re.sub(r"^(const\s+)?(unsigned|long long|void|float|int)\s*\**", "", decl)
        device += [(n.strip().lstrip("*"), kind) for n in names.split(",")]
    kinds = {ctypes.c_void_p: "ptr", ctypes.c_longlong: "i64", ctypes.c_float: "f32",
             ctypes.c_int: "i32"}  # fmt: skip
    assert device == [(name, kinds[t]) for name, t in Params._fields_]


def test_gqa_wide_rule():
    """256-row CTAs (v21) by TREEVERIFY_CUDA_GQA_256: auto takes them where the unsplit grid
    fills the SMs (the measured wins), never below 256 rows, 1 / 0 force."""
    from treeverify.kernels.cuda.variants import gqa_wide_pays

    assert gqa_wide_pays("auto", 256, 32 * 8, 132)  # B32 x 8 KV heads: 1.11-1.21x measured
    assert not gqa_wide_pays("auto", 256, 8 * 8, 132)  # B8: 0.69-1.07x measured
    assert not gqa_wide_pays("auto", 255, 10**6, 132)
    assert gqa_wide_pays("1", 256, 1, 132) and not gqa_wide_pays("1", 128, 1, 132)
    assert not gqa_wide_pays("0", 1024, 10**6, 132)


def test_gqa_wide_rule_at_page_size_1():
    """At page size 1 auto keeps 128-row CTAs on batches over the auto producer's crossover
    (the 256-row CTA's direct producer lost 0.91x there), as the device's constant says."""
    from treeverify.kernels.cuda.variants import AUTO_DIRECT_MAX_KEYS, gqa_wide_pays

    cuh = Path(__file__).resolve().parents[1] / "src/treeverify/kernels/cuda/gqa_pp_common.cuh"
    assert f"kAutoDirectMaxKeys = {AUTO_DIRECT_MAX_KEYS};" in cuh.read_text()
    assert gqa_wide_pays("auto", 256, 256, 132, page_size=1, batch_keys=32 * 1024)
    assert not gqa_wide_pays("auto", 256, 256, 132, page_size=1, batch_keys=32 * 32768)
    assert gqa_wide_pays("auto", 256, 256, 132, page_size=16, batch_keys=32 * 32768)
    assert gqa_wide_pays("1", 256, 256, 132, page_size=1, batch_keys=32 * 32768)


def test_launcher_flags_cover_every_flag_the_launcher_reads(monkeypatch):
    """The eager path caches launchers by launcher_flags(): a flag it missed would make a test
    (or an A/B) that changes it between calls run a launcher made under the old value."""
    from treeverify.kernels.cuda.runner import launcher_flags

    flags = {
        "TREEVERIFY_CUDA_PORTABLE": "1", "TREEVERIFY_CUDA_MLA_SCHEDULE": "split",
        "TREEVERIFY_CUDA_GQA_SCHEDULE": "tile", "TREEVERIFY_CUDA_GQA_Q_REGS": "1",
        "TREEVERIFY_CUDA_GQA_256": "0", "TREEVERIFY_CUDA_SPLIT_BALANCE": "3",
        "TREEVERIFY_CUDA_MAX_SPLITS": "4", "TREEVERIFY_CUDA_TMA_MIN_PAGE": "2",
        "TREEVERIFY_CUDA_MERGE_MAX_CTAS": "512", "TREEVERIFY_CUDA_SPLIT_MERGE": "kernel",
        "TREEVERIFY_CUDA_PDL": "0", "TREEVERIFY_CUDA_MERGE_ILP": "1",
        "TREEVERIFY_CUDA_MERGE_WIDE": "1", "TREEVERIFY_CUDA_FUSED_MERGE_ILP": "0",
        "TREEVERIFY_CUDA_SPLIT_SHARE": "1", "TREEVERIFY_CUDA_SPLIT_ORDER": "request",
        "TREEVERIFY_CUDA_MERGE_SPLIT_LANES": "1",
    }  # fmt: skip
    for name in flags:
        monkeypatch.delenv(name, raising=False)
    base = launcher_flags()
    for name, value in flags.items():
        monkeypatch.setenv(name, value)
        assert launcher_flags() != base, name
        monkeypatch.delenv(name)
    src = Path(__file__).resolve().parents[1] / "src/treeverify/kernels/cuda/runner.py"
    read = set(re.findall(r"env\.(cuda_\w+)\(", src.read_text()))
    assert read == {f"cuda_{n.removeprefix('TREEVERIFY_CUDA_').lower()}" for n in flags}


def test_merge_variant_choice():
    """The merge kernel's loads in flight (v22): v12's one head x 8 splits unless
    TREEVERIFY_CUDA_MERGE_ILP asks; then 4 heads x 4 splits where a CTA merges >= 4 heads, else
    16 splits of one head past 8 splits; each a distinct build (32 spilled on sm_100a / sm_120)."""
    from treeverify.kernels.cuda.variants import MergeVariant, merge_variant

    assert merge_variant(128, "bf16", False, 8, 64) == MergeVariant(128, "bf16")
    assert merge_variant(128, "bf16", True, 8, 2) == MergeVariant(128, "bf16", 4, 4)
    assert merge_variant(512, "bf16", True, 1, 64) == MergeVariant(512, "bf16", 1, 16)
    assert merge_variant(512, "bf16", True, 2, 8) == MergeVariant(512, "bf16")
    names = {MergeVariant(128, "bf16", h, u).name for h, u in ((1, 8), (4, 4), (1, 16))}
    assert names == {"merge_v128_bf16", "merge_v128_h4u4_bf16", "merge_v128_h1u16_bf16"}
    assert MergeVariant(128, "fp16", 4, 4).expr == "treeverify::tree_attn_merge<128,false,4,4>"


def test_merge_variant_wide():
    """TREEVERIFY_CUDA_MERGE_WIDE (v28): 256-thread CTAs of dv / 4-thread head lanes where a CTA
    merges at least that many heads (8 for dv 128, 2 for MLA's 512); the plain kernel otherwise."""
    from treeverify.kernels.cuda.variants import MergeVariant, merge_head_lanes, merge_variant

    assert merge_head_lanes(128) == 8 and merge_head_lanes(512) == 2 and merge_head_lanes(64) == 16
    wide = merge_variant(128, "bf16", False, 8, 2, wide=True)
    assert wide == MergeVariant(128, "bf16", w=8) and wide.threads == 256
    assert wide.expr == "treeverify::tree_attn_merge<128,true,1,8,8>"
    assert wide.name == "merge_v128_w8_bf16"
    assert merge_variant(128, "bf16", False, 4, 2, wide=True) == MergeVariant(128, "bf16")
    assert merge_variant(512, "bf16", True, 2, 64, wide=True) == MergeVariant(512, "bf16", w=2)
    assert merge_variant(128, "bf16", False, 8, 2, wide=False) == MergeVariant(128, "bf16")


def test_merge_variant_split_lanes():
    """TREEVERIFY_CUDA_MERGE_SPLIT_LANES (v30): plans of more than 8 splits merge with 4 split
    lanes of dv / 4 threads, in their own kernel (its launch bounds); others keep the plain one,
    and the flag wins over ILP and wide (it takes one head at a time)."""
    from treeverify.kernels.cuda.variants import MergeVariant, merge_variant

    lanes = merge_variant(512, "bf16", True, 2, 64, wide=True, split_lanes=True)
    assert lanes == MergeVariant(512, "bf16", s=4) and lanes.threads == 512
    assert lanes.expr == "treeverify::tree_attn_merge_split_lanes<512,true,4>"
    assert lanes.name == "merge_v512_s4_bf16"
    assert merge_variant(128, "fp16", False, 1, 8, split_lanes=True) == MergeVariant(128, "fp16")
    assert merge_variant(128, "fp16", False, 1, 9, split_lanes=True).expr.endswith("<128,false,4>")
    assert lanes in all_variants("sm_90a") and lanes in all_variants("sm_80")
    assert lanes not in all_variants("sm_100a")  # it spilled there: not built, never chosen


def test_variant_choice():
    assert isinstance(fwd_variant("sm_90a", 576, 512, True, "bf16"), MlaSm90Variant)
    portable = fwd_variant("sm_90a", 576, 512, True, "bf16", portable=True)
    assert not isinstance(portable, MlaSm90Variant) and portable.smem_bytes <= SMEM_LIMIT["sm_90a"]
    small = fwd_variant("sm_120", 576, 512, True, "fp16")
    assert small.smem_bytes <= SMEM_LIMIT["sm_120"]
    pp = fwd_variant("sm_90a", 128, 128, False, "bf16", rows=256)  # the default schedule
    assert pp.schedule == "pingpong-auto" and pp.threads == 384 and pp.bm == 128
    tile = fwd_variant("sm_90a", 128, 128, False, "bf16", rows=256, gqa_schedule="tile")
    assert tile.schedule == "tile" and tile.threads == 256 and tile.bm == 128
    ppd = fwd_variant("sm_90a", 128, 128, False, "bf16", rows=256, gqa_schedule="pingpong-direct")
    assert ppd.threads == 384 and ppd.smem_bytes == pp.smem_bytes and ppd.name != pp.name
    assert ppd.expr.endswith(",1>") and pp.expr.endswith(",4>") and "_ppa_" in pp.name
    pps = fwd_variant("sm_90a", 64, 64, False, "fp16", rows=128, gqa_schedule="pingpong-shfl")
    assert pps.expr.endswith(",2>") and pps.threads == 384 and "_pps_" in pps.name
    assert fwd_variant("sm_90a", 128, 128, False, "bf16", rows=64, gqa_schedule="pingpong").bm == 64
    ppq = fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_schedule="pingpong",
                      gqa_q_regs=True)  # fmt: skip
    assert ppq.q_regs and ppq.expr.endswith(",0,true>") and "_ppq_" in ppq.name
    pptq = fwd_variant("sm_90a", 64, 64, False, "bf16", 256, gqa_schedule="pingpong-tma",
                       gqa_q_regs=True)  # fmt: skip
    assert pptq.tma and pptq.expr.endswith(",true>") and "_pptq_" in pptq.name
    pair = fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_schedule="pingpong-tma2")
    assert pair.tma and pair.cluster == 2 and pair.expr.endswith(",true,false,true>")
    assert pp.cluster == 1 and "_ppt2_" in pair.name
    # The default schedule's 256-row CTAs (v21) where trees x group reach 256 rows, and only the
    # default's: another schedule or fewer rows keep their 128-row kernel
    pp2 = fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_wide=True)
    assert pp2.bm == 256 and pp2.threads == 384 and pp2.expr.endswith(",1,false,2>")
    assert pp2.smem_bytes == pp.smem_bytes + 128 * 128 * 2 and "_pp2_d128_m256" in pp2.name
    assert fwd_variant("sm_90a", 128, 128, False, "bf16", 255, gqa_wide=True) == pp
    assert fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_schedule="pingpong",
                       gqa_wide=True).bm == 128  # fmt: skip
    assert fwd_variant("sm_90a", 64, 64, False, "bf16", 512, gqa_q_regs=True,
                       gqa_wide=True).schedule == "pingpong-256"  # fmt: skip
    with pytest.raises(ValueError, match="q_regs"):
        GqaSm90Variant(128, 2, "bf16", schedule="pingpong-256", q_regs=True)
    # Q in registers is a ping-pong option: the tile kernel ignores the flag, a direct build fails
    assert not fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_schedule="tile",
                           gqa_q_regs=True).q_regs  # fmt: skip
    with pytest.raises(ValueError, match="q_regs"):
        GqaSm90Variant(128, 2, "bf16", schedule="tile", q_regs=True)
    with pytest.raises(ValueError, match="schedule"):
        GqaSm90Variant(128, 1, "bf16", schedule="pingpong")  # 128-row CTAs only
    assert fwd_variant("sm_90a", 128, 128, False, "bf16", rows=64).bm == 64
    with pytest.raises(ValueError, match="head dims"):
        fwd_variant("sm_90a", 96, 96, False, "bf16")
    with pytest.raises(ValueError, match="dtype"):
        fwd_variant("sm_90a", 128, 128, False, "fp32")
    with pytest.raises(ValueError, match="arch"):
        fwd_variant("sm_70", 128, 128, False, "bf16")


def test_forced_split_count_is_read_and_checked(monkeypatch):
    """TREEVERIFY_CUDA_MAX_SPLITS (scripts/split_sweep.py, A/B): unset -> the policy decides;
    a count in 1..64 is taken; anything else names the variable."""
    from treeverify import env

    monkeypatch.delenv("TREEVERIFY_CUDA_MAX_SPLITS", raising=False)
    assert env.cuda_max_splits() is None
    monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", "8")
    assert env.cuda_max_splits() == 8
    for bad in ("0", "65", "two", "-1"):
        monkeypatch.setenv("TREEVERIFY_CUDA_MAX_SPLITS", bad)
        with pytest.raises(ValueError, match="TREEVERIFY_CUDA_MAX_SPLITS"):
            env.cuda_max_splits()


def test_mla_schedule_is_read_checked_and_selects_the_kernel(monkeypatch):
    """TREEVERIFY_CUDA_MLA_SCHEDULE picks the sm_90a MLA kernel: pair (v10, default) or split
    (v9, for A/B); both are built, fit shared memory, and differ in name and entry point."""
    from treeverify import env

    monkeypatch.delenv("TREEVERIFY_CUDA_MLA_SCHEDULE", raising=False)
    assert env.cuda_mla_schedule() == "pair"
    monkeypatch.setenv("TREEVERIFY_CUDA_MLA_SCHEDULE", " Split ")
    assert env.cuda_mla_schedule() == "split"
    monkeypatch.setenv("TREEVERIFY_CUDA_MLA_SCHEDULE", "seesaw")
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_MLA_SCHEDULE"):
        env.cuda_mla_schedule()
    pair = fwd_variant("sm_90a", 576, 512, True, "bf16")
    split = fwd_variant("sm_90a", 576, 512, True, "bf16", mla_schedule="split")
    assert (pair.schedule, split.schedule) == ("pair", "split")
    assert "tree_attn_mla_pair_sm90" in pair.expr and "tree_attn_mla_sm90<" in split.expr
    assert pair.name != split.name
    assert pair.smem_bytes < split.smem_bytes <= SMEM_LIMIT["sm_90a"]  # P needs no tile of its own
    assert {pair, split} <= set(all_variants("sm_90a"))
    with pytest.raises(ValueError, match="schedule"):
        MlaSm90Variant(64, "bf16", "seesaw")


def test_env_and_variants_agree_on_the_gqa_schedules(monkeypatch):
    """env.py (which imports no kernel code) lists the schedules TREEVERIFY_CUDA_GQA_SCHEDULE
    takes; variants.GQA_SCHEDULES is what fwd_variant builds: the same set, the same default."""
    from treeverify import env
    from treeverify.kernels.cuda.variants import GQA_SCHEDULES

    monkeypatch.delenv("TREEVERIFY_CUDA_GQA_SCHEDULE", raising=False)
    assert env.cuda_gqa_schedule() == GQA_SCHEDULES[0]
    for schedule in GQA_SCHEDULES:
        monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", schedule)
        assert env.cuda_gqa_schedule() == schedule
        assert fwd_variant("sm_90a", 128, 128, False, "bf16", 256, gqa_schedule=schedule)
    monkeypatch.setenv("TREEVERIFY_CUDA_GQA_SCHEDULE", "pingpong-nope")
    with pytest.raises(ValueError, match="TREEVERIFY_CUDA_GQA_SCHEDULE"):
        env.cuda_gqa_schedule()


def test_cta_trace_build_is_a_variant_of_its_own(tmp_path, monkeypatch):
    """scripts/cta_trace.py's diagnostic builds (TV_CTA_TRACE, and with --define's extra
    defines): their own names (the compile cache is keyed by name, so none stands in for
    another or for the shipped kernel), no spills in the shipped build (a few words at most in
    the traced ones), and the
    unmangled `tv_cta_trace` pointer in its cubin for the script to point at a buffer; the
    shipped variant has none."""
    import dataclasses

    from treeverify.kernels.cuda.jit import compile_variant

    monkeypatch.setenv("TREEVERIFY_CACHE_DIR", str(tmp_path))
    shipped = fwd_variant("sm_90a", 128, 128, False, "bf16", rows=256)
    traced = dataclasses.replace(shipped, defines=(*shipped.defines, "TV_CTA_TRACE"))
    assert traced.name == shipped.name + "_trace"
    # A diagnostic variant of the kernel (cta_trace.py --define NAME=VALUE, an experiment's
    # #ifdef): a name of its own again.
    extra = dataclasses.replace(traced, defines=(*traced.defines, "TV_EXPERIMENT=1"))
    assert extra.name == traced.name + "_tvexperiment1"
    for variant, has_trace in ((shipped, False), (traced, True), (extra, True)):
        compiled = compile_variant(variant, "sm_90a", use_cache=False)
        # The shipped build spills nothing; the traced ones (their marks' registers on top of a
        # kernel at its launch bound) at most a few words (24 B since the later splits' request
        # ranking, TREEVERIFY_CUDA_SPLIT_ORDER, sits at the kernel's start).
        assert compiled.spill_bytes <= (32 if has_trace else 0), variant.name
        assert (b"tv_cta_trace" in compiled.cubin) == has_trace, variant.name


@pytest.mark.parametrize(
    "argv, says",
    [(["--arch", ""], "(empty)"), (["--arch", "sm_80,,"], "(empty)"),
     (["--json", "/nonexistent-dir/x.json"], "--json"), (["--arch", "sm_999"], "sm_999")],
)  # fmt: skip
def test_kernels_build_refuses_bad_arguments_before_building(argv, says):
    """`--arch ""` built nothing and exited 0; a --json path in a missing directory failed with
    a traceback after every variant was built: both refused first, naming the flag."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "treeverify", "kernels", "build", *argv],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode in (2, 64), proc.stdout + proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert "built," not in proc.stdout  # refused before any variant was compiled
