"""Run-time compilation of tree_attention.cu with NVRTC, cached on disk.

No compiler is needed at install time: NVRTC (pip package nvidia-cuda-nvrtc, through NVIDIA's
cuda-python bindings) turns the source into a cubin (SASS for one arch) in well under a second.
The cache key is (source hash, NVRTC version, arch, template expression, options); a compiled
cubin is written to a temporary file and renamed into place, so concurrent processes never read
half a file. Compilation happens at warmup (plan construction), never on a request.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from treeverify import env
from treeverify.kernels.cuda.variants import Variant

SOURCE_PATH = Path(__file__).with_name("tree_attention.cu")
KERNEL_DIR = SOURCE_PATH.parent
_lock = threading.Lock()
_memory_cache: dict[tuple[str, str], CompiledKernel] = {}


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # variant name
    arch: str
    lowered_name: str  # mangled symbol to look up in the module
    cubin: bytes
    registers: int
    spill_bytes: int  # spill stores + loads reported by ptxas
    stack_bytes: int
    smem_bytes: int  # dynamic shared memory the launch asks for
    cached: bool  # True when read from the disk cache


class CompileError(RuntimeError):
    pass


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CompileError(
            "the cuda backend needs NVIDIA's cuda-python bindings and NVRTC: "
            "pip install 'treeverify[cuda]'"
        ) from exc
    return nvrtc


def include_dirs() -> list[str]:
    """Where cuda_bf16.h / cuda_fp16.h live: the pip CUDA runtime headers, then CUDA_HOME."""
    dirs = []
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cuda_runtime/include", "cu12/include"):
                p = Path(base) / sub
                if (p / "cuda_bf16.h").exists():
                    dirs.append(str(p))
    except ImportError:
        pass
    for home in (env.cuda_home(), Path("/usr/local/cuda")):
        if home and (Path(home) / "include" / "cuda_bf16.h").exists():
            dirs.append(str(Path(home) / "include"))
    if not dirs:
        raise CompileError(
            "cannot find cuda_bf16.h: install nvidia-cuda-runtime (pip) or set CUDA_HOME"
        )
    return dirs


def nvrtc_version() -> str:
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def _options(arch: str, variant: Variant) -> list[str]:
    opts = [f"-arch={arch}", "-std=c++17", "-default-device", "--ptxas-options=-v"]
    if getattr(variant, "fast_math", True):  # kernels whose rounding is a contract opt out
        opts.append("--use_fast_math")
    opts += [f"-D{d}" for d in variant.defines]
    if variant.smem_bytes:  # the kernel static_asserts its layout needs exactly this much
        opts.append(f"-DTV_EXPECT_SMEM={variant.smem_bytes}")
    opts += [f"-I{d}" for d in (str(KERNEL_DIR), *include_dirs())]
    return opts


def _cache_key(source: str, arch: str, variant: Variant, opts: list[str]) -> str:
    # Include dirs are machine paths: leave them out of the key so caches are portable.
    stable = [o for o in opts if not o.startswith("-I")]
    blob = json.dumps([source, nvrtc_version(), arch, variant.expr, stable]).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _parse_ptxas(log: str, lowered: str) -> tuple[int, int, int]:
    """(registers, spill bytes, stack bytes) of one entry from ptxas' verbose log."""
    block = log.split(f"Function properties for {lowered}", 1)
    text = block[1] if len(block) == 2 else log
    regs = re.search(r"Used (\d+) registers", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    st = re.search(r"(\d+) bytes spill stores", text)
    ld = re.search(r"(\d+) bytes spill loads", text)
    spills = (int(st.group(1)) if st else 0) + (int(ld.group(1)) if ld else 0)
    return (
        int(regs.group(1)) if regs else -1,
        spills,
        int(stack.group(1)) if stack else 0,
    )


def _check(result, what: str, prog=None) -> None:
    nvrtc = _nvrtc()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _program_log(prog) if prog is not None else ""
        raise CompileError(f"NVRTC {what} failed ({result}):\n{log}")


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 \n")


def _source_path(variant: Variant) -> Path:
    """tree_attention.cu, unless the variant names another file beside it."""
    return KERNEL_DIR / getattr(variant, "source_file", SOURCE_PATH.name)


def _compile_now(source: str, arch: str, variant: Variant, opts: list[str]) -> dict:
    nvrtc = _nvrtc()
    name = _source_path(variant).name.encode()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name, 0, [], [])
    _check(err, "create")
    try:
        _check(nvrtc.nvrtcAddNameExpression(prog, variant.expr.encode())[0], "name expression")
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _check(err, f"compile of {variant.name} for {arch}", prog)
        log = _program_log(prog)
        err, lowered = nvrtc.nvrtcGetLoweredName(prog, variant.expr.encode())
        _check(err, "lowered name")
        lowered = lowered.decode() if isinstance(lowered, bytes) else str(lowered)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "cubin size")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    regs, spills, stack = _parse_ptxas(log, lowered)
    return {
        "lowered_name": lowered,
        "registers": regs,
        "spill_bytes": spills,
        "stack_bytes": stack,
        "cubin": cubin,
    }


def compile_variant(variant: Variant, arch: str, *, use_cache: bool = True) -> CompiledKernel:
    """The cubin of one variant for one arch: from memory, from disk, or compiled now."""
    key_mem = (variant.name, arch)
    with _lock:
        if use_cache and key_mem in _memory_cache:
            return _memory_cache[key_mem]
    source = _source_path(variant).read_text()
    opts = _options(arch, variant)
    # The key covers every header next to the source, so editing one invalidates the cache.
    headers = "".join(p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh")))
    key = _cache_key(source + headers, arch, variant, opts)
    cache = env.cache_dir() / "cuda"
    stem = f"{variant.name}-{arch}-{key}"
    cubin_path, meta_path = cache / f"{stem}.cubin", cache / f"{stem}.json"
    cached = False
    if use_cache and cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["cubin"] = cubin_path.read_bytes()
        cached = True
    else:
        meta = _compile_now(source, arch, variant, opts)
        if use_cache:
            cache.mkdir(parents=True, exist_ok=True)
            _atomic_write(cubin_path, meta["cubin"])
            side = {k: v for k, v in meta.items() if k != "cubin"}
            _atomic_write(meta_path, json.dumps(side).encode())
    kernel = CompiledKernel(
        name=variant.name,
        arch=arch,
        lowered_name=meta["lowered_name"],
        cubin=meta["cubin"],
        registers=meta["registers"],
        spill_bytes=meta["spill_bytes"],
        stack_bytes=meta["stack_bytes"],
        smem_bytes=variant.smem_bytes,
        cached=cached,
    )
    with _lock:
        _memory_cache[key_mem] = kernel
    return kernel


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
