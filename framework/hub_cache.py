"""Hugging Face Hub ids (``org/name``) read from the local Hugging Face cache, where users of
vLLM (and ``hf download``) keep their models and adapters. Only the cache is read: Sparrow never
downloads anything."""

from __future__ import annotations

from pathlib import Path


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


def local_or_cached(path: str) -> Path:
    """``path`` as a local path (``~`` expanded), or, when nothing is there and it is a Hub id in
    the Hugging Face cache, its snapshot of the main revision (a LoRA adapter's ``lora_path``)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    snapshot = hub_cache_snapshot(path)
    return Path(snapshot) if snapshot is not None else local
