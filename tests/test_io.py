"""JSONL io: group files round trip, malformed lines name file and line, writes are atomic."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from palaestra import Trajectory, TrajectoryGroup, read_groups, write_groups
from palaestra.trajectories.io import DataError, atomic_write_text, read_jsonl, sha256_file, write_jsonl


def test_groups_round_trip(tmp_path: Path) -> None:
    groups = [TrajectoryGroup([Trajectory(reward=float(i))], metadata={"i": i}) for i in range(3)]
    path = tmp_path / "g.jsonl"
    write_groups(path, groups)
    assert read_groups(path) == groups
    assert len(path.read_text().splitlines()) == 3


def test_a_gz_path_is_written_compressed_and_reads_back(tmp_path: Path) -> None:
    """``.gz`` paths: what write_groups / write_jsonl write, read_groups / read_jsonl read (the same bytes
    each time: no timestamp in the gzip header)."""
    import gzip

    groups = [TrajectoryGroup([Trajectory(reward=0.5)], metadata={"i": i}) for i in range(2)]
    write_groups(tmp_path / "g.jsonl.gz", groups)
    assert read_groups(tmp_path / "g.jsonl.gz") == groups
    assert gzip.decompress((tmp_path / "g.jsonl.gz").read_bytes()).count(b"\n") == 2
    rows = [{"id": "a", "x": 1}, {"id": "b", "x": 2}]
    write_jsonl(tmp_path / "r.jsonl.gz", rows)
    first = (tmp_path / "r.jsonl.gz").read_bytes()
    assert read_jsonl(tmp_path / "r.jsonl.gz") == rows
    write_jsonl(tmp_path / "r.jsonl.gz", rows)
    assert (tmp_path / "r.jsonl.gz").read_bytes() == first


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = TrajectoryGroup([Trajectory()]).model_dump_json()
    path.write_text(good + "\n\n" + '{"trajectories": [\n')
    with pytest.raises(DataError) as info:
        read_groups(path)
    assert f"{path}:3:" in str(info.value) and "malformed JSON" in str(info.value)
    assert info.value.line == 3


def test_invalid_group_names_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"trajectories": [{"reward": "high"}]}\n')
    with pytest.raises(DataError, match=r":1: invalid trajectory group at field 'trajectories.0.reward'"):
        read_groups(path)


def test_non_object_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: expected a JSON object, got list"):
        read_jsonl(path)


def test_a_damaged_or_unreadable_file_is_a_data_error_naming_it(tmp_path: Path) -> None:
    import gzip

    groups = [TrajectoryGroup([Trajectory(reward=float(i))]) for i in range(50)]
    whole = tmp_path / "g.jsonl.gz"
    whole.write_bytes(gzip.compress("".join(g.model_dump_json() + "\n" for g in groups).encode()))
    assert read_groups(whole) == groups
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[:-20])  # a copy that was interrupted
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read the file \(") as info:
        read_groups(cut)
    assert info.value.path == str(cut)
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text('{"trajectories": []}\n')  # named .gz, but never compressed
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz: cannot read the file \(Not a gzipped file"):
        read_jsonl(plain)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match=r"folder\.jsonl: cannot read the file \(\[Errno 21\] Is a directory"):
        read_jsonl(folder)


def test_missing_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_atomic_write_leaves_old_content_when_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temp file left behind


def test_write_jsonl_and_fingerprint(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, [{"x": 1}, {"y": "é"}])
    write_jsonl(b, [{"x": 1}, {"y": "é"}])
    assert read_jsonl(a) == [{"x": 1}, {"y": "é"}]
    assert sha256_file(a) == sha256_file(b)
    assert oct(a.stat().st_mode & 0o777) == "0o644"
