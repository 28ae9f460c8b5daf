"""Finding and loading a model: a local folder, a Hugging Face Hub id (downloaded into the
Hugging Face cache when missing, see :mod:`engine.models.hub`), or the embedded tiny
default."""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.models import attention, hub
from engine.models.cpu_linear import pack_linears
from engine.models.patch_embed import convolutions_as_products
from engine.models.registry import DEFAULT_ARCH, ArchSpec, arch_for_config, get_arch
from engine.paths import cache_root

TINY_VERSION = 1  # bump when the tiny builders change, so caches rebuild


def tiny_model_dir(arch: str = DEFAULT_ARCH, seed: int = 0, size: str = "tiny") -> Path:
    """The cached tiny model of ``arch`` (or a larger ``size``, :data:`engine.models.sizes.
    SIZES`, as ``aphrodite model make-tiny --size`` builds it), built on first use (safe
    across processes)."""
    from engine.models.sizes import get_size
    from engine.models.tiny import build_tiny

    spec = get_arch(arch)
    sized = get_size(size, spec.name, None) is not None  # (refuses a size it cannot build)
    root = cache_root() / "models"
    target = root / f"{size}-{spec.name}-v{TINY_VERSION}-seed{seed}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
            try:
                if sized:
                    build_tiny(spec.name, tmp, seed, size=size)
                else:
                    spec.build_tiny(tmp, seed)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: str | None, *, revision: str | None = None,
                       download_dir: str | None = None, weights: bool = True) -> Path:
    """A folder holding ``config.json`` for ``model`` (None: the default tiny Qwen2.5-VL;
    ``tiny:ARCH``: that family's tiny model; a folder; or a Hugging Face Hub id, downloaded
    at ``revision`` into the cache or ``download_dir`` when missing; ``weights=False``: no
    weight files)."""
    if not model:
        return tiny_model_dir()
    if model.startswith("tiny:"):
        return tiny_model_dir(model.split(":", 1)[1])
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} has no config.json, so it is not a model folder",
                              hint="point at a folder saved with save_pretrained",
                              code="model_not_found")
        return path.resolve()
    if hub.is_hub_id(model):
        folder = hub.download(model, revision=revision, download_dir=download_dir,
                              weights=weights)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model {model!r} has no config.json on the Hub, so it is not a "
                              "transformers model", code="model_not_found")
        return folder
    raise ConfigError(f"model {model!r} was not found", hint="pass a model folder, a Hugging "
                      "Face Hub id like org/name, or tiny:ARCH", code="model_not_found")


@dataclass
class LoadedModel:
    """A model folder's family, config, processor, tokenizer and (on demand) weights."""

    path: Path
    spec: ArchSpec
    config: dict[str, Any]
    processor: Any
    chat_template: str | None
    name: str
    #: the hub repo id and the revision asked for (None for a local folder or tiny:ARCH)
    repo: str | None = None
    revision: str | None = None
    _model: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the model came from, for results people publish: the hub repo, the revision
        asked for and the commit its snapshot folder is (Hugging Face's cache names snapshot
        folders by commit), the processor classes that ran."""
        commit = self.path.name if self.path.parent.name == "snapshots" else None
        parts = {name: type(part).__name__ for name in (
            "image_processor", "video_processor", "feature_extractor")
            if (part := getattr(self.processor, name, None)) is not None}
        return {"model": self.name, "architecture": self.spec.name, "repo": self.repo,
                "revision": self.revision, "commit": commit, "path": str(self.path),
                "processor": type(self.processor).__name__, **parts}

    def model(self, device: str = "cpu", dtype: str = "auto",
              quantization: str | None = None) -> Any:
        """The weights, loaded once (``quantization``: ``EngineConfig.quantization``)."""
        with self._lock:
            if self._model is None:
                import torch
                import transformers

                cls = getattr(transformers, self.spec.model_class)
                torch_dtype = ("auto" if dtype == "auto" else getattr(torch, dtype))
                model = cls.from_pretrained(self.path, dtype=torch_dtype).to(device).eval()
                if quantization == "int8":
                    from engine.models.int8_linear import quantize_model

                    quantize_model(model)
                convolutions_as_products(model)
                pack_linears(model)
                attention.use(model)
                self._model = model
            return self._model


def load_model(model: str | None = None, *, chat_template: str | None = None,
               served_name: str | None = None, revision: str | None = None,
               download_dir: str | None = None, weights: bool = True) -> LoadedModel:
    """Resolve (downloading a hub id when missing; ``weights=False``: without its weight
    files), identify the family and load the processor (weights load on first use)."""
    path = resolve_model_path(model, revision=revision, download_dir=download_dir,
                              weights=weights)
    config = json.loads((path / "config.json").read_text())
    spec = arch_for_config(config, str(path))
    import transformers

    processor = getattr(transformers, spec.processor_class).from_pretrained(path)
    template = getattr(processor, "chat_template", None)
    if chat_template:
        file = Path(chat_template).expanduser()
        if not file.is_file():
            raise ConfigError(f"--chat-template {chat_template} is not a file",
                              hint="pass the path of a Jinja chat template file",
                              code="chat_template_missing")
        template = file.read_text()
    name = served_name or model or f"tiny-{spec.name}"
    repo = model if model and hub.is_hub_id(model) and not Path(model).exists() else None
    return LoadedModel(path, spec, config, processor, template, name, repo=repo,
                       revision=revision if repo else None)
