"""Write bench/results/INDEX.md: one row per record in bench/results/<topic>/.

    python3 bench/results_index.py                     # rewrites bench/results/INDEX.md
    python3 bench/results_index.py --check             # exit 1 when INDEX.md is stale
    python3 bench/results_index.py --readme README.md  # the headline table between the markers

A record is the files of one run: ``<name>_<device>_<YYYYMMDD>[-part].{json,md,txt,patch}``.
The headline figure is read from the record's JSON where a reader below knows its layout (the
figures are the record's own, only picked and rounded), else the markdown's title line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "INDEX.md"
README_START = "<!-- results:headline:start -->"
README_END = "<!-- results:headline:end -->"
RECORD_NAME = re.compile(r"^(?P<name>.+?)_(?P<device>nvidia-[a-z0-9-]+|cpu)_(?P<date>\d{8})(?P<part>[^.]*)\.")
COMMIT = re.compile(r"\bcommit\b[:\s]+`?([0-9a-f]{7,40}(?:-dirty)?)\b")


@dataclass
class Record:
    topic: str
    name: str
    device: str
    date: str  # YYYY-MM-DD
    files: list[Path] = field(default_factory=list)

    def read_json(self) -> dict | list | None:
        path = next((f for f in self.files if f.suffix == ".json"), None)
        return json.loads(path.read_text()) if path else None

    @property
    def stamp(self) -> str:
        """When it ran, for ordering: the JSON's UTC time where it has one, else the date."""
        data = self.read_json()
        env = data.get("environment") if isinstance(data, dict) else None
        utc = env.get("utc") if isinstance(env, dict) else None
        return utc if isinstance(utc, str) and utc.startswith(self.date) else self.date

    def read_markdown(self) -> str:
        path = next((f for f in self.files if f.suffix == ".md"), None)
        return path.read_text() if path else ""


def find_records(results: Path = RESULTS) -> list[Record]:
    """Every record under ``results/<topic>/``, files of one run grouped, by topic then newest."""
    records: dict[tuple, Record] = {}
    for path in sorted(results.glob("*/*")):
        match = RECORD_NAME.match(path.name)
        if not match:
            raise ValueError(f"{path}: not named <name>_<device>_<YYYYMMDD>.<ext>")
        date = match["date"]
        key = (path.parent.name, match["name"], match["device"], date)
        record = records.setdefault(key, Record(key[0], key[1], key[2], f"{date[:4]}-{date[4:6]}-{date[6:]}"))
        record.files.append(path)
    newest_first = sorted(sorted(records.values(), key=lambda r: r.name), key=lambda r: r.stamp, reverse=True)
    return sorted(newest_first, key=lambda r: r.topic)


def commit_of(record: Record) -> str:
    """The commit the record names: its markdown's ``commit`` line, else its JSON's."""
    match = COMMIT.search(record.read_markdown())
    if match:
        return match[1][:7] + ("-dirty" if match[1].endswith("-dirty") else "")
    data = record.read_json()
    if isinstance(data, dict):
        env = data.get("environment") if isinstance(data.get("environment"), dict) else data
        commit = env.get("git_commit") or data.get("base_commit")
        if commit:
            return str(commit)[:7] + ("-dirty" if str(commit).endswith("-dirty") else "")
    return "-"


# --------------------------------------------------------------------- headline readers
# Each takes a record's JSON and returns (headline, peer) or None; peer is what omni is
# compared with ("" when the figure is omni against itself).


def _rows(data, key: str) -> list[dict]:
    """``data[key]`` when it is a list of dicts (a table of rows), else []."""
    rows = data.get(key) if isinstance(data, dict) else None
    return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else []


def _attention(data) -> tuple[str, str] | None:
    rows = [r for r in _rows(data, "results") if r.get("status") == "ok"]
    omni = [r for r in rows if str(r.get("backend")).startswith("omni") and r.get("ratio_vs_cudnn")]
    if not omni:
        return None
    best = max(omni, key=lambda r: r["ratio_vs_cudnn"])
    ratios = [r["ratio_vs_cudnn"] for r in omni if r["backend"] == best["backend"]]
    text = f"{best['backend']} {_span(ratios)} sdpa_cudnn"
    sage = {r["shape"]: r["tflops"] for r in rows if r.get("backend") == "sageattention" and r.get("tflops")}
    vs_sage = [(r["tflops"] / sage[r["shape"]], r["shape"]) for r in omni
               if r["backend"] == best["backend"] and r["shape"] in sage]
    if vs_sage:
        text += f", {_span([v for v, _ in vs_sage])} sageattention"
    return text + f" ({len(ratios)} shapes)", "cuDNN" + (", sageattention" if vs_sage else "")


def _linear(data) -> tuple[str, str] | None:
    fp8 = [r["speedup_vs_bf16"] for r in _rows(data, "linear") if r.get("variant") == "omni-fp8" and r.get("speedup_vs_bf16")]
    if not fp8:
        return None
    return f"omni-fp8 {_span(fp8)} bf16 ({len(fp8)} shapes)", "bf16 linear"


def _pipeline(data) -> tuple[str, str] | None:
    rows = _rows(data, "results")
    if not rows or not all("model" in r and "variant" in r for r in rows):
        return None
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and r.get("status") == "ok" and r.get("speedup")]
        best = max((r for r in ok if r["variant"].startswith("omni")), key=lambda r: r["speedup"], default=None)
        if best is None:
            continue
        text = f"{model} {best['variant']} {best['speedup']:.2f}x eager"
        compiled = next((r for r in ok if r["variant"] == "diffusers_compile"), None)
        if compiled:
            text += f", {best['speedup'] / compiled['speedup']:.2f}x diffusers compile"
        parts.append(text)
    return ("; ".join(parts), "diffusers") if parts else None


