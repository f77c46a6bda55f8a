"""bench/results_index.py: the committed INDEX.md is what the script writes (so it cannot go
stale), every record sits in a topic folder, and the README mode writes between its markers."""

from __future__ import annotations

import pytest

from bench import results_index


def test_committed_index_is_current():
    records = results_index.find_records()
    assert results_index.INDEX.read_text() == results_index.index_markdown(records), (
        "bench/results/INDEX.md is stale: run python3 bench/results_index.py")


def test_records_live_in_topic_folders():
    top_level = {p.name for p in results_index.RESULTS.iterdir() if p.is_file()}
    assert top_level <= {"INDEX.md", "README.md"}
    records = results_index.find_records()
    assert len({r.topic for r in records}) > 5 and all(r.files for r in records)


def test_readme_table_goes_between_the_markers():
    table = results_index.headline_table(results_index.find_records())
    assert table.startswith("| topic |") and "| attention |" in table and "sdpa_cudnn" in table
    readme = f"# omni\n\n{results_index.README_START}\nold table\n{results_index.README_END}\n\nmore\n"
    written = results_index.replace_between_markers(readme, table)
    assert "old table" not in written and table in written and written.endswith("\n\nmore\n")
    assert results_index.replace_between_markers(written, table) == written
    with pytest.raises(ValueError, match="markers"):
        results_index.replace_between_markers("# no markers\n", table)
