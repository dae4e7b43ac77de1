"""Checkpoints and saved folders that are either complete or absent, and the newest complete checkpoint.

Why: Colab disconnects and Kaggle sessions time out, including in the middle of a save. A kill at any moment must
leave a "latest checkpoint" that loads, so that ``train(resume_from_checkpoint=True)`` goes on from it.

Contract:

- ``atomic_directory(target)`` yields a staging folder beside ``target``; when the block ends without error the
  folder is fsynced and renamed into place (an existing folder is swapped out, or, when it holds sub-folders such
  as checkpoints, each file is replaced atomically). Staging folders are hidden (``.nbkit-staging-*``), so neither
  transformers' ``get_last_checkpoint`` nor its checkpoint rotation ever sees one. ``new_staging_dir`` and
  ``publish_directory`` are the two halves, for a writer (the trainer's checkpoint) that names its own folder.
- ``recover_interrupted`` cleans what a kill left behind; ``checkpoint_problem`` says why a folder is not a complete
  checkpoint; ``list_checkpoints`` and ``last_complete_checkpoint`` find the ``checkpoint-N`` folders and the newest
  whole one.

Staging only covers nbkit's own saves: a checkpoint written by another writer that was killed or ran out of disk, or
a file later cut short by a sync tool, still sits under its final name. So "complete" is also checked file by file,
from headers only (no tensor is read): a safetensors file must be exactly as long as its header's data offsets say,
and a ``torch.save`` file (optimizer, scheduler, scaler, RNG states, ``.bin`` weights) must end in its zip central
directory, which is written last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Iterator

STAGING_PREFIX = ".nbkit-staging-"
OLD_PREFIX = ".nbkit-old-"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' own pattern (trainer_utils._re_checkpoint)
_WEIGHT_FILES = (
    "adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json",
    "adapter_model.bin", "pytorch_model.bin", "pytorch_model.bin.index.json",
)  # fmt: skip
# what transformers' resume reads with torch.load besides the weights (optimizer.bin: accelerate's name)
_TORCH_STATE_FILES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state.pth")
_SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024  # the safetensors format's own limit on its JSON header


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # e.g. directories cannot be opened on Windows; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:  # some FUSE mounts (Drive) refuse fsync on directories; their rename is what it is
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file under ``root``, then the folders, so a rename publishes data that is on disk."""
    root = Path(root)
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder), directory=True)


def _token() -> str:
    return uuid.uuid4().hex[:10]


def new_staging_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh hidden folder in ``parent`` (same filesystem as its future name, so the rename is atomic)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f"{STAGING_PREFIX}{_token()}-{name}"
    staging.mkdir()
    return staging


