"""Atomic checkpoint writes: build the checkpoint under a temporary name, then rename.

A save that dies midway must leave the previous checkpoint readable. A directory is swapped in by
two renames (``target -> .target.old-XXXX``, ``tmp -> target``); :func:`recover`, called by every
loader, undoes a kill between them. Multi-rank writes share one temporary directory chosen by
rank 0 and swap only when every rank succeeded (docs/engine.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Union

import torch.distributed as dist

from .. import comm

PathLike = Union[str, os.PathLike]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_mode(path: Path, is_dir: bool) -> Path:
    """tempfile creates 0700 dirs / 0600 files; a checkpoint should get the permissions any
    other new file or folder of this user gets (others on a shared filesystem can read it)."""
    os.chmod(path, (0o777 if is_dir else 0o666) & ~_umask())
    return path


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def recover(path: PathLike) -> Path:
    """If a swap was interrupted (target missing, ``.name.old-*`` present), restore the old one."""
    path = Path(path)
    if not path.exists():
        olds = sorted(glob.glob(str(path.parent / f".{path.name}.old-*")), key=os.path.getmtime)
        if olds:
            os.rename(olds[-1], path)
    return path


def commit_dir(tmp: PathLike, path: PathLike) -> None:
    """Swap the finished directory ``tmp`` into ``path`` (replacing what is there)."""
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    old = None
    if path.exists() or path.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rmdir(old)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.unlink(old)


@contextlib.contextmanager
def atomic_dir(path: PathLike, group: Optional["dist.ProcessGroup"] = None,
               collective: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``path``; on success it becomes ``path``.

    ``collective=True``: every rank of ``group`` enters, all write into the same temporary
    directory (chosen by the group's first rank, so the filesystem must be shared), and the
    swap happens only if no rank raised. Otherwise only the calling process takes part.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    multi = collective and comm.initialized() and dist.get_world_size(group) > 1
    lead = (not multi) or dist.get_rank(group) == 0
    name = [str(_usual_mode(Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent)), True))] \
        if lead else [None]
    if multi:
        comm.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    tmp = Path(name[0])
    failed = False
    try:
        yield tmp
    except BaseException:
        failed = True
        raise
    finally:
        if multi:
            failed = comm.any_rank(failed, group)
        if lead:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                commit_dir(tmp, path)
        if multi:
            comm.barrier(group=group)
    # Reached only by a rank that did not raise itself: if a peer did, the save failed too.
    if failed:
        raise RuntimeError(f"checkpoint save to {path} failed on another rank; nothing was replaced")


@contextlib.contextmanager
def atomic_file(path: PathLike) -> Iterator[Path]:
    """Yield a temporary file path next to ``path``; on success ``os.replace`` moves it in."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        _usual_mode(tmp, False)  # after the writer: some (safetensors) recreate the file 0600
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
