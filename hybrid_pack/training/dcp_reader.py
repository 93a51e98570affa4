"""Reading a ``torch.distributed.checkpoint`` folder with nothing unpickled beyond tensors, plain values and DCP's
own records.

DCP (torch 2.13) unpickles its ``.metadata`` with ``pickle.load`` and each non-tensor value with
``torch.load(..., weights_only=False)``: a checkpoint on shared storage could run whatever its writer put in it.
:func:`read_dcp_metadata` unpickles the metadata through an allow-list of DCP's record classes; :func:`read_dcp`
is ``dcp.load`` with that reader and a planner that first loads every non-tensor value with ``weights_only=True``.
A refusal is an :class:`~hybrid_pack.errors.InputError` on every rank.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hybrid_pack.errors import InputError
from hybrid_pack.training.checkpoint import refusal_reason

__all__ = ["read_dcp", "read_dcp_metadata"]

_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}
"""What DCP's ``.metadata`` pickle may name besides torch's dtypes: its own records, sizes, layouts and paths."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, refusing every global outside :data:`_METADATA_GLOBALS` and torch's dtypes
    (what a planted payload would call)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and (module, name) not in _METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


def read_dcp_metadata(folder: Path) -> Metadata:
    """The ``.metadata`` of the DCP checkpoint in ``folder``, unpickled by :class:`_MetadataUnpickler`.

    Raises:
        InputError: it names anything but DCP's records (it is not run), or is missing or unreadable.
    """
    path = folder / ".metadata"
    try:
        with open(path, "rb") as file:
            return _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as err:
        raise InputError(f"resume: {path} names objects other than DCP's records ({err}); it was refused, not "
                         "loaded. Resume from a checkpoint you wrote, or train without --resume") from None
    except (OSError, EOFError) as err:
        raise InputError(f"resume: {path} cannot be read ({err}); resume from another checkpoint or train "
                         "without --resume") from None


def read_dcp(state: dict[str, Any], folder: Path) -> None:
    """``dcp.load`` of the checkpoint in ``folder`` into ``state`` (in place), its metadata and non-tensor values
    read as tensors, plain values and DCP's records only. A collective under a process group.

    Raises:
        InputError: on every rank, when a rank found a value holding anything else (it is not run).
    """
    try:
        dcp.load(state, storage_reader=_PlainFileSystemReader(folder), planner=_PlainLoadPlanner())
    except CheckpointException as err:  # DCP gathers every rank's failures, so every rank sees the refusal
        refusals = [failure for failure, _ in err.failures.values() if isinstance(failure, InputError)]
        if refusals:
            raise refusals[0] from None
        raise


class _PlainFileSystemReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` read by :func:`read_dcp_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, each non-tensor value (an optimizer setting) first loaded with ``weights_only=True``:
    a value holding anything else is refused before DCP's own ``torch.load(..., weights_only=False)`` sees it."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise InputError(f"resume: the checkpoint value {read_item.dest_index.fqn} holds objects other than "
                             f"tensors and plain values; it was refused, not loaded ({refusal_reason(err)})") from None
        value.seek(0)
        super().load_bytes(read_item, value)
