"""What ``jd.resume`` checks of a checkpoint on each rank before any collective load (no collective, no tensor loaded).

A rank that raised while loading its own files (a truncated ``extra-rank1.pt``) went to the "is every rank ok"
all-reduce while its peers were inside DCP's ``gather_object``: mismatched collectives, every rank stuck (issue 29).
So each rank first runs :func:`verify` on what it will read, and ``_checkpoint.resume`` agrees on the answers
(one MIN all-reduce) before loading; a checkpoint damaged on any rank is skipped by all of them.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["COMPLETE", "Damaged", "Verified", "verify", "verify_dcp", "first_line"]

COMPLETE = "COMPLETE"
_ZIP = b"PK\x03\x04"  # how every item DCP writes with torch.save (the zip format) begins


class Damaged(Exception):
    """One line naming a file of a checkpoint and what is wrong with it, as this rank found it."""


class Verified:
    """What :func:`verify` read of a checkpoint on this rank, so that ``_checkpoint._load`` reads nothing twice."""

    def __init__(self, blob: dict[str, Any], own: bool, metadata: Any) -> None:
        self.blob, self.own, self.metadata = blob, own, metadata


def first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, cut to 200 characters (DCP and torch.load raise multi-line reports)."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
    return f"{type(exc).__name__}: {lines[0].strip()[:200]}"


def verify(path: str, step: int, rank: int, *, engines: bool, dcp: bool) -> Verified:
    """Check on this rank, without any collective and without loading a tensor, that ``path`` can be loaded.

    Reads the ``COMPLETE`` marker (JSON, the same step), this rank's ``extra-rank<k>.pt`` (a rank the checkpoint was
    saved by must have its own; a rank beyond that reads rank 0's), and for modules and optimizers DCP's
    ``.metadata`` and the storage files it names: present, at least as long as its last item needs, and a
    ``torch.save`` archive at each item's offset. Raises :class:`Damaged` naming the file.
    """
    import torch

    try:
        with open(os.path.join(path, COMPLETE), encoding="utf-8") as f:
            marker = json.load(f)
    except FileNotFoundError:
        raise Damaged(f"{COMPLETE} is missing") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Damaged(f"{COMPLETE} is not the JSON marker jd.save writes ({first_line(exc)})") from None
    if not isinstance(marker, dict):
        raise Damaged(f"{COMPLETE} holds {type(marker).__name__}, not the JSON object jd.save writes")
    if marker.get("step", step) != step:
        raise Damaged(f"{COMPLETE} says step {marker['step']!r} in the directory of step {step}")
    mine = f"extra-rank{rank}.pt"
    own = os.path.exists(os.path.join(path, mine))
    saved_by = marker.get("world_size")
    if not own and isinstance(saved_by, int) and rank < saved_by:
        raise Damaged(f"{mine} is missing (the checkpoint was saved by {saved_by} ranks, each writes its own)")
    name = mine if own else "extra-rank0.pt"
    try:
        blob = torch.load(os.path.join(path, name), weights_only=False)
    except Exception as exc:  # noqa: BLE001 - torch.load of damaged bytes raises many kinds
        raise Damaged(f"{name} cannot be loaded ({first_line(exc)})") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("extras"), dict):
        raise Damaged(f"{name} does not hold the extra state jd.save writes")
    if blob.get("step", step) != step:
        raise Damaged(f"{name} is of step {blob['step']!r}, in the directory of step {step}")
    if engines and not os.path.isdir(os.path.join(path, "deepspeed")):
        raise Damaged("deepspeed/ (the engine's own checkpoint) is missing")
    metadata = verify_dcp(os.path.join(path, "dcp")) if dcp else None
    return Verified(blob, own, metadata)


def verify_dcp(dcp: str) -> Any:
    """DCP's metadata of the checkpoint in ``dcp``, once every storage file it names is checked; see :func:`verify`."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(dcp, ".metadata")):
        raise Damaged("dcp/.metadata is missing")
    try:
        metadata = FileSystemReader(dcp).read_metadata()
        storage = metadata.storage_data
        items = [
            (str(i.relative_path), int(i.offset), int(i.length), not getattr(i, "transform_descriptors", None))
            for i in storage.values()
        ]  # an older torch's _StorageInfo has no transform_descriptors
        if not isinstance(metadata.state_dict_metadata, dict):
            raise TypeError("no state_dict_metadata")
    except Exception as exc:  # noqa: BLE001 - unpickling damaged bytes raises many kinds
        raise Damaged(f"dcp/.metadata cannot be read ({first_line(exc)})") from None
    by_file: dict[str, list[tuple[int, int, bool]]] = {}
    for rel, offset, length, plain in items:
        by_file.setdefault(rel, []).append((offset, length, plain))
    for rel, spans in sorted(by_file.items()):
        full = os.path.join(dcp, rel)
        try:
            size = os.stat(full).st_size
        except FileNotFoundError:
            raise Damaged(f"dcp/{rel} is missing (dcp/.metadata names it)") from None
        except OSError as exc:
            raise Damaged(f"dcp/{rel} cannot be read ({first_line(exc)})") from None
        need = max(offset + length for offset, length, _ in spans)
        if size < need:
            raise Damaged(f"dcp/{rel} has {size} bytes; dcp/.metadata places data up to byte {need}")
        try:
            with open(full, "rb") as f:
                for offset, _, plain in sorted(spans):
                    if plain:  # a transformed (e.g. compressed) item need not start like an archive
                        f.seek(offset)
                        if f.read(len(_ZIP)) != _ZIP:
                            raise Damaged(f"dcp/{rel} holds no saved tensor at byte {offset}, where dcp/.metadata "
                                           "puts one (overwritten)")  # fmt: skip
        except OSError as exc:
            raise Damaged(f"dcp/{rel} cannot be read ({first_line(exc)})") from None
    return metadata
