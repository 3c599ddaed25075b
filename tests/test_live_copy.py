"""A backup of a directory a running process writes: a file deleted between the listing and
its copy (a journal segment a new snapshot covered) makes the copy start again."""

from __future__ import annotations

import shutil

import pytest

from diloco.runtime import live_copy
from diloco.runtime.live_copy import copy_live_directory


def test_a_file_deleted_during_the_copy_makes_it_start_again(tmp_path):
    source = tmp_path / "state"
    (source / "fragments").mkdir(parents=True)
    for name in ("p000.safetensors", "p000.000000.journal", "p000.000001.journal", "x.tmp"):
        (source / "fragments" / name).write_text(name)
    deleted = []

    def copy_while_a_snapshot_lands(src, dst):
        if src.endswith("000000.journal") and not deleted:  # deleted after the listing
            (source / "fragments" / "p000.000000.journal").unlink()
            deleted.append(src)
        return shutil.copy2(src, dst)

    target = tmp_path / "backup"
    copy_live_directory(source, target, copy_function=copy_while_a_snapshot_lands)
    assert deleted
    assert sorted(p.name for p in (target / "fragments").iterdir()) == [
        "p000.000001.journal",
        "p000.safetensors",
    ]


def test_a_directory_that_never_holds_still_is_an_error(tmp_path, monkeypatch):
    source = tmp_path / "state"
    source.mkdir()
    (source / "a").write_text("a")

    def always_gone(src, dst):
        raise FileNotFoundError(2, "No such file or directory", src)

    monkeypatch.setattr(live_copy, "LIVE_COPY_ATTEMPTS", 3)
    with pytest.raises(shutil.Error):
        copy_live_directory(source, tmp_path / "backup", copy_function=always_gone)
