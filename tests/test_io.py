"""The one atomic writer: exact content, nothing torn or left behind on errors, streamed sha256."""

from __future__ import annotations

import hashlib
import os

import pytest

from torch_armor._io import TMP_MARK, atomic_write, file_sha256, fsync_dir, temp_path


@pytest.mark.parametrize("as_writer", [False, True])
def test_file_ends_with_exactly_the_new_bytes(tmp_path, as_writer):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)  # longer than the new content: nothing of it may remain
    new = bytes(range(256)) * 3
    atomic_write(path, (lambda fh: fh.write(new)) if as_writer else new)
    assert path.read_bytes() == new
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_accepts_str_paths_and_writes_new_files(tmp_path):
    path = str(tmp_path / "new.json")
    atomic_write(path, bytearray(b"{}"))
    assert (tmp_path / "new.json").read_bytes() == b"{}"


def test_writes_through_a_marked_temp_file_in_the_same_directory(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    seen = {}

    def writer(fh):
        seen["name"] = os.path.basename(fh.name)
        seen["target"] = path.read_bytes()  # still the old content while writing
        fh.write(b"new")

    atomic_write(path, writer)
    assert seen == {"name": temp_path(path).name, "target": b"old"}
    assert seen["name"].startswith(".f.bin" + TMP_MARK) and temp_path(path).parent == tmp_path
    assert path.read_bytes() == b"new"


@pytest.mark.parametrize("error", [RuntimeError("disk unplugged"), KeyboardInterrupt()])
def test_error_in_writer_keeps_the_old_file_and_no_temp_file(tmp_path, error):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old content")

    def writer(fh):
        fh.write(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        atomic_write(path, writer)
    assert path.read_bytes() == b"old content"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]
    assert not any(TMP_MARK in name for name in os.listdir(tmp_path))


def test_error_before_any_file_leaves_nothing(tmp_path):
    path = tmp_path / "f.bin"
    with pytest.raises(ValueError, match="bytes or a callable"):
        atomic_write(path, "text, not bytes")
    with pytest.raises(ZeroDivisionError):
        atomic_write(path, lambda fh: 1 / 0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("size", [0, 1, (1 << 22) + 123])  # empty, tiny, more than one chunk
def test_file_sha256_is_hashlib_over_the_bytes(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    assert file_sha256(str(path), chunk_size=7) == hashlib.sha256(data).hexdigest()


def test_fsync_dir_syncs_the_directory_and_tolerates_what_cannot_be_opened(tmp_path, monkeypatch):
    synced = []  # a spy: the real os.fsync runs, we record which inode it was given
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    assert fsync_dir(tmp_path) is None
    assert synced == [os.stat(tmp_path).st_ino]  # the directory itself, once
    assert fsync_dir(tmp_path / "missing") is None  # no error: nothing to sync
    assert synced == [os.stat(tmp_path).st_ino]  # and nothing synced
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # the descriptor was closed
