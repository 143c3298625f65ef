"""Weight updates without a restart (docs/rollouts.md): what the engine
sends its workers, and where a caller's tensors travel.

``update_weights``: the source (a safetensors file or folder, or a mapping
of the transformer's parameter names to tensors, which the engine writes as
one safetensors file in shared memory: ``/dev/shm`` where there is one) is
checksummed here, then a draining job between ticks (``between_ticks``)
has every rank stage it (``StageWeights``: read, check names and shapes,
answer a checksum). Only when every rank's checksum equals the source's is
it committed (``CommitWeights``); otherwise discarded (``DiscardWeights``)
and the old weights stay, with ``WeightsMismatchError``. A commit asked to
keep the previous weights (Ray Serve's replicas do) lets ``revert_update``
put them back (``RevertWeights``) until the next commit.

``update_lora``: the adapter's new factors registered as a new adapter
under the same name (the loader reads them like any adapter file); requests
accepted before hold the old one until they end, so none mixes versions.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping

import msgspec
import torch

from diffrt.engine.runner_messages import (
    CommitWeights,
    DiscardWeights,
    RevertWeights,
    StageWeights,
)
from diffrt.engine.weights.update import (
    WeightUpdateError,
    checksum,
    read_tensors,
    safetensors_files,
)
from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)

#: what a weight update's source may be: a path, or tensors by name
WeightSource = str | os.PathLike[str] | Mapping[str, torch.Tensor]
#: a weights version: what the caller names it (an int by default, counting up)
Version = int | str


class WeightsUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """An applied update (``update_weights_report``): the new version, the
    source's checksum and the one each rank reported (all equal to it: an
    update whose ranks disagree is refused), for a caller to log or show."""

    version: Version
    checksum: str
    rank_checksums: list[str]


class WeightsMismatchError(RuntimeError):
    """A rank read something other than the source: the update was refused
    and every rank kept its old weights."""


#: the name of every folder this module writes in shared memory
SHARED_PREFIX = "diffrt-weights-"


def shared_dir() -> str:
    """A fresh folder in shared memory (``/dev/shm``; the temporary folder
    where the host has none), for tensors on their way to the workers.

    Its name carries this process's pid namespace and pid, so that the
    folders of a process that is gone — a Ray Serve replica is killed at
    shutdown before its engine closes, and an updated adapter's file lives
    as long as the engine — are removed by the next process that makes one
    (``sweep_orphans``)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = root or tempfile.gettempdir()
    owner = _owner()
    if owner is not None:
        sweep_orphans(root, owner[0])
    tag = f"{owner[0]}-{owner[1]}-" if owner is not None else ""
    return tempfile.mkdtemp(prefix=f"{SHARED_PREFIX}{tag}", dir=root)


def _owner() -> tuple[str, int] | None:
    """(pid namespace, pid) of this process; None where there is no /proc."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    return "".join(c for c in namespace if c.isdigit()), os.getpid()


def sweep_orphans(root: str, namespace: str) -> list[str]:
    """Remove the folders under ``root`` that a process of this pid
    namespace made and that process is gone; the paths removed. Folders of
    other namespaces (a container sharing the host's /dev/shm) are left."""
    removed = []
    for name in os.listdir(root):
        parts = name[len(SHARED_PREFIX):].split("-", 2) if name.startswith(SHARED_PREFIX) else []
        if len(parts) == 3 and parts[0] == namespace and parts[1].isdigit() \
                and not _alive(int(parts[1])):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def write_tensors(tensors: Mapping[str, torch.Tensor], folder: str, file: str,
                  metadata: dict[str, str] | None = None) -> str:
    """``tensors`` (host copies, contiguous) as ``folder/file``; its path."""
    from safetensors.torch import save_file

    if not isinstance(tensors, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise WeightUpdateError("tensors must be a mapping of names to torch tensors")
    path = os.path.join(folder, file)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path,
              metadata=metadata)
    return path


def source_checksum(source: WeightSource) -> str:
    """The checksum an update of ``source`` reports (``WeightsUpdate.checksum``),
    computed without applying it (Ray Serve's replicas compare theirs first)."""
    if isinstance(source, Mapping):
        return checksum(source)
    return checksum(read_tensors(os.path.abspath(os.fspath(source))))


class StagedSource:
    """A source made ready for the workers: the path they read, its checksum,
    and the shared-memory folder to remove afterwards (None: the caller's)."""

    def __init__(self, source: WeightSource):
        self.folder: str | None = None
        if isinstance(source, Mapping):
            self.folder = shared_dir()
            try:
                self.path = write_tensors(source, self.folder, "weights.safetensors")
            except BaseException:
                self.remove()
                raise
            self.checksum = source_checksum(source)
        else:
            self.path = os.path.abspath(os.fspath(source))
            safetensors_files(self.path)  # refuses a path with no safetensors file
            self.checksum = source_checksum(self.path)

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def apply_update(executor: Executor, source: StagedSource,
                 keep_previous: bool = False) -> list[str]:
    """Stage on every rank, compare, then commit or discard (see the module);
    the ranks' checksums of what they committed."""
    replies = executor.collective_rpc(StageWeights(source.path))
    errors = [(rank, r.error) for rank, r in enumerate(replies) if r.error]
    wrong = [(rank, r.checksum) for rank, r in enumerate(replies)
             if not r.error and r.checksum != source.checksum]
    if errors or wrong:
        executor.collective_rpc(DiscardWeights())
        if errors:
            rank, error = errors[0]
            raise WeightUpdateError(f"rank {rank} could not read {source.path}: {error}")
        rank, got = wrong[0]
        raise WeightsMismatchError(
            f"rank {rank} read checksum {got}, the source's is {source.checksum}: the update "
            "is refused and every rank keeps its old weights")
    executor.collective_rpc(CommitWeights(keep_previous=keep_previous))
    return [r.checksum for r in replies]


def revert_update(executor: Executor) -> list[str]:
    """Every rank puts back what its last kept commit replaced; the ranks'
    checksums of what they put back (``WeightUpdateError``: a rank kept none,
    e.g. fresh workers after a restart)."""
    replies = executor.collective_rpc(RevertWeights())
    errors = [(rank, r.error) for rank, r in enumerate(replies) if r.error]
    if errors:
        rank, error = errors[0]
        raise WeightUpdateError(f"rank {rank} could not roll the weights back: {error}")
    return [r.checksum for r in replies]


def next_version(current: Version, version: Version | None) -> Version:
    """The version an update gets: the caller's, or the current one plus one."""
    if version is not None:
        if not isinstance(version, (int, str)) or isinstance(version, bool):
            raise WeightUpdateError(f"version must be an int or a str, got {version!r}")
        return version
    if isinstance(current, int):
        return current + 1
    raise WeightUpdateError(f"the current version {current!r} is not a number: name the new one")


__all__ = ["SHARED_PREFIX", "StagedSource", "Version", "WeightSource", "WeightsMismatchError",
           "WeightsUpdate", "apply_update", "next_version", "revert_update", "shared_dir",
           "source_checksum", "sweep_orphans", "write_tensors"]
