"""Hugging Face Hub ids (``org/name``) read from the local Hugging Face cache, where users of
vLLM (and ``hf download``) keep their models and adapters. Only the cache is read: Sparrow never
downloads anything."""

from __future__ import annotations

import logging
from pathlib import Path

from sparrow.config import ConfigError

logger = logging.getLogger(__name__)


def looks_like_hub_id(name: str) -> bool:
    """``org/name``, as a Hugging Face Hub repository id is written (not a relative path)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def hub_cache_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """The directory of ``repo_id``'s snapshot at ``revision`` (a branch, tag or commit; None:
    main) already in the Hugging Face cache ``cache_dir`` (None: ``HF_HUB_CACHE``), or None. Only
    the cache is read: nothing is downloaded."""
    if not looks_like_hub_id(repo_id):
        return None
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: the caller reports the path
        return None


def local_or_cached(path: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """``path`` as a local path (``~`` expanded), or, when nothing is there and it is a Hub id in
    the Hugging Face cache ``cache_dir`` (None: ``HF_HUB_CACHE``), its snapshot at ``revision``
    (None: main): a LoRA adapter's ``lora_path``, and the model, tokenizer and draft model through
    ``resolve_hub_id``. The path as given when neither is there: the caller reports it."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    snapshot = hub_cache_snapshot(path, revision, cache_dir)
    return Path(snapshot) if snapshot is not None else local


def resolve_hub_id(name: str, revision: str | None = None, cache_dir: str | None = None,
                   revision_field: str = "revision") -> str:
    """``name``, or where the Hugging Face cache holds it when ``name`` is a Hub id and no local
    path (``local_or_cached``): its ``revision`` (None: main) in ``cache_dir`` (None:
    ``HF_HUB_CACHE``). These are the engine arguments ``revision`` (``revision_field``: or
    ``tokenizer_revision``) and ``download_dir``, refused (a ConfigError naming the argument) where
    they cannot apply: a revision with a local path, either for an id the cache does not hold."""
    local = Path(name).expanduser()
    if local.exists():
        if revision is not None:
            raise ConfigError(f"invalid engine argument {revision_field!r}: {name!r} is a local path; a revision "
                              "applies to a Hub id in the Hugging Face cache")
        return name
    found = local_or_cached(name, revision, cache_dir)
    if found != local:
        logger.info("%s: the Hugging Face cache's snapshot %s", name, found)
        return str(found)
    if looks_like_hub_id(name) and (revision is not None or cache_dir is not None):
        field = revision_field if revision is not None else "download_dir"
        where = f"the Hugging Face cache {cache_dir!r}" if cache_dir else "the Hugging Face cache"
        at = f" at revision {revision!r}" if revision is not None else ""
        flags = (f" --revision {revision}" if revision is not None else "") + (
            f" --cache-dir {cache_dir}" if cache_dir else "")
        raise ConfigError(f"invalid engine argument {field!r}: {name!r}{at} is not in {where}; download it first "
                          f"(`hf download {name}{flags}`); Sparrow never downloads models")
    return name
