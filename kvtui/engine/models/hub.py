"""Is a model name a path or a hub id, and where is a hub id in the local Hugging Face cache (never downloads)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_like_path(name: str) -> bool:
    if name.startswith((".", "~", "/")) or os.path.isabs(name):
        return True
    if os.sep != "/" and os.sep in name:  # e.g. a Windows path
        return True
    # 'org/model' is a hub id; 'a/b/c' or 'dir/' is a path.
    return not _HUB_ID_RE.match(name)


def hub_snapshot_dir(repo_id: str) -> Path | None:
    """The local HF-cache snapshot dir of ``repo_id``, or None (never downloads)."""
    from transformers.utils import hub as hf_hub

    try:
        config_file = hf_hub.cached_file(
            repo_id,
            "config.json",
            local_files_only=True,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except Exception:  # noqa: BLE001  a config the hub cache cannot give (offline, missing): not a hub model
        return None
    if not config_file:
        return None
    return Path(config_file).parent