def publish_directory(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename ``staging`` to ``target`` atomically; an existing ``target`` is swapped out, then deleted.

    A kill between the two renames of a swap leaves ``target`` absent and the old one whole in a hidden
    ``.nbkit-old-*`` folder, which ``recover_interrupted`` puts back.
    """
    staging, target = Path(staging), Path(target)
    fsync_tree(staging)
    old = None
    if target.exists():
        old = target.parent / f"{OLD_PREFIX}{_token()}-{target.name}"
        os.rename(target, old)
    os.rename(staging, target)
    _fsync_path(target.parent, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _replace_files(staging: Path, target: Path) -> None:
    """Move every entry of ``staging`` into the existing ``target``; each file lands whole (os.replace).

    Weights go first, so a kill in between pairs new weights with the previous config, never the reverse.
    """
    fsync_tree(staging)
    entries = sorted(staging.iterdir(), key=lambda p: (p.name not in _WEIGHT_FILES and not p.suffix == ".safetensors",
                                                       p.name))
    for entry in entries:
        destination = target / entry.name
        if entry.is_dir():
            if destination.exists():
                publish_directory(entry, destination)
            else:
                os.rename(entry, destination)
        else:
            os.replace(entry, destination)
    _fsync_path(target, directory=True)
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Write into the yielded folder; on success it becomes ``target`` in one step, on error it is removed.

    - ``target`` absent: the staging folder (beside it) is renamed to it;
    - ``target`` a folder of files only (an earlier save): swapped (``publish_directory``);
    - ``target`` holding sub-folders (e.g. ``output_dir`` with its checkpoints): staged inside it and each file
      replaced atomically, the sub-folders left alone.
    """
    target = Path(target)
    for folder in (target.parent, target):  # leftovers of an earlier, killed save to this target
        recover_interrupted(folder, only=target.name)
    merge = target.is_dir() and any(p.is_dir() and not p.name.startswith(".nbkit-") for p in target.iterdir())
    staging = new_staging_dir(target if merge else target.parent, target.name)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if merge:
        _replace_files(staging, target)
    else:
        publish_directory(staging, target)


def recover_interrupted(folder: str | os.PathLike, only: str | None = None) -> list[str]:
    """Clean what a kill left in ``folder``: staging folders are deleted (never complete), a swapped-out folder whose
    replacement never landed is put back. ``only``: just the leftovers of saves to that name. Returns what was done,
    for the log."""
    folder = Path(folder)
    done: list[str] = []
    if not folder.is_dir():
        return done
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir() or not entry.name.startswith((STAGING_PREFIX, OLD_PREFIX)):
            continue
        name = entry.name.split("-", 3)[-1]  # ".nbkit-staging-<token>-<name>" / ".nbkit-old-<token>-<name>"
        if only is not None and name != only:
            continue
        if entry.name.startswith(STAGING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed unfinished save {entry.name}")
        else:
            original = folder / name
            if original.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, original)
                done.append(f"restored {name} (its replacement was interrupted)")
    return done


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, from its header alone (None when it is).

    The format is an 8-byte little-endian header length, a JSON header giving each tensor's byte range in the data that
    follows, then the data; the loader requires the file to end exactly where the last range ends.
    """
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        length = int.from_bytes(head, "little")
        if length > _SAFETENSORS_HEADER_MAX:
            return f"a header length of {length} bytes, not a safetensors file"
        if 8 + length > size:
            return f"the header needs {8 + length} bytes, the file holds {size}"
        raw = file.read(length)
    try:
        header = json.loads(raw)
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"the header does not parse ({type(error).__name__})"
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"the header describes {expected} bytes, the file holds {size}"
    return None


def _torch_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole ``torch.save`` file (None when it is): its zip central directory, written last, must
    be there and list the pickle. A file in torch's legacy (non-zip) format cannot be checked this cheaply and passes."""
    with open(path, "rb") as file:
        first = file.read(1)
    if first == b"\x80":  # a pickle's protocol opcode: the legacy format
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        return f"no zip central directory at its end ({error})"
    if not any(name.endswith("data.pkl") for name in names):
        return "a zip archive without torch's data.pkl"
    return None


def _file_problem(path: Path, root: Path) -> str | None:
    """``<name> is empty`` / ``<name> is truncated or unreadable: <why>`` for one file a resume reads, else None."""
    name = path.relative_to(root).as_posix()
    try:
        if path.stat().st_size == 0:
            return f"{name} is empty"
        if path.suffix == ".json":
            json.loads(path.read_text())
            return None
        why = _safetensors_problem(path) if path.suffix == ".safetensors" else _torch_file_problem(path)
    except (OSError, ValueError) as error:
        why = f"{type(error).__name__}: {error}"
    return None if why is None else f"{name} is truncated or unreadable: {why}"


def _shards(index: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names (those that exist; a missing one is the loader's to report)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []  # the index itself is reported by _file_problem
    return [index.parent / name for name in sorted(set(weight_map.values())) if (index.parent / name).is_file()]


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is.

    Complete = ``trainer_state.json`` parses (transformers writes it after the weights, optimizer and RNG states), a
    weights file is present, and every file a resume reads (weights and their shards, optimizer, scheduler, scaler,
    RNG states) is whole as far as its header shows (see the module docstring). Files that are absent are not a
    problem beyond the weights: transformers resumes without them (``save_only_model``). Several damaged files are
    named in one line.
    """
    path = Path(path)
    state = path / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (the save did not finish)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json unreadable ({type(error).__name__})"
    weights = [path / name for name in _WEIGHT_FILES if (path / name).is_file()]
    weights += sorted(path.glob("*/adapter_model.safetensors"))  # several adapters: one folder each
    if not weights:
        return "no model or adapter weights"
    files = weights + [shard for index in weights if index.name.endswith(".index.json") for shard in _shards(index)]
    files += [path / name for name in _TORCH_STATE_FILES if (path / name).is_file()]
    files += sorted(path.glob("rng_state_*.pth"))  # one per process of a multi-process run
    problems = [problem for file in files if (problem := _file_problem(file, path)) is not None]
    return "; ".join(problems) or None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir``, oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def last_complete_checkpoint(output_dir: str | os.PathLike, skipped: list[tuple[str, str]] | None = None,
                             before: int | None = None) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (None if there is none), with ``N < before`` when given.
    Newer incomplete ones are appended to ``skipped`` as (path, reason)."""
    for path in reversed(list_checkpoints(output_dir)):
        if before is not None and checkpoint_step(path) >= before:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        if skipped is not None:
            skipped.append((str(path), problem))
    return None


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N of a ``checkpoint-N`` folder, None for any other name."""
    match = CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None
