"""Our CPU kernels for bf16 decoding: the int4 matmul (int4_cpu.cpp) and the fused per-layer steps (fused_cpu.cpp,
layer_cpu.cpp), built once per machine and ISA by torch's C++ extension builder (cached under ~/.cache/torch_extensions),
the ISA they run on chosen once per process, and the weight layout the matmul reads.

ISAs (docs/weights.md): `avx512` (AVX512-BF16 and VNNI) and `avx2` (AVX2, FMA, F16C: most AMD CPUs, laptops), one
extension each from the same sources (cpu_isa.h is the ISA layer), the same ops and schemas under
`torch.ops.specfleet_<isa>`, and the same bits where the maths allow (docs/weights.md says where not); NEON is
designed for in cpu_isa.h, not built. `SPECFLEET_CPU_ISA=avx512|avx2|torch` picks one (default `auto`: the fastest
this CPU runs); `torch` (or the older `SPECFLEET_CPU_KERNELS=torch`) keeps torch's own ops, as does a CPU with
neither ISA or a machine without a C++ compiler or ninja. Where they beat torch's ops is measured in
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from actors.model.kernel_build import build_lock, load_built, mark_built, ninja_on_path
from actors.start_phases import phase

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("int4_cpu.cpp", "fused_cpu.cpp", "layer_cpu.cpp", "attention_cpu.cpp")]
HEADERS = [HERE / name for name in ("cpu_isa.h", "int4_avx512.h", "int4_avx2.h")]  # in the build's identity too
ROWS, GROUP = 16, 32  # the matmul's row block and scale group (int4_cpu.cpp kRows, kGroup)
ISAS = ("avx512", "avx2")  # what we build, fastest first; "torch" is torch's own ops
# no FMA the source does not write (-ffp-contract=off): the ISAs' builds then round alike (cpu_isa.h)
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"],
         "avx2": ["-mavx2", "-mfma", "-mf16c"]}
NEEDS = {"avx512": ("avx512_bf16", "avx512_vnni"), "avx2": ("avx2", "fma", "f16c")}  # /proc/cpuinfo flags


def choice() -> tuple[str, str]:
    """(ISA, why): which of our builds runs this process's CPU kernels ("avx512", "avx2") or "torch" for torch's
    own ops, from `SPECFLEET_CPU_ISA` (default auto: the fastest this CPU and machine run), chosen once for the
    process's environment and logged in one line. An ISA asked for that cannot run here falls back to torch's ops,
    with a warning that says why; a value that names no ISA is an error."""
    return _choose(os.environ.get("SPECFLEET_CPU_KERNELS"), os.environ.get("SPECFLEET_CPU_ISA", "auto"))


@functools.cache
def _choose(kernels: str | None, asked: str) -> tuple[str, str]:
    asked = asked.strip().lower() or "auto"
    if kernels == "torch":
        isa, why = "torch", "SPECFLEET_CPU_KERNELS=torch"
    elif asked not in ("auto", "torch", *ISAS):
        raise ValueError(f"SPECFLEET_CPU_ISA={asked!r}: expected one of auto, {', '.join(ISAS)}, torch")
    elif asked == "torch":
        isa, why = "torch", "SPECFLEET_CPU_ISA=torch"
    elif asked != "auto":
        reason = unavailable(asked)
        isa, why = (asked, f"SPECFLEET_CPU_ISA={asked}") if reason is None else \
            ("torch", f"SPECFLEET_CPU_ISA={asked}, but {reason}")
        if reason is not None:
            log.warning("our %s CPU kernels cannot run here (%s); using torch's ops", asked, reason)
    else:
        reasons = {name: unavailable(name) for name in ISAS}
        isa = next((name for name in ISAS if reasons[name] is None), "torch")
        why = f"auto: this CPU has {'+'.join(NEEDS[isa])}" if isa != "torch" else \
            "auto: " + "; ".join(f"not {name}: {reasons[name]}" for name in ISAS)
    log.info("CPU kernels: %s (%s)", isa, why)
    return isa, why


def isa() -> str:
    """The ISA of this process's CPU kernels: "avx512", "avx2" or "torch" (`choice`)."""
    return choice()[0]


def describe() -> dict[str, str]:
    """What `specfleet status` and the start-up line show: the ISA path, why it was chosen, and its build."""
    name, why = choice()
    return {"isa": name, "why": why, "build": identity()}


def reset() -> None:
    """Choose again at the next use (tests that change what the choice reads, e.g. `cpu_flags`); builds already
    loaded stay loaded."""
    _choose.cache_clear()


