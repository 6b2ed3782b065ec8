"""The compiled CPU kernels (`csrc/`): one build per instruction-set level (isa.py), each built
once by torch's C++ extension builder (g++ and ninja) with that level's flags, never
`-march=native`: a build runs on every CPU of its level, so a cache shared between machines (a
home directory on NFS) never hands one CPU another's instructions, and the level is chosen from
what the CPU reports when the kernels are loaded. Builds live in torch's extension cache
(`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), one folder per level, installed
copy of pdserve, torch, Python, compiler version and source content, readable and writable by
this user only (a folder another user could write is refused: its code would run as ours).
Where they cannot be built, pdserve says so once and runs the plain torch path: same results
within rounding, slower.

Builders take turns through an flock on the build folder, which the kernel lets go when a
builder dies. torch's own lock file does not go away when its builder is killed, and torch
waits on it without end; whoever holds the flock removes one left behind.

Each load marks its build as used (its lock file's time) and removes the builds it supersedes
that no one has used for a week: those of the same level whose build file names the same
sources' folder and the same torch (this copy of pdserve before its sources, flags, compiler or
torch changed), and those whose sources or torch are gone from this machine (a deleted checkout
or environment), each under its flock, so none that another process is building. The week
spares a home directory shared by machines whose compilers differ, or that mount other
checkouts: each machine's build stays while it is in use. Builds of checkouts or environments
present here are theirs and stay. Without this every upgrade left ~5 MB a level behind for good
(414 MB over a development host's 90 builds).

`python -m pdserve.model.fused` builds this host's level ahead of time (`make install` does);
`--all` builds every level this CPU executes (`compile_check` compiles the others).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from pdserve.model.isa import Isa, chosen_isa, executable_levels, host_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "module.cpp",
        "paged_attention.cpp",
        "bf16_linear.cpp",
        "f32_linear.cpp",
        "quant_linear.cpp",
        "decode_layers.cpp",
        "layer_ops.cpp",
        "prefill_attention.cpp",
        "amx_attention.cpp",
    )
]
# -fopenmp: at::parallel_for is inlined from ATen's headers and runs serially without it (the
# kernels ran on one thread before it was set; the decode attention then took 2x as long).
# -ffp-contract=off: GCC would otherwise fuse a * b + c into one rounding wherever it sees fit,
# differently in two inlined copies of the same expression (a query row folded alone or four at
# a time came out different in float32): every sum is then rounded as written, and the kernels'
# own FMAs are the intrinsics they name.
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
LEVEL_FLAGS = {
    Isa.GENERIC: [],
    Isa.AVX2: _AVX2,
    Isa.AVX512: [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"],
}

# (q [D, heads, dim], cache [N, 2, kv_heads, block, dim], block tables [D, max_blocks] int32,
#  context lengths [D] int32, scale, sliding window or 0) -> [D, heads, dim]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], Any]
# (q [Q, heads, dim], cache, block table [blocks] int32, context length, scale, window or 0)
#  -> [Q, heads, dim]
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int], Any]
# (q [T, heads, dim] at positions [P, P + T), k, v [P + T, kv_heads, dim], scale, P, into) ->
#  [T, heads, dim]: causal, the keys contiguous (a fresh prompt: P = 0); written into `into`
#  where one is given (q's shape and dtype, contiguous), else into a new tensor
FreshKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int, torch.Tensor | None], torch.Tensor
]
# (cache, k [T, kv_heads, dim], v, slot_blocks [T], slot_offsets [T]) -> None: K/V into the cache
KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (x [M, K], w [N, K], bias [N] or None, all bf16 or all float32) -> [M, N]
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_modules: dict[Isa, Any] = {}  # absent: not tried yet; None: cannot be built
NAME = "pdserve_cpu_kernels"
BUILD_WAIT_S = 900.0  # another process building (about a minute on 2 cores) is waited for this long
UNUSED_S = 7 * 86400.0  # a superseded or orphaned build unused this long is removed


def compiled(level: Isa | None = None) -> Any:
    """The compiled module of `level`'s kernels (default: the level chosen for this host), built
    if needed; None if it cannot be (logged once)."""
    level = (chosen_isa() if level is None else level).kernel_level
    if level not in _modules:
        _modules[level] = _build(level)
    return _modules[level]


def paged_decode_kernel(level: Isa | None = None, exact: bool = False) -> DecodeKernel | None:
    """The fused decode attention; None where the kernels cannot be built. `exact`
    (--deterministic): through the prefix runs' tile, so a position's attention is the same bits
    decoded or recomputed in a run of queries (a preempted request, the canary); otherwise two
    passes over each sequence's keys and values, 2.5-3x faster at a few sequences."""
    module = compiled(level)
    if module is None:
        return None
    if exact:
        return module.paged_decode_attention_exact  # type: ignore[no-any-return]  # the compiled module is untyped
    return module.paged_decode_attention  # type: ignore[no-any-return]  # the compiled module is untyped


