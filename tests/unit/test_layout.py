"""The test folders say what a test needs: tests/e2e/ starts daemons or engines (marked e2e, which
scripts/test.sh selects on), tests/unit/ does not. tests/conftest.py refuses a test whose mark and folder disagree."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

TESTS = Path(conftest.__file__).resolve().parent


def item(folder: str, e2e: bool) -> SimpleNamespace:
    return SimpleNamespace(path=TESTS / folder / "test_x.py", nodeid=f"tests/{folder}/test_x.py::t",
                           get_closest_marker=lambda name: object() if e2e and name == "e2e" else None)


@pytest.mark.parametrize("folder, e2e", [("unit", True), ("e2e", False)])
def test_a_mark_in_the_wrong_folder_is_refused(folder, e2e):
    with pytest.raises(pytest.UsageError, match=f"tests/{folder}/test_x.py::t"):
        conftest.pytest_collection_modifyitems(None, [item(folder, e2e)])


def test_marks_in_their_folders_pass():
    items = [item("unit", False), item("e2e", True)]
    conftest.pytest_collection_modifyitems(None, items)


def test_every_test_module_is_in_one_of_the_two_folders():
    assert not list(TESTS.glob("test_*.py"))
    assert {p.parent.name for p in TESTS.rglob("test_*.py")} == {"unit", "e2e"}