@contextlib.contextmanager
def forced(which: str) -> Iterator[None]:
    """Inside the block our kernels run on `which` ("avx512", "avx2", "torch"), as under SPECFLEET_CPU_ISA=which (the
    layers and linears built there keep that build); the environment and the choice are restored after it."""
    before = os.environ.get("SPECFLEET_CPU_ISA")
    os.environ["SPECFLEET_CPU_ISA"] = which
    reset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPECFLEET_CPU_ISA", None)
        else:
            os.environ["SPECFLEET_CPU_ISA"] = before
        reset()


def ops(which: str | None = None):  # noqa: ANN201 - torch's op namespace object
    """`torch.ops.specfleet_<isa>` (int4_mm, int4_mm_q8, int4_gemm_q8, int8_rows, int4_dequant, rms_norm, add_rms_norm,
    rope_, norm_rope_, silu_mul, gelu_tanh_mul, span_attention, chunk_attention, decode_layer) of the chosen ISA (or
    `which`), built on first use; None where they do not run (torch's ops do the work)."""
    name = which or isa()
    if name == "torch":
        return None
    if which is not None and unavailable(which) is not None:
        return None
    return _load(name)


ops.cache_clear = reset  # type: ignore[attr-defined]  # the name tests used while ops() itself was cached


@functools.cache
def _load(name: str):  # noqa: ANN202 - torch's op namespace object
    build = f"specfleet_cpu_{build_id(name)}"
    try:
        with phase("kernels"):
            if not load_built(build):  # a first start on this machine (or after a change of sources or torch)
                _build(name, build)
    except (OSError, RuntimeError) as e:  # no compiler, it refused the flags, or a build held past the bound
        log.warning("our %s CPU kernels could not be built (%s); using torch's ops", name, e)
        return None
    _register_fake(namespace(name))
    return getattr(torch.ops, namespace(name))


def _build(name: str, build: str) -> None:
    """Build (or let torch's builder find up to date) the ISA's extension, load it, and mark the build done."""
    from torch.utils.cpp_extension import load

    with build_lock(build):  # bounded, and never stuck on a killed build's lock (actors/model/kernel_build.py)
        library = load(name=build, sources=[str(s) for s in SOURCES],
                       extra_cflags=[*COMMON_FLAGS, *FLAGS[name], f"-DSPECFLEET_NS={namespace(name)}"],
                       is_python_module=False, verbose=False)
        mark_built(build, Path(library))


def namespace(name: str) -> str:
    """The op namespace of an ISA's build: one per ISA, so that both can load in one process (and be compared)."""
    return f"specfleet_{name}"


def build_id(which: str | None = None) -> str:
    """An ISA's build identity (default: the chosen ISA's): the ISA and a digest of the sources and flags (the name
    of its build)."""
    name = which or isa()
    if name not in ISAS:
        raise ValueError(f"no build for {name!r}: ours are {', '.join(ISAS)}")
    return _build_id(name)


@functools.cache
def _build_id(name: str) -> str:
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(COMMON_FLAGS + FLAGS[name]).encode()
    return f"{name}_{hashlib.sha256(text).hexdigest()[:12]}"


def identity() -> str:
    """What computes this process's CPU matmuls and fused steps: the chosen ISA's `build_id()` (it names the ISA),
    or "torch" where our kernels do not run (without building them)."""
    return "torch" if isa() == "torch" else build_id()


def unavailable(which: str | None = None) -> str | None:
    """Why our kernels for `which` (default: the chosen ISA) cannot run in this process, or None where they run (or
    can be built: a build that still fails falls back too, with a warning)."""
    if which is None:
        name, why = choice()
        return why if name == "torch" else None
    if which not in ISAS:
        raise ValueError(f"no build for {which!r}: ours are {', '.join(ISAS)}")
    if os.environ.get("SPECFLEET_CPU_KERNELS") == "torch":
        return "SPECFLEET_CPU_KERNELS=torch"
    missing = [flag for flag in NEEDS[which] if flag not in cpu_flags()]
    if missing:
        return f"this CPU has no {'/'.join(f.upper() for f in missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:  # the compiler torch's extension builder calls
        return "no C++ compiler"
    from torch.utils.cpp_extension import is_ninja_available

    ninja_on_path()  # the `ninja` package's, where the venv's bin is not on PATH
    return None if is_ninja_available() else "no ninja (torch's extension builder needs it)"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux's /proc/cpuinfo names them; elsewhere what torch's probes say of them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    probes = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "avx512_vnni": torch.cpu._is_vnni_supported(),
              "avx2": torch.cpu._is_avx2_supported(), "fma": torch.cpu._is_avx2_supported(),
              "f16c": torch.cpu._is_avx2_supported()}  # torch's AVX2 level implies FMA and F16C
    return frozenset(name for name, present in probes.items() if present)