def _caching(data) -> tuple[str, str] | None:
    rows = _rows(data, "results")
    cached = [r for r in rows if r.get("config") not in (None, "reference") and r.get("speedup")]
    if not cached:
        return None
    best = max(cached, key=lambda r: r["speedup"])
    quality = f", PSNR {best['psnr_db']:.1f} dB" if isinstance(best.get("psnr_db"), float) else ""
    return f"{best['config']} {best['threshold']}: {best['speedup']:.2f}x uncached{quality}", "uncached"


def _qk_norm_rope(data) -> tuple[str, str] | None:
    rows = _rows(data, "results")
    if not rows or not any("speedup_vs_diffusers_eager" in r for r in rows):
        return None
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {r["backend"]: r.get("speedup_vs_diffusers_eager") for r in rows if r["shape"] == shape}
        omni = max((v for k, v in by.items() if k.startswith("omni") and v), default=None)
        if omni and by.get("diffusers-compile"):
            ratios.append(omni / by["diffusers-compile"])
    return (f"best omni {_span(ratios)} diffusers compile ({len(ratios)} shapes)", "diffusers compile") if ratios else None


def _parallel_scaling(data) -> tuple[str, str] | None:
    if not isinstance(data, dict) or data.get("benchmark") != "parallel_scaling":
        return None
    ok = [r for r in data["rows"] if r.get("status") == "ok" and r.get("speedup")]
    best = max(ok, key=lambda r: r["speedup"], default=None)
    if best is None:
        return None
    return f"{best['config']} {best['speedup']:.2f}x one GPU ({data['model']})", "one GPU"


def _serve(data) -> tuple[str, str] | None:
    summary = data.get("summary") if isinstance(data, dict) else None
    if not summary or "batched_speedup" not in summary:
        return None
    return (f"batching {summary['batched_speedup']:.2f}x unbatched, overhead p50 "
            f"{summary['overhead_ms_p50']:.1f} ms", "unbatched")


READERS = (_attention, _linear, _pipeline, _caching, _qk_norm_rope, _parallel_scaling, _serve)


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{high:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def headline(record: Record) -> tuple[str, str, str]:
    """(figure, peer, reader): from the JSON where a reader knows its layout, else the
    markdown's first heading or line of prose (or a text file's first line), no peer, no reader."""
    data = record.read_json()
    for reader in READERS:
        found = reader(data) if data is not None else None
        if found:
            return (*found, reader.__name__)
    lines = [line.strip() for line in record.read_markdown().splitlines() if line.strip()]
    title = next((line for line in lines if line.startswith("#")), None)
    prose = next((line for line in lines if not line.startswith("|")), None)
    if title or prose:
        return (title or prose).lstrip("#").strip(), "", ""
    text = next((f for f in record.files if f.suffix in (".txt", ".patch")), None)
    if text is not None:
        return f"{text.suffix[1:]}: {text.read_text().strip().splitlines()[0].strip()}", "", ""
    return "raw data (JSON only)", "", ""


# --------------------------------------------------------------------- tables


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _links(record: Record, base: Path) -> str:
    return " ".join(f"[{f.suffix[1:]}]({f.relative_to(base).as_posix()})" for f in record.files)


def index_markdown(records: list[Record], results: Path = RESULTS) -> str:
    lines = ["# Benchmark records", "",
             "Generated by `python3 bench/results_index.py` from the records in this folder: do not",
             "edit by hand. One row per run, newest first within a topic; the headline figure is the",
             "record's own (from its JSON where the index knows the layout, else its title line).", "",
             "| topic | date | device | commit | headline | record |",
             "| --- | --- | --- | --- | --- | --- |"]
    for record in records:
        figure, _, _ = headline(record)
        lines.append(f"| {record.topic} | {record.date} | {record.device} | {commit_of(record)} | "
                     f"{_cell(figure)} | {record.name} {_links(record, results)} |")
    return "\n".join(lines) + "\n"


def headline_table(records: list[Record], results: Path = RESULTS) -> str:
    """One row per kind of peer comparison (a reader above): its newest record, as markdown."""
    newest: dict[str, tuple[Record, str, str]] = {}
    for record in sorted(records, key=lambda r: r.stamp, reverse=True):
        figure, peer, reader = headline(record)
        if peer and reader not in newest:
            newest[reader] = (record, figure, peer)
    lines = ["| topic | omni against its peers | peer | device | date | record |",
             "| --- | --- | --- | --- | --- | --- |"]
    for reader in READERS:
        if reader.__name__ in newest:
            record, figure, peer = newest[reader.__name__]
            md = next((f for f in record.files if f.suffix == ".md"), record.files[0])
            link = f"[{record.name}](bench/results/{md.relative_to(results).as_posix()})"
            lines.append(f"| {record.topic} | {_cell(figure)} | {peer} | {record.device} | {record.date} | {link} |")
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, table: str) -> str:
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {README_START} ... {README_END} are missing")
    return text[: start + len(README_START)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when INDEX.md is not what this writes")
    parser.add_argument("--readme", type=Path, help="write the headline table between the markers of this file")
    args = parser.parse_args(argv)
    records = find_records()
    if args.readme:
        args.readme.write_text(replace_between_markers(args.readme.read_text(), headline_table(records)))
        return 0
    text = index_markdown(records)
    if args.check:
        stale = not INDEX.exists() or INDEX.read_text() != text
        if stale:
            print("bench/results/INDEX.md is stale: run python3 bench/results_index.py", file=sys.stderr)
        return int(stale)
    INDEX.write_text(text)
    print(f"wrote {INDEX} ({len(records)} records)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
