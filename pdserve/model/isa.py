"""Which instruction set pdserve's compiled CPU kernels target on this host.

One kernel build per level (`fused.py` builds and loads each under its own name), chosen at run
time from the flags the CPU reports, never from the CPU the code was built on:

- `generic`: plain C++ (x86-64 without AVX2, or another architecture);
- `avx2`: AVX2 + FMA; bf16 is emulated, so bf16 weights are widened to fp32 as they are read
  and batches of rows are multiplied in fp32 (`--bf16-matmul auto`);
- `avx512`: AVX512 with AVX512_BF16: `vdpbf16ps` multiplies bf16 pairs into fp32 sums, so the
  decode kernels read bf16 weights as they are, and oneDNN's native bf16 GEMM takes batches;
- `amx`: AMX-BF16 tiles. The decode kernels are the `avx512` ones: a decode step's few rows are
  bound by streaming the weights, which tiles do not speed up; the GEMMs of batches (prefill)
  go through oneDNN, which uses the tiles itself.

`PDSERVE_ISA=generic|avx2|avx512|amx` forces a level at or below the host's (read once, when a
level is first asked for), so that a lower path is exercised on a higher host; a level above
the host's is refused, since its code would stop on an illegal instruction.
"""

from __future__ import annotations

import enum
import os
import platform
from functools import cache
from pathlib import Path


class Isa(enum.IntEnum):
    GENERIC = 0
    AVX2 = 1
    AVX512 = 2
    AMX = 3

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bf16 itself (else torch and pdserve emulate it)."""
        return self >= Isa.AVX512

    @property
    def kernel_level(self) -> Isa:
        """The level of the kernel build this level loads (amx loads avx512's, see above)."""
        return min(self, Isa.AVX512)


# The CPU flags (as Linux's /proc/cpuinfo names them) each level needs, on top of the level below.
REQUIRED = {
    Isa.AVX2: {"avx2", "fma", "f16c"},
    Isa.AVX512: {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    Isa.AMX: {"amx_tile", "amx_bf16"},
}


def level_of(flags: set[str]) -> Isa:
    """The highest level whose flags (and every lower level's) are all in `flags`."""
    level = Isa.GENERIC
    for candidate in (Isa.AVX2, Isa.AVX512, Isa.AMX):
        if not REQUIRED[candidate] <= flags:
            break
        level = candidate
    return level


def _cpuinfo_field(name: str) -> str | None:
    """The first processor's `name` field in /proc/cpuinfo, if Linux reports one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them; empty where it does not (the generic
    level then)."""
    return set((_cpuinfo_field("flags") or "").split())


@cache
def host_isa() -> Isa:
    """The highest level this CPU executes."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return Isa.GENERIC
    return level_of(cpu_flags())


def parse(name: str) -> Isa:
    try:
        return Isa[name.strip().upper()]
    except KeyError:
        choices = "|".join(level.name.lower() for level in Isa)
        raise ValueError(f"PDSERVE_ISA={name!r}: expected one of {choices}") from None


@cache
def chosen_isa() -> Isa:
    """The level pdserve runs at: the host's, or the lower one PDSERVE_ISA forces."""
    host = host_isa()
    forced = os.environ.get("PDSERVE_ISA", "").strip()
    if not forced:
        return host
    level = parse(forced)
    if level > host:
        raise ValueError(
            f"PDSERVE_ISA={forced}: this CPU executes {host.name.lower()} at most "
            f"(flags missing: {' '.join(sorted(missing(level)))})"
        )
    return level


def missing(level: Isa) -> set[str]:
    """The CPU flags `level` needs that this host lacks."""
    flags = cpu_flags()
    need = set().union(*(REQUIRED[lv] for lv in REQUIRED if lv <= level))
    return need - flags


def executable_levels() -> list[Isa]:
    """Every kernel level this host can run, lowest first (what the tests exercise)."""
    return [level for level in Isa if level <= host_isa() and level == level.kernel_level]


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (what benchmarks name beside their figures)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def host_description() -> dict[str, object]:
    """What a benchmark's JSON records of the host it ran on."""
    import torch

    from pdserve import __version__

    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    return {
        "cpu": cpu_model(),
        # A virtual machine may name only the vendor ("AMD EPYC"): family and model tell Zen 4
        # (25, 17) from Zen 5 (26, 2), which differ twofold in bf16 throughput.
        "cpu_family": _cpuinfo_field("cpu family"),
        "cpu_model_number": _cpuinfo_field("model"),
        "cpu_stepping": _cpuinfo_field("stepping"),
        "cores": os.cpu_count(),
        "simd_flags": simd,
        "isa_host": host_isa().name.lower(),
        "isa_chosen": chosen_isa().name.lower(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pdserve": __version__,
    }
