"""Models from the Hugging Face Hub, fetched as transformers and vLLM fetch them.

A hub id (``org/name``) is downloaded with ``huggingface_hub`` into the normal Hugging Face
cache (or ``--download-dir``), honouring ``HF_TOKEN``, ``HF_HOME``, ``HF_HUB_CACHE``,
``HF_ENDPOINT`` and the user's own ``HF_HUB_OFFLINE=1`` (then only the cache is used: the
product never sets it). Only what a model needs is fetched: configs, tokenizer, processor and
chat-template files, and the weights as safetensors (``.bin`` only for a repo without any);
``weights=False`` fetches no weights at all (enough to benchmark a processor). Failures are
one :class:`ConfigError` naming the repo: not found, gated, unknown revision, offline and not
cached, the Hub unreachable.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError

#: Everything but the weights: configs (model, generation, processor, tokenizer), tokenizer
#: vocabularies (BPE merges, SentencePiece, tiktoken) and chat templates.
NON_WEIGHT_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
BIN_PATTERNS = ["*.bin"]


def is_hub_id(model: str) -> bool:
    """``org/name``: one slash, not a path (the caller has checked no such folder exists)."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(
        model.split("/"))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _patterns(repo_id: str, revision: str | None, weights: bool) -> list[str]:
    """The files to fetch: safetensors when the repo has any, else ``.bin``; offline, the
    safetensors rule (a cached repo without any still resolves: nothing else is checked)."""
    if not weights:
        return NON_WEIGHT_PATTERNS
    if _offline():
        return NON_WEIGHT_PATTERNS + SAFETENSORS_PATTERNS
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, revision=revision)
    except Exception:
        # Unreachable, rate-limited, down, gated, not found: snapshot_download asks again and
        # falls back to the cache where it can (a cached model still loads when the Hub
        # answers 429 or 5xx), else raises what the Hub said.
        return NON_WEIGHT_PATTERNS + SAFETENSORS_PATTERNS
    names = [s.rfilename for s in info.siblings or []]
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    return NON_WEIGHT_PATTERNS + (SAFETENSORS_PATTERNS if has_safetensors else BIN_PATTERNS)


def download(repo_id: str, *, revision: str | None = None, download_dir: str | None = None,
             weights: bool = True) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision``, downloaded when missing
    (with huggingface_hub's progress bars)."""
    from huggingface_hub import snapshot_download

    try:
        patterns = _patterns(repo_id, revision, weights)
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=patterns))
    except Exception as exc:  # every hub failure becomes one line naming the repo
        raise hub_error(exc, repo_id, revision) from exc


def hub_error(exc: Exception, repo_id: str, revision: str | None) -> ConfigError:
    """One line for a failed download: what went wrong with which repo, and what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _endpoint()
    if isinstance(exc, GatedRepoError):
        return ConfigError(f"model {repo_id!r} is gated on the Hugging Face Hub",
                           hint="accept its terms on its Hub page, then set HF_TOKEN to a token "
                                "of that account", code="model_gated")
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(f"model {repo_id!r} was not found on the Hugging Face Hub ({where})",
                           hint="check the name; a private repo also needs HF_TOKEN",
                           code="model_not_found")
    if isinstance(exc, RevisionNotFoundError):
        return ConfigError(f"revision {revision!r} of model {repo_id!r} was not found",
                           hint="pass a branch, tag or commit of the repo with --revision",
                           code="model_revision_not_found")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and _offline():
        return ConfigError(f"model {repo_id!r} is not in the Hugging Face cache and "
                           "HF_HUB_OFFLINE is set",
                           hint="unset HF_HUB_OFFLINE to download it, or pass a model folder",
                           code="model_not_found")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and \
            exc.response.status_code in (401, 403):
        return ConfigError(f"the Hugging Face Hub refused access to model {repo_id!r} "
                           f"({exc.response.status_code})",
                           hint="set HF_TOKEN to a token that can read it", code="model_gated")
    if isinstance(exc, (LocalEntryNotFoundError, OSError)):
        return ConfigError(f"model {repo_id!r} is not in the Hugging Face cache and the Hub "
                           f"({where}) could not be reached",
                           hint="check the network or HF_ENDPOINT; HF_HUB_OFFLINE=1 uses only "
                                "the cache", code="model_hub_unreachable")
    return ConfigError(f"model {repo_id!r} could not be downloaded ({type(exc).__name__})",
                       hint="run with APHRODITE_DEBUG=1 for the details",
                       code="model_download_failed")
