"""The supported-combinations matrix (sglang_ext/combinations.py) is what validation says: the
copies in the docs are current, and a few pairs whose rules are known come out as they should."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_ext import combinations

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def matrix():
    return combinations.build_matrix()


def _documents() -> list[Path]:
    docs = [ROOT / "docs" / "combinations.md"]
    readme = ROOT / "README.md"
    if readme.is_file() and combinations.BEGIN in readme.read_text(encoding="utf-8"):
        docs.append(readme)
    return docs


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.name)
def test_the_documented_matrix_is_current(matrix, path):
    block = combinations.current_block(path.read_text(encoding="utf-8"), str(path))
    assert block == combinations.render(matrix), (
        f"{path.relative_to(ROOT)} is stale: run .venv/bin/python -m sglang_ext.combinations "
        f"--write {path.relative_to(ROOT)}")


def test_every_feature_is_accepted_on_its_own(matrix):
    """Each feature's own settings (and what it needs) pass validation alone."""
    refused = {f.key: matrix.cells[f.key, f.key] for f in matrix.features
               if not matrix.accepted(f.key, f.key)}
    assert not refused


def test_pairs_merge_the_same_either_way():
    feats = combinations.features()
    for a in feats:
        for b in feats:
            assert combinations.combine(a, b) == combinations.combine(b, a), (a.key, b.key)


@pytest.mark.parametrize("a, b, words", [
    # sglang_ext/config.py::_validate_block_filter
    ("abf", "tsync", "--sparse-block-filter async does not combine with --sparse-tier"),
    # config.py: the guard and the locality constraint
    ("guard", "loc", "--sparse-guard-every cannot be combined with --sparse-locality-blocks"),
    # config.py: the tier needs a block filter
    ("ds", "tasyn", "--sparse-tier needs a block-filtering --sparse-method"),
    # config.py::_validate_cooperative
    ("coop", "tasyn", "--sparse-cooperative needs --sparse-tier sync"),
    # patches/server_args.py::_force_compatible_settings
    ("flux", "tri", "--sparse-scoring output_aware runs in the reference decode"),
    # selection/mla.py::_MLA_UNSUPPORTED via check_mla_model
    ("mla", "fp8sm", "--sparse-summary-dtype fp8_e4m3 does not support MLA models"),
    # patches/sampling_params.py::triton_override_refusal
    ("req", "guard", "per-request settings on --sparse-impl triton do not combine with "
                     "--sparse-guard-every"),
])
def test_known_refusals(matrix, a, b, words):
    assert not matrix.accepted(a, b) and not matrix.accepted(b, a)
    assert words in matrix.reason(a, b)
    assert "\n" not in matrix.reason(a, b)


@pytest.mark.parametrize("a, b", [
    ("quest", "tsync"), ("2lvl", "tasyn"), ("abf", "fp8sm"), ("flux", "ref"), ("hpol", "ref"),
    ("coop", "tri"), ("loc", "tsync"), ("evh", "tri"), ("fp8lb", "ds"), ("req", "ref"),
    ("mla", "tasyn"), ("tp2", "tsync"), ("tsync", "fp8kv"), ("tasyn", "fp8kv"),
])
def test_known_good_pairs(matrix, a, b):
    assert matrix.accepted(a, b), matrix.cells[a, b]


def test_one_flag_with_two_values_is_neither_accepted_nor_refused(matrix):
    assert matrix.cells["quest", "ds"] == combinations.EXCLUSIVE
    assert matrix.cells["tri", "ref"] == combinations.EXCLUSIVE
    assert matrix.reason("tri", "ref") is None
    # a need gives way to the other feature's own value, and validation judges the result
    assert matrix.cells["coop", "tasyn"] not in (None, combinations.EXCLUSIVE)


def test_a_check_leaves_the_launch_state_alone(monkeypatch):
    from sglang_ext import runtime

    process = runtime.state()
    monkeypatch.setenv("SGLANG_EXT_CONFIG", '{"tier": "sync"}')
    before = (process.config, process.impl, process.mla)
    feats = {f.key: f for f in combinations.features()}
    with combinations.Validator() as v:
        # $SGLANG_EXT_CONFIG's tier would refuse ds: the check must not see it
        assert v.refusal(combinations.combine(feats["ds"])) is None
    assert (process.config, process.impl, process.mla) == before
    import os
    assert os.environ["SGLANG_EXT_CONFIG"] == '{"tier": "sync"}'


def test_write_and_check(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{combinations.BEGIN}\nold\n{combinations.END}\ntail\n")
    assert combinations.main(["--check", str(doc)]) == 1
    assert combinations.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{combinations.END}\ntail\n")
    assert combinations.main(["--check", str(doc)]) == 0
    with pytest.raises(ValueError, match="lacks the"):
        combinations.replace_block("no markers", "x")
