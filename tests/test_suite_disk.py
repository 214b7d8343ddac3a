"""The suite cleans up after itself: a whole run writes ~6 GB of outputs under pytest's temp
folder, and CI shares its disk with earlier runs (a /tmp left with 1.5 GB free failed it once).
A passing test's folder goes as the test ends; only the last run's folders are kept."""

from __future__ import annotations


def test_a_passing_tests_folder_goes_and_one_run_is_kept(pytestconfig):
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
    assert int(pytestconfig.getini("tmp_path_retention_count")) == 1


_LEFT = []


def test_a_folder_written_by_a_passing_test(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * 1024)
    _LEFT.append(tmp_path)


def test_is_gone_once_it_passed():
    # runs after the one above: pytest keeps file order, and --dist loadfile one file per worker
    assert _LEFT and not _LEFT[0].exists()
