"""The rooms stay as docs/design.md draws them: no two rooms import each other, the core imports
neither the DeepSpeed facade nor the test helpers, and no file grows past about 600 lines."""
import ast
from collections import defaultdict
from pathlib import Path

ZERO = Path(__file__).resolve().parents[1] / "zero"
MAX_LINES = 620  # "about 600": a file past this is split by topic


def _room(module: str) -> str:
    """`zero.stages.buckets` -> "stages"; a module at zero's root is a room of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "zero"


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> where, for every import of zero's own code, at module
    level or inside a function (a lazy import is still a dependency), outside TYPE_CHECKING."""
    found = defaultdict(list)
    for path in ZERO.rglob("*.py"):
        module = ".".join(p for p in path.relative_to(ZERO.parent).with_suffix("").parts if p != "__init__")
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.dump(block.test) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero") and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("zero")]
            else:
                continue
            for target in targets:
                if _room(target) != _room(module) and _room(target) != "zero":
                    found[(_room(module), _room(target))].append(f"{path.relative_to(ZERO.parent)}:{node.lineno}")
    return found


def test_no_two_rooms_import_each_other():
    imports = _imports()
    both = sorted({tuple(sorted(pair)) for pair in imports if pair[::-1] in imports})
    assert not both, "; ".join(f"{a} <-> {b}: {imports[(a, b)][:2]} and {imports[(b, a)][:2]}" for a, b in both)


def test_the_core_imports_neither_the_facade_nor_the_test_helpers():
    imports = _imports()
    for room in ("deepspeed", "testing"):
        users = {src: where for (src, dst), where in imports.items() if dst == room and src not in ("deepspeed", "testing")}
        assert not users, f"zero.{room} imported by the core: {users}"


def test_no_file_grows_past_about_600_lines():
    long = {str(p.relative_to(ZERO.parent)): n for p in ZERO.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by topic: {long}"
