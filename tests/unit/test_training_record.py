"""A drafter file records the command that wrote it with its files relative to where it ran, never a machine path."""

from __future__ import annotations

from pathlib import Path

from backends.training.record import command_line, recorded_argv


def test_files_under_the_working_folder_are_named_relative_to_it(tmp_path: Path) -> None:
    argv = ["drafter", "--features", str(tmp_path / "v2" / "feats.safetensors"), "--steps", "10"]
    argv += [f"--out={tmp_path / 'v3' / 'eagle.safetensors'}", "--losses", "v3/losses.json"]
    assert recorded_argv(argv, tmp_path) == [
        "drafter",
        "--features",
        "v2/feats.safetensors",
        "--steps",
        "10",
        "--out=v3/eagle.safetensors",
        "--losses",
        "v3/losses.json",
    ]


def test_files_outside_it_are_named_relative_to_the_folder_that_holds_them_all(tmp_path: Path) -> None:
    scratch, repo = tmp_path / "scratch", tmp_path / "repo"
    argv = ["drafter", "--init", str(scratch / "eagle.safetensors"), "--out", str(scratch / "v3" / "eagle.safetensors")]
    assert recorded_argv(argv, repo) == ["drafter", "--init", "eagle.safetensors", "--out", "v3/eagle.safetensors"]
    assert recorded_argv(["vocab", "--file", str(scratch / "x.safetensors")], repo) == [
        "vocab",
        "--file",
        "x.safetensors",
    ]


def test_files_with_no_common_folder_are_named_by_file_name(tmp_path: Path) -> None:
    root = Path(tmp_path.anchor)
    argv = ["drafter", "--features", str(tmp_path / "f.safetensors"), "--out", str(root / "o.safetensors")]
    assert recorded_argv(argv, tmp_path / "elsewhere") == [
        "drafter",
        "--features",
        "f.safetensors",
        "--out",
        "o.safetensors",
    ]


def test_other_arguments_and_random_weights_are_left_as_given(tmp_path: Path) -> None:
    argv = ["tau", "--model", "smollm2-135m-instruct", "--weights", "random", "--suites", "a/b"]
    assert recorded_argv(argv, tmp_path) == argv
    line = command_line("specdec train", ["drafter", "--out", str(tmp_path / "my dir" / "d.safetensors")], tmp_path)
    assert line == "specdec train drafter --out 'my dir/d.safetensors'"
    assert str(tmp_path) not in line
