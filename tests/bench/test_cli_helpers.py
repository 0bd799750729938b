"""bench/cli.py: what every benchmark's command line shares."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.cli import first_paragraph, json_option, write_json


def test_write_json_makes_the_folder_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new" / "deeper" / "numbers.json"
    write_json(path, {"rows": [{"tok_s": 1.5}]})
    assert json.loads(path.read_text()) == {"rows": [{"tok_s": 1.5}]}
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_json_goes_under_out_where_it_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    parser = argparse.ArgumentParser()
    json_option(parser, "x.json")
    assert parser.parse_args([]).json == tmp_path / "x.json"
    assert parser.parse_args(["--json", "y.json"]).json == Path("y.json")


def test_help_takes_a_docstrings_whole_first_paragraph() -> None:
    doc = "One line\nwrapped here.\n\nDetails."
    assert first_paragraph(doc) == "One line wrapped here."
    assert first_paragraph(None) == ""
