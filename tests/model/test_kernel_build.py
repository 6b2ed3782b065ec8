"""Building and loading the compiled kernels: one private build folder per instruction-set
level; a level this CPU cannot execute still compiles; and loading survives a builder that was
killed: torch's lock file, left in the build folder, is removed by the next process that takes
the build folder's flock, instead of making every later start of pdserve wait for it without
end."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pdserve.model import fused
from pdserve.model.isa import Isa, host_isa


def test_a_lock_left_by_a_killed_builder_does_not_stop_the_next_load() -> None:
    assert fused.compiled() is not None  # built (or loaded) here first, as `make install` does
    directory = fused.build_directory()
    with open(directory / "pdserve.lock", "a") as turn:
        fused.take_turn(turn, 300)  # as a builder would, so no other process is building
        (directory / "lock").touch()  # what torch leaves behind when its builder is killed
    load = subprocess.run(
        [sys.executable, "-m", "pdserve.model.fused"], capture_output=True, text=True, timeout=300
    )
    assert "): ready" in load.stdout, load.stderr
    assert not (directory / "lock").exists()


def test_loading_the_kernels_removes_an_unused_build_they_supersede() -> None:
    """What an upgrade leaves: this copy's build of older sources, unused for longer than the
    limit, goes at the next start (a process of its own, as a node starts)."""
    assert fused.compiled() is not None
    directory = fused.build_directory()
    old = directory.with_name(directory.name.rsplit("-", 1)[0] + "-0ld50urce5aa")
    try:
        old.mkdir()
        (old / "build.ninja").write_text((directory / "build.ninja").read_text())
        (old / "pdserve.lock").touch()
        used = time.time() - 2 * fused.UNUSED_S
        os.utime(old / "pdserve.lock", (used, used))
        load = subprocess.run(
            [sys.executable, "-m", "pdserve.model.fused"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "): ready" in load.stdout, load.stderr
        assert not old.exists(), load.stderr
        assert time.time() - (directory / "pdserve.lock").stat().st_mtime < 300  # marked in use
    finally:
        shutil.rmtree(old, ignore_errors=True)


def test_the_build_folder_is_this_users_alone() -> None:
    assert fused.compiled() is not None
    directory = fused.build_directory()
    info = directory.stat()
    assert info.st_uid == os.getuid()
    assert not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    directory.chmod(0o777)  # as another user's umask or a careless copy might leave it
    fused.private_directory(directory)
    assert not directory.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_each_level_builds_into_its_own_folder_with_its_own_flags() -> None:
    """No build of one level is loaded for another (a cache shared between machines)."""
    folders = {fused.build_directory(level) for level in (Isa.GENERIC, Isa.AVX2, Isa.AVX512)}
    assert len(folders) == 3
    assert fused.build_directory(Isa.AMX) == fused.build_directory(Isa.AVX512)
    assert "-march=native" not in fused.FLAGS
    assert "-mavx512bf16" in fused.LEVEL_FLAGS[Isa.AVX512]
    assert not any("avx512" in flag for flag in fused.LEVEL_FLAGS[Isa.AVX2])


@pytest.mark.parametrize("level", [Isa.AVX2, Isa.AVX512])
def test_a_level_above_this_cpu_still_compiles(level: Isa, tmp_path: Path) -> None:
    """The instruction-set specific kernel compiles where this CPU cannot run it (it is
    exercised on the next host that can)."""
    if level <= host_isa():
        pytest.skip(f"this CPU executes {level.name.lower()}: its build is loaded and tested")
    # every source with code of its own for a level (two compilers at a time)
    sources = [s for s in fused.CSRC.glob("*.cpp") if "PDSERVE_AVX" in s.read_text()]
    assert {"bf16_linear.cpp", "prefill_attention.cpp"} <= {s.name for s in sources}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: fused.compile_check(level, s, tmp_path / f"{s.stem}.o"), sources))
    assert all((tmp_path / f"{s.stem}.o").stat().st_size > 0 for s in sources)


def test_the_build_folder_is_keyed_by_source_and_toolchain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another compiler, or changed sources, build elsewhere: a build is never reused across
    them (nor across levels, users, torch or Python: the tests above and the key)."""
    here = fused.build_directory(Isa.GENERIC)
    monkeypatch.setattr(fused, "_toolchain", lambda: "g++ (other) 99.1")
    assert fused.build_directory(Isa.GENERIC) != here
    monkeypatch.undo()
    monkeypatch.setattr(fused, "_sources_digest", lambda: b"other sources")
    assert fused.build_directory(Isa.GENERIC) != here
    monkeypatch.undo()
    assert fused.build_directory(Isa.GENERIC) == here


def test_a_load_removes_the_unused_builds_it_supersedes_and_no_others(tmp_path: Path) -> None:
    """This copy's earlier builds of the level unused for the limit go (real build files,
    copied: what a build of older sources left), and any level's built from a checkout or
    environment that is gone; one used within the limit, another present checkout's or
    environment's, another level's, one being built (its flock held) and a folder without a
    build file stay."""
    assert fused.compiled() is not None
    ninja = (fused.build_directory() / "build.ninja").read_text()
    level = fused.module_name(fused.chosen_isa())
    other_level = fused.module_name(Isa.AVX2 if fused.chosen_isa() != Isa.AVX2 else Isa.GENERIC)

    def build(name: str, text: str | None = ninja, used_s_ago: float = 2 * fused.UNUSED_S) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if text is not None:
            (folder / "build.ninja").write_text(text)
            (folder / f"{level}.so").write_bytes(b"\0" * 1024)
            (folder / "pdserve.lock").touch()
            used = time.time() - used_s_ago
            os.utime(folder / "pdserve.lock", (used, used))
        return folder

    current = build(f"{level}-000000000000")
    checkout, torch_dir = str(fused.CSRC.resolve()), str(Path(torch.__file__).parent)
    assert checkout in ninja and torch_dir in ninja
    elsewhere = tmp_path / "elsewhere" / "csrc"  # another checkout, present
    other_env = tmp_path / "other-env" / "torch"  # another environment's torch, present
    (other_env / "include").mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    superseded = [
        build(f"{level}-111111111111"),
        build(f"{level}-222222222222", ninja.replace("-O3", "-O2")),  # other flags
        build(f"{other_level}-888888888888", ninja.replace(checkout, str(tmp_path / "gone"))),
        build(
            f"{level}-999999999999", ninja.replace(torch_dir, str(tmp_path / "gone-env" / "torch"))
        ),
    ]
    kept = [
        build(f"{level}-333333333333", ninja.replace(checkout, str(elsewhere))),
        build(f"{level}-444444444444", ninja.replace(torch_dir, str(other_env))),
        build(f"{other_level}-555555555555"),
        build(f"{level}-666666666666", None),
        build(f"{level}-aaaaaaaaaaaa", used_s_ago=fused.UNUSED_S - 3600),
        build(f"{other_level}-bbbbbbbbbbbb", ninja.replace(checkout, "/gone"), fused.UNUSED_S / 2),
    ]
    busy = build(f"{level}-777777777777")
    with open(busy / "pdserve.lock", "a") as turn:
        fused.take_turn(turn, 10)  # a builder at work there
        removed = fused.prune_superseded(current)
    assert sorted(removed) == sorted(superseded)
    assert not any(folder.exists() for folder in superseded)
    assert all(folder.exists() for folder in [current, busy, *kept])
