"""The suite's own layout: a helper module is imported one way, by its package path
(``from tests.hooks._loss_models import ...``), never by its bare name (``from
_loss_models import ...``, which works only because pytest puts a test's folder on
``sys.path``): two names would load the module twice, as two sets of classes."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BARE = re.compile(r"^[ \t]*(?:from[ \t]+_(?!_)\w*[ \t]+import|import[ \t]+_(?!_)\w*)", re.MULTILINE)


def test_helpers_are_imported_by_their_package_path():
    bare = {
        str(path.relative_to(TESTS.parent)): BARE.findall(path.read_text())
        for path in TESTS.rglob("*.py")
        if BARE.search(path.read_text())
    }
    assert not bare, bare
