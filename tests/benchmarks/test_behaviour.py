"""``benchmarks/behaviour.py``: short runs recorded through the public API and compared to the bit.

The comparison must tell a one-ulp change of one tensor, a changed value, a run missing from one
record and a scenario recorded in one only; a recorded scenario must repeat to the bit in one process.
"""

from __future__ import annotations

from pathlib import Path

import behaviour as B
import pytest
import torch


def _record(path: Path, record: dict) -> Path:
    torch.save(record, path)
    return path


def _sample() -> dict:
    return {"optimizer": {"eager/int8/direct": {"params": [torch.linspace(0, 1, 5)], "formats": {"w0": "int8"},
                                               "state_bytes": 90, "decoded": {"w0": {"exp_avg": None}}}}}


def test_identical_records_compare_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _record(tmp_path / "a.pt", _sample()), _record(tmp_path / "b.pt", _sample())
    assert B.compare(a, b) == 0
    assert "1 of 1 runs identical" in capsys.readouterr().out


def test_one_ulp_of_one_tensor_is_a_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    changed = _sample()
    t = changed["optimizer"]["eager/int8/direct"]["params"][0]
    t[2] = torch.nextafter(t[2], torch.tensor(2.0))
    assert B.compare(_record(tmp_path / "a.pt", _sample()), _record(tmp_path / "b.pt", changed)) == 1
    out = capsys.readouterr().out
    assert "optimizer/eager/int8/direct/params[0]: tensors differ" in out and "0 of 1 runs identical" in out


@pytest.mark.parametrize("edit, expected", [
    (lambda r: r["optimizer"]["eager/int8/direct"].update(state_bytes=91), "state_bytes: 90 != 91"),
    (lambda r: r["optimizer"]["eager/int8/direct"]["formats"].update(w0="fp32"), "'int8' != 'fp32'"),
    (lambda r: r["optimizer"]["eager/int8/direct"]["decoded"].pop("w0"), "w0: only in the first"),
])
def test_a_changed_value_or_a_missing_entry_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, expected: str
) -> None:
    changed = _sample()
    edit(changed)
    assert B.compare(_record(tmp_path / "a.pt", _sample()), _record(tmp_path / "b.pt", changed)) == 1
    assert expected in capsys.readouterr().out


def test_a_scenario_in_one_record_only_fails_the_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    more = {**_sample(), "fabric": {"run": {"losses": [1.0]}}}
    assert B.compare(_record(tmp_path / "a.pt", _sample()), _record(tmp_path / "b.pt", more)) == 1
    assert "scenarios in one record only: ['fabric']" in capsys.readouterr().out


def test_the_sgd_and_lion_scenario_repeats_to_the_bit() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as record() runs it
    try:
        first, second = B.scenario_momentum(), B.scenario_momentum()
    finally:
        torch.set_num_threads(before)
    assert len(first) == 2 * 2 * 4  # eager and compiled, SGD and Lion, four momentum formats
    assert not [d for key in first for d in B._differences(first[key], second[key], key)]
