"""``push_to_hub``: upload an exported folder (merged weights, or a GGUF with its Modelfile) to the Hugging Face Hub.

Contract: ``push_to_hub(path, repo_id, token=None, private=True) -> str`` (the repo's URL). ``path`` is a folder
(uploaded whole) or one file. The repo is created if missing (private by default). Offline -- ``HF_HUB_OFFLINE``
set, or the Hub unreachable -- raises ``HubOfflineError`` before anything is sent, naming what to do; everything
up to the upload (the export, its checks) has already run and its files stay where they are.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}


class HubOfflineError(ConnectionError):
    """The Hub cannot be reached (offline mode or no network); nothing was uploaded."""


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout: float = 3.0) -> str | None:
    """None when the Hub can be reached, else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as error:
        return f"{url.hostname} is not reachable ({type(error).__name__}: {error})"
    return None


def push_to_hub(path: str | Path, repo_id: str, token: str | None = None, private: bool = True) -> str:
    """Upload ``path`` (a folder or a file) to the model repo ``repo_id``; returns the repo URL."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"nothing to upload: {path} does not exist")
    why = hub_reachable()
    if why:
        raise HubOfflineError(
            f"cannot upload {path} to {repo_id}: {why}. The exported files are complete in {path}; upload them "
            f"later from a machine that is online, logged in (`hf auth login` or HF_TOKEN) and without "
            f"HF_HUB_OFFLINE set: nbkit.export.push_to_hub, or `hf upload --private {repo_id} {path}`."
        )
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if path.is_dir():
        api.upload_folder(folder_path=str(path), repo_id=repo_id, repo_type="model")
    else:
        api.upload_file(path_or_fileobj=str(path), path_in_repo=path.name, repo_id=repo_id, repo_type="model")
    return f"{_endpoint().rstrip('/')}/{repo_id}"
