"""The suite's own layout: a helper module is imported one way, by its package path
(``from tests.hooks._loss_models import ...``), never by its bare name (``from
_loss_models import ...``, which works only because pytest puts a test's folder on
``sys.path``): two names would load the module twice, as two sets of classes. And the
package's own layout: no import cycles, between modules or between folders."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
BARE = re.compile(r"^[ \t]*(?:from[ \t]+_(?!_)\w*[ \t]+import|import[ \t]+_(?!_)\w*)", re.MULTILINE)


def test_helpers_are_imported_by_their_package_path():
    bare = {
        str(path.relative_to(TESTS.parent)): BARE.findall(path.read_text())
        for path in TESTS.rglob("*.py")
        if BARE.search(path.read_text())
    }
    assert not bare, bare


# -- no import cycles ------------------------------------------------------------------
# Every import counts: at module level, inside a function (a local import that hides a
# cycle from the interpreter hides it from no reader) and under TYPE_CHECKING. A module
# that needs what another offers and is needed back asks for a protocol or a parameter
# instead. The folders (trainvitals.<folder>) may not import each other round either.

PACKAGES = ("hooks", "monitor", "alerts", "wire", "audit", "demo", "errors")

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that exist and are being removed: an entry goes when its cycle does."""


def _import_graph() -> tuple[Any, dict[str, set[str]]]:
    import grimp  # the [test] extra

    graph = grimp.build_graph(*(f"trainvitals.{p}" for p in PACKAGES), cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    return graph, edges


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    import networkx as nx

    digraph = nx.DiGraph([(a, b) for a, targets in edges.items() for b in targets if a != b])
    return [frozenset(c) for c in nx.strongly_connected_components(digraph) if len(c) > 1]


def _one_loop(graph: Any, cycle: frozenset[str]) -> str:
    """One way round ``cycle``, each step with the import line that makes it."""
    start = min(cycle)
    step = min(m for m in graph.find_modules_directly_imported_by(start) if m in cycle)
    chain = [start, *graph.find_shortest_chain(importer=step, imported=start)]
    lines = []
    for a, b in itertools.pairwise(chain):
        detail = graph.get_import_details(importer=a, imported=b)[0]
        lines.append(f"  {a}:{detail['line_number']} {detail['line_contents'].strip()}")
    return "\n".join(lines)


def test_no_module_imports_itself_round():
    graph, edges = _import_graph()
    cycles = _cycles(edges)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n\n".join(_one_loop(graph, c) for c in new)
    gone = [KNOWN_CYCLES[c] for c in KNOWN_CYCLES if c not in cycles and not c.isdisjoint(edges)]
    assert not gone, f"no longer cycles, take them out of KNOWN_CYCLES: {gone}"


def test_no_folder_imports_itself_round():
    _, edges = _import_graph()
    folders: dict[str, set[str]] = {}
    for a, targets in edges.items():
        folders.setdefault(a.split(".")[1], set()).update(b.split(".")[1] for b in targets)
    cycles = _cycles(folders)
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"folders that import each other (module cycles above name the lines): {new}"
    gone = [KNOWN_CYCLES[c] for c in KNOWN_CYCLES if c not in cycles and c <= set(PACKAGES)]
    assert not gone, f"no longer cycles, take them out of KNOWN_CYCLES: {gone}"


# -- no module reads another's private attributes -------------------------------------
# ``obj._name`` outside ``self``/``cls`` is allowed only for a name the module defines
# itself (its own classes' attributes and methods): what a module needs of another is
# that module's public interface, a parameter or a Protocol.

TORCH_INTERNALS = {"_version", "_use_count"}
"""Tensor internals read on purpose: autograd's in-place counter, a storage's user count."""

KNOWN_PRIVATE_READS: set[tuple[str, str]] = set()
"""Reads that exist and are being removed: an entry goes when its read does."""


def _private_reads(path: Path) -> list[tuple[int, str, str]]:
    tree = ast.parse(path.read_text())
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "torch", "sys"):
            continue  # its own; torch's fused ops (torch._foreach_*), sys._getframe
        if node.attr in own or node.attr in TORCH_INTERNALS:
            continue
        found.append((node.lineno, ast.unparse(node), node.attr))
    return found


def test_no_module_reads_another_modules_private_attributes():
    root = TESTS.parent
    reads = {
        (str(path.relative_to(root)), attr): f"{path.relative_to(root)}:{line}: {text}"
        for folder in PACKAGES
        for path in sorted((root / folder).rglob("*.py"))
        for line, text, attr in _private_reads(path)
    }
    new = sorted(where for key, where in reads.items() if key not in KNOWN_PRIVATE_READS)
    assert not new, "private attributes read from another module:\n" + "\n".join(new)
    gone = KNOWN_PRIVATE_READS - set(reads)
    assert not gone, f"no longer read, take them out of KNOWN_PRIVATE_READS: {sorted(gone)}"
