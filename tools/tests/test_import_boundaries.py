"""Services import only libs/ (rlserve.core, rlserve.v1) and themselves, never each other."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (REPO / "services").iterdir() if (p / "pyproject.toml").exists())
LIB_PACKAGES = {"rlserve.core", "rlserve.v1"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from rlserve import critic` names the package in the alias.
            if node.module == "rlserve":
                found += [(node.lineno, f"rlserve.{alias.name}") for alias in node.names]
    return found


def boundary_violations(service: str, root: Path) -> list[str]:
    allowed = LIB_PACKAGES | {f"rlserve.{service}"}
    violations = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "rlserve" or len(parts) < 2:
                continue
            if ".".join(parts[:2]) not in allowed:
                violations.append(f"{path.relative_to(root)}:{line} imports {module}")
    return violations


def test_services_are_found():
    assert {"rollout", "critic", "reference", "reward", "trainer"} <= set(SERVICES)


def test_services_import_only_libs():
    violations = []
    for service in SERVICES:
        violations += boundary_violations(service, REPO / "services" / service)
    assert not violations, "services may import only rlserve.core / rlserve.v1:\n" + "\n".join(
        violations
    )


def test_libs_import_no_service():
    # Checked as if libs were a service named "core": only rlserve.core / rlserve.v1 pass.
    violations = boundary_violations("core", REPO / "libs")
    assert not violations, "\n".join(violations)


def test_checker_catches_a_cross_service_import(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import rlserve.core.batch\nfrom rlserve.critic import engine\nfrom rlserve import reward\n"
    )
    found = boundary_violations("rollout", tmp_path)
    assert [v.rsplit(" ", 1)[1] for v in found] == ["rlserve.critic", "rlserve.reward"]
