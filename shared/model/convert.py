"""Convert a model source into a safetensors directory in Tandem's cache, once.

GGUF files are dequantised by transformers (10-15 s for the default model); the result is
written as a plain Hugging Face directory keyed by the file's content hash, so later starts
load it in under a second. Writes go to a temporary directory that is renamed into place, so
a crash mid-conversion never leaves a half-written cache entry behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import xxhash
from tqdm import tqdm

from shared.errors import ModelLoadError
from shared.model.source import ModelSource, SourceKind

_HASH_CHUNK = 8 << 20


def cache_root() -> Path:
    """`TANDEM_CACHE` or `~/.cache/tandem`."""
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem").expanduser()


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def converted_dir(source: ModelSource) -> Path:
    """The directory holding a loadable safetensors copy of `source` (converting if needed)."""
    if source.kind is SourceKind.HF_DIR:
        return source.path
    target = cache_root() / "models" / f"{source.path.stem}-{_file_digest(source.path)}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    _convert_gguf(source.path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    # Imported here: transformers costs ~2 s to import and most callers hit the cache.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    steps = ["read tokenizer", "dequantise weights", "write safetensors"]
    bar = tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step")
    try:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str(steps[2])
        # The weights are already dequantised; save_pretrained refuses while these remain.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update()
    except ModelLoadError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:  # any parse failure of a foreign file is a model error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot convert {gguf_path}: {type(exc).__name__}: {exc}") from exc
    finally:
        bar.close()
    if target.exists():  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