def paged_prefill_kernel(level: Isa | None = None) -> PrefillKernel | None:
    """Attention for a run of queries over a cached prefix, straight from the paged cache;
    None where the kernels cannot be built."""
    module = compiled(level)
    return None if module is None else module.paged_prefill_attention  # type: ignore[no-any-return]  # the compiled module is untyped


def kv_writer(level: Isa | None = None) -> KVWriter | None:
    """A step's keys and values into their cache slots, a row copy per token and head
    (csrc/paged_attention.cpp write_kv_); None where the kernels cannot be built."""
    module = compiled(level)
    return None if module is None else module.write_kv_  # type: ignore[no-any-return]  # the compiled module is untyped


def fresh_prefill_kernel(level: Isa | None = None) -> FreshKernel | None:
    """Causal attention of a run whose keys and values are at hand as rows, every position before
    it too (a fresh prompt; a long run over a cached prefix, gathered) (csrc/prefill_attention.cpp),
    picked by q's dtype: on avx512 bf16 through vdpbf16ps and float32 through FMA, on avx2 both
    in float32 FMA, on amx bf16 through the tiles (csrc/amx_attention.cpp; vdpbf16ps where Linux
    gives the process no tile state); None where the level's build is generic (torch's SDPA
    runs there)."""
    level = chosen_isa() if level is None else level
    module = compiled(level)
    if module is None or not module.panels():
        return None
    kernels = {
        # On AMX the tiles: a 542-token SmolLM2 prompt 0.37 ms per layer where vdpbf16ps took
        # 2.14 and torch's SDPA (oneDNN's tiles for its matmuls) 1.04; 2,048 tokens 5.1 vs 26.9
        # vs 9.7; 584 queries over 600 positions 0.51 vs 2.71 vs 1.87 (2-core Xeon with
        # AMX-BF16, medians of 9 alternating). vdpbf16ps runs no faster there than float32 FMAs.
        torch.bfloat16: (
            module.prefill_attention_amx
            if level == Isa.AMX and module.amx_ready()
            else module.prefill_attention_bf16
        ),
        torch.float32: module.prefill_attention_f32,
    }

    def fresh(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        offset: int = 0,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return kernels[q.dtype](q, k, v, scale, offset, into)  # type: ignore[no-any-return]  # the compiled module is untyped

    return fresh


def bf16_linear_kernel(level: Isa | None = None) -> LinearKernel | None:
    """x W^T + b for a few rows of bf16, each weight row read once (csrc/bf16_linear.cpp);
    None where the kernels cannot be built."""
    module = compiled(level)
    return None if module is None else module.bf16_linear  # type: ignore[no-any-return]  # the compiled module is untyped


def bf16_blocked_kernel(level: Isa | None = None) -> LinearKernel | None:
    """x W^T + b with W in panels (model/linear.py block_weight): every output one float32
    chain, at the bf16 GEMM peak (csrc/bf16_linear.cpp; on AVX2, bf16 widened to fp32 at the
    fp32 FMA peak); None where the level's build has no panels (generic)."""
    module = compiled(level)
    if module is None or not module.panels():
        return None
    return module.bf16_blocked_linear  # type: ignore[no-any-return]  # the compiled module is untyped


def amx_linear_kernel(level: Isa | None = None) -> LinearKernel | None:
    """x W^T + b with W in AMX tiles (model/linear.py amx_tiles), each row's bits the same in any
    batch (csrc/amx_attention.cpp amx_linear); None unless the level is amx and Linux gives this
    process the tile state."""
    level = chosen_isa() if level is None else level
    module = compiled(level) if level == Isa.AMX else None
    if module is None or not module.amx_ready():
        return None
    return module.amx_linear  # type: ignore[no-any-return]  # the compiled module is untyped


def f32_blocked_kernel(level: Isa | None = None) -> LinearKernel | None:
    """x W^T + b with a float32 W in panels (model/linear.py block_weight): every output one FMA
    chain, at the fp32 GEMM peak (csrc/f32_linear.cpp); None where the level's build has no
    panels (generic)."""
    module = compiled(level)
    if module is None or not module.panels():
        return None
    return module.f32_blocked_linear  # type: ignore[no-any-return]  # the compiled module is untyped


def f32_linear_kernel(level: Isa | None = None) -> LinearKernel | None:
    """x W^T + b for a few rows of float32, each weight row read once and each row's sums in an
    order that does not depend on the batch (csrc/f32_linear.cpp); None where the kernels cannot
    be built."""
    module = compiled(level)
    return None if module is None else module.f32_linear  # type: ignore[no-any-return]  # the compiled module is untyped


def module_name(level: Isa) -> str:
    return f"{NAME}_{level.kernel_level.name.lower()}"


def build_directory(level: Isa | None = None) -> Path:
    """Where this copy of pdserve builds `level`'s kernels: two checkouts sharing the cache
    would otherwise rebuild over each other (their build files name different source paths)."""
    from torch.utils import cpp_extension

    level = (chosen_isa() if level is None else level).kernel_level
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    flags = " ".join(FLAGS + LEVEL_FLAGS[level])
    copy = f"{CSRC.resolve()}|{torch.__version__}|{sys.version_info[:2]}|{flags}|{_toolchain()}"
    key = hashlib.sha256(copy.encode() + _sources_digest()).hexdigest()[:12]
    return Path(root) / f"{module_name(level)}-{key}"


@functools.cache
def _toolchain() -> str:
    """The compiler's own version line: a build by another compiler is another build."""
    try:
        out = subprocess.run(
            [os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none"


@functools.cache
def _sources_digest() -> bytes:
    """The kernels' sources, as they are: a changed source is another build."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.digest()


def private_directory(directory: Path) -> None:
    """Create `directory` readable and writable by this user only, or refuse one that another
    user owns or may write (a build there would run their code in our process)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to user {info.st_uid}, not this user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        directory.chmod(info.st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def take_turn(turn: IO[str], wait_s: float) -> None:
    """Hold the build folder's flock (`turn`: its `pdserve.lock`, open), waiting at most
    `wait_s` for another process to let it go."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process held {turn.name} for {wait_s:.0f} s") from None
            time.sleep(0.2)


def _build(level: Isa) -> Any:
    from torch.utils import cpp_extension

    try:
        if level > host_isa():
            raise RuntimeError(f"this CPU does not execute {level.name.lower()} code")
        directory = build_directory(level)
        private_directory(directory)
        with open(directory / "pdserve.lock", "a") as turn:
            take_turn(turn, BUILD_WAIT_S)
            # No one else builds here while the flock is held: torch's lock is a dead builder's.
            (directory / "lock").unlink(missing_ok=True)
            if not (directory / f"{module_name(level)}.so").exists():
                logger.warning(
                    "building the CPU kernels for %s in %s (once per copy of pdserve and level: "
                    "about a minute on 2 idle cores, several on busy ones)",
                    level.name.lower(), directory,
                )  # fmt: skip
            module = cpp_extension.load(
                name=module_name(level),
                sources=[str(s) for s in SOURCES],
                extra_cflags=FLAGS + LEVEL_FLAGS[level],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
            os.utime(directory / "pdserve.lock")  # in use
        try:
            removed = prune_superseded(directory)
            if removed:
                logger.info("removed %d unused kernel builds: %s", len(removed), removed)
        except OSError as e:  # the kernels are loaded: a cache that cannot be tidied is no fault
            logger.info("kernel builds beside %s not tidied (%s)", directory, e)
        return module
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the torch path runs
        logger.warning(
            "compiled CPU kernels (%s) unavailable (%s); using the torch paths",
            level.name.lower(), e,
        )  # fmt: skip
        return None


def _last_use(directory: Path) -> float:
    """When a process last loaded the build in `directory` (its lock file's time), or its build
    file's time where it has no lock file."""
    for name in ("pdserve.lock", "build.ninja"):
        try:
            return (directory / name).stat().st_mtime
        except OSError:
            continue
    return time.time()


def _build_identity(directory: Path) -> tuple[frozenset[str], frozenset[str]] | None:
    """What a build in `directory` was built from, read from its ninja file: the folders of the
    sources it compiled and of the torch headers it included (one per checkout and environment);
    None where there is no readable build file."""
    try:
        text = (directory / "build.ninja").read_text()
    except OSError:
        return None
    sources = frozenset(
        str(Path(line.split()[-1]).parent)
        for line in text.splitlines()
        if line.startswith("build ") and " compile " in line
    )
    torch_headers = frozenset(word for word in text.split() if word.endswith("/torch/include"))
    return (sources, torch_headers) if sources else None


def prune_superseded(directory: Path, unused_s: float = UNUSED_S) -> list[Path]:
    """Remove the builds that `directory`'s build supersedes and that no one has loaded for
    `unused_s` (their lock file's time): the same level (the folder's name up to its key) from
    the same sources' folder and torch, and any level's whose sources or torch are gone from this
    machine (a deleted checkout or environment); each only while no one holds its flock (a
    process building there), never one of a checkout or environment present here. A process that
    loaded one keeps its mapping. Returns the folders removed."""
    identity = _build_identity(directory)
    level_prefix = directory.name.rsplit("-", 1)[0] + "-"
    removed: list[Path] = []
    if identity is None:
        return removed
    for other in sorted(directory.parent.glob(NAME + "_*-*")):
        if other == directory or other.is_symlink() or not other.is_dir():
            continue
        built_from = _build_identity(other)
        if built_from is None or other.stat().st_uid != os.getuid():  # not a build of ours
            continue
        superseded = other.name.startswith(level_prefix) and built_from == identity
        orphaned = not all(Path(folder).is_dir() for folder in built_from[0] | built_from[1])
        if not (superseded or orphaned) or _last_use(other) > time.time() - unused_s:
            continue
        try:
            with open(other / "pdserve.lock", "a") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(other)
            removed.append(other)
        except OSError as e:  # held (BlockingIOError), or not ours to remove
            logger.info("left the kernel build %s (%s)", other, e)
    return removed


def compile_check(level: Isa, source: Path, out: Path) -> None:
    """Compile one source at `level` into an object file, without linking or loading it: the
    kernels of a level this CPU cannot execute still meet their compiler here. Raises
    subprocess.CalledProcessError with the compiler's message."""
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        os.environ.get("CXX", "c++"), "-std=c++17", "-fPIC", "-c", str(source), "-o", str(out),
        *(f"-I{path}" for path in includes), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={module_name(level)}",
        *FLAGS, *LEVEL_FLAGS[level.kernel_level],
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    levels = executable_levels() if "--all" in sys.argv else [chosen_isa()]
    for level in levels:
        state = "ready" if compiled(level) is not None else "unavailable"
        print(f"compiled CPU kernels ({level.kernel_level.name.lower()}): {state}")
    sys.exit(0)