@functools.cache
def amx() -> bool:
    """This CPU has AMX tiles for bf16 (Sapphire Rapids and later) and torch's GEMMs may use them (oneDNN's ISA not
    held below it by DNNL_MAX_CPU_ISA, as `make test`'s fallback pass and `bench dtype --as-avx2` hold it)."""
    held = os.environ.get("DNNL_MAX_CPU_ISA", "").upper()
    return "amx_bf16" in cpu_flags() and (held == "" or "AMX" in held or held == "ALL")


def kernel(activations: str = "int8", which: str | None = None) -> Callable | None:
    """The int4 matmul (int4_cpu.cpp) on inputs rounded to int8 per group (`int4_mm_q8`) or as given in bf16
    (`int4_mm`), of the chosen ISA (or `which`), or None where our kernels do not run."""
    lib = ops(which)
    if lib is None:
        return None
    return {"int8": lib.int4_mm_q8, "bf16": lib.int4_mm}[activations]


def _register_fake(ns: str) -> None:
    """Output shapes for fake tensors (torch.compile tracing) of the ops in namespace `ns`."""
    @torch.library.register_fake(f"{ns}::int4_mm")
    def _(x, codes, scale, offset, scale_mult, offset_mult, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{ns}::int4_mm_q8")
    def _(x, codes, scale, offset, scale_mult, offset_mult, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{ns}::int4_gemm_q8")
    def _(x, codes, scale, offset, scale_mult, offset_mult, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{ns}::decode_layer")
    def _(x, *rest):  # noqa: ANN001, ANN002, ANN202 - the op's schema
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::int8_rows")
    def _(x):  # noqa: ANN001, ANN202 - the op's schema
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::int4_dequant")
    def _(codes, scale, offset, scale_mult, offset_mult, n, k):  # noqa: ANN001, ANN202 - the op's schema
        return codes.new_empty(n, k, dtype=torch.bfloat16)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
         levels: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The matmul's layout of 4-bit codes (N, K) uint8 (planes side by side; N a multiple of 16, K of 32) and their
    per-group scale and offset (N, K / 32) fp32: (codes, scale, offset, scale_mult, offset_mult) for int4_mm.

    Codes: (N / 16, K / 8, 64) uint8, the 32 16-bit words of chunk c, word j = 2i + e holding row i's code at
    8c + 2t + e in its nibble t (bits 4t .. 4t + 3). Scales, the fewest bytes that hold them exactly: a K-quant's two levels (`levels`:
    fp16 per 8 groups, uint8 multipliers per group), else fp16 per group where every value is an fp16, else fp32;
    each as (N / 16, groups, 16), rows innermost. The multipliers are None but for two levels.
    """
    n, k = codes.shape
    c = codes.to(torch.int32).view(n // ROWS, ROWS, k // 8, 4, 2)  # block, row i, chunk, nibble t, e
    words = c[:, :, :, 0] | c[:, :, :, 1] << 4 | c[:, :, :, 2] << 8 | c[:, :, :, 3] << 12  # (blocks, 16, K / 8, 2)
    words = words.permute(0, 2, 1, 3).reshape(n // ROWS, k // 8, 32).to(torch.int16)  # word j = 2i + e (wraps: bits)
    packed = words.contiguous().view(torch.uint8)  # (blocks, K / 8, 64), little-endian words

    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (N, G) -> (N / 16, G, 16)
        return t.to(dtype).view(n // ROWS, ROWS, -1).transpose(1, 2).contiguous()

    if levels is not None and all(_is_half(t) for t in (levels[0], levels[2])):
        d, sc, dm, mn = levels
        return (packed, blocked(d, torch.float16), blocked(dm, torch.float16), blocked(sc, torch.uint8),
                blocked(mn, torch.uint8))
    dtype = torch.float16 if _is_half(scale) and _is_half(offset) else torch.float32
    return packed, blocked(scale, dtype), blocked(offset, dtype), None, None


def _is_half(t: torch.Tensor) -> bool:
    """Every value of fp32 `t` is an fp16 (finite): it can be stored in half the bytes exactly."""
    h = t.to(torch.float16)
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())
