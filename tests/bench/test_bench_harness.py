"""bench/harness.py: every script's record lands in its topic folder, named as the index reads it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import harness, results_index



def test_every_script_has_a_topic_folder():
    """A script (it runs as ``__main__``) other than the index itself names its topic."""
    scripts = {p.stem for p in (harness.REPO_ROOT / "bench").glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text()} - {"results_index"}
    assert scripts == set(harness.TOPICS)
    for topic in harness.TOPICS.values():
        assert (harness.RESULTS / topic).is_dir(), topic


def test_out_dir_defaults_to_the_topic_folder_unless_out_is_set(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    parser = argparse.ArgumentParser()
    harness.add_out_dir_argument(parser, "/somewhere/bench/qk_norm_rope.py")
    assert parser.parse_args([]).out_dir == harness.RESULTS / "qk-norm-rope"
    assert parser.parse_args(["--out-dir", "x"]).out_dir == Path("x")
    monkeypatch.setenv("OUT", "/tmp/elsewhere")
    parser = argparse.ArgumentParser()
    harness.add_out_dir_argument(parser, "bench/prompt_encoding.py", "--out")
    assert parser.parse_args([]).out_dir == Path("/tmp/elsewhere")


def test_a_written_record_is_named_as_the_index_reads_it(tmp_path):
    for device in ("NVIDIA H200", "none", "cpu"):
        stem = harness.write_record(tmp_path, harness.record_stem("demo-run", device), {"a": Path("p")}, "# t")
        match = results_index.RECORD_NAME.match(stem.with_suffix(".json").name)
        assert match and match["name"] == "demo-run"
        assert match["device"] == ("nvidia-h200" if device.startswith("NVIDIA") else "cpu")
        assert json.loads(stem.with_suffix(".json").read_text()) == {"a": "p"}
        assert stem.with_suffix(".md").read_text() == "# t\n"
