"""benchmarks/results/: INDEX.md is current and names every results file, every plot has a
JSON to be redrawn from, and every results path the docs name exists (fast, CPU)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from benchmarks import results_io as rio

DOCS = list(dict.fromkeys(["README.md", "docs/measurements.md", *sorted(
    os.path.relpath(p, rio.REPO) for p in glob.glob(os.path.join(rio.REPO, "docs", "*.md")))]))
# a results path in a doc: benchmarks/results/... up to a space, quote, bracket or comma (the
# commas of a {a,b} list and <placeholder>s belong to it)
RESULTS_PATH = re.compile(r"benchmarks/results/(?:\{[^}\s]*\}|<[^>\s]*>|[^\s`'\"()\[\]{}<>,;|])*")


def doc_paths(text: str) -> list[str]:
    """The benchmarks/results/ paths a text names, as glob patterns: ``{a,b}`` lists expanded,
    ``<placeholder>`` and ``*`` as wildcards."""
    found = []
    for m in RESULTS_PATH.finditer(text):
        path = m.group(0).rstrip(".:")
        for p in rio.expand_braces(path):
            found.append(re.sub(r"<[^>]*>", "*", p))
    return found


def missing_paths(text: str) -> list[str]:
    return [p for p in doc_paths(text)
            if not glob.glob(os.path.join(rio.REPO, p))]


def test_index_is_current() -> None:
    with open(rio.INDEX_PATH) as f:
        assert f.read() == rio.render_index(), \
            "benchmarks/results/INDEX.md is stale: python -m benchmarks.results_io index"
    assert rio.main(["index", "--check"]) == 0


def test_index_names_every_results_file() -> None:
    with open(rio.INDEX_PATH) as f:
        index = f.read()
    files = rio.results_files()
    assert files, "no results files found"
    for rel in files:
        folder, _, name = rel.rpartition("/")
        assert f"## {folder or '(top level)'}" in index and f"| `{name}` |" in index, rel


def test_every_results_file_is_in_a_suite_folder() -> None:
    for rel in rio.results_files():
        folder, _, name = rel.rpartition("/")
        assert folder == rio.suite_of(name), f"{rel} belongs in {rio.suite_of(name)}/"


def test_every_plot_has_a_json_source() -> None:
    for png in (p for p in rio.results_files() if p.endswith(".png")):
        entry = rio.plot_entry(png)
        assert entry is not None, f"{png}: no entry in results_io.PLOTS"
        assert os.path.exists(os.path.join(rio.RESULTS_DIR, entry.source(png))), png


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_existing_results(doc: str) -> None:
    path = os.path.join(rio.REPO, doc)
    if not os.path.exists(path):
        pytest.skip(f"{doc} does not exist (yet)")
    with open(path) as f:
        assert missing_paths(f.read()) == []


def test_a_missing_results_path_fails() -> None:
    """The check bites: a doc naming a file that is not there, or a brace / placeholder
    pattern that matches nothing, is reported; one that exists is not."""
    text = ("see `benchmarks/results/serving/e2e_h200.json` and\n"
            "`benchmarks/results/serving/nope_h200.json`, "
            "`benchmarks/results/accuracy/longgen_smollm2.{json,svg}` and "
            "benchmarks/results/accuracy/smollm2_b<bs>_<storage>.json.")
    assert missing_paths(text) == ["benchmarks/results/serving/nope_h200.json",
                                   "benchmarks/results/accuracy/longgen_smollm2.svg"]


def test_index_staleness_is_detected(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stale = tmp_path / "INDEX.md"
    stale.write_text(rio.render_index() + "| `gone.json` | | | |\n")
    monkeypatch.setattr(rio, "INDEX_PATH", str(stale))
    assert rio.main(["index", "--check"]) == 1


def test_citations() -> None:
    pats = rio.cited_patterns("`benchmarks/results/accuracy/accuracy_stored_{auto,fp8}_x.{json,md}`"
                              " and `operator_h200_label_max_b*.json`, not `*.json`")
    assert "accuracy_stored_fp8_x.md" in pats and "*.json" not in pats
    assert rio.cited_by("accuracy/accuracy_stored_auto_x.png", {"README.md": pats}) == ["README.md"]
    assert rio.cited_by("operator/operator_h200_label_max_b16.png", {"d.md": pats}) == ["d.md"]
    assert rio.cited_by("operator/operator_h200.json", {"d.md": pats}) == []


def test_every_results_file_is_cited() -> None:
    """A results file no doc cites is stale: regenerate it into a doc or remove it (git keeps
    it)."""
    patterns = {name: rio.cited_patterns(text) for name, text in rio.citing_docs().items()}
    uncited = [rel for rel in rio.results_files() if not rio.cited_by(rel, patterns)]
    assert not uncited, f"results files no doc cites: {uncited}"
