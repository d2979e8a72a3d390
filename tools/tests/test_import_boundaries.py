"""Services import only libs/ (rlserve.core, rlserve.v1) and themselves, never each other;
only the trainer imports the run config."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (REPO / "services").iterdir() if (p / "pyproject.toml").exists())
LIB_PACKAGES = {"rlserve.core", "rlserve.v1"}
# The run config is the trainer's: a service's config is its settings
# (rlserve.core.worker_settings, reward_settings) plus its deployment (service_config), and
# what the services build on in libs (serving, rpc, tracing) sits below the run config.
RUN_CONFIG = "rlserve.core.run_config"


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


def run_config_importers(root: Path) -> list[str]:
    """Modules under `root`, tests left out, that import the run config."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "tests" in relative.parts or path.name == "run_config.py":
            continue
        for line, module in imported_modules(path):
            if module == RUN_CONFIG or module.startswith(RUN_CONFIG + "."):
                found.append(f"{relative}:{line} imports {module}")
        # `from rlserve.core import run_config` names the module in the alias.
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "rlserve.core"
                and any(alias.name == "run_config" for alias in node.names)
            ):
                found.append(f"{relative}:{node.lineno} imports {RUN_CONFIG}")
    return found


def test_only_the_trainer_imports_the_run_config():
    roots = [REPO / "libs"] + [REPO / "services" / s for s in SERVICES if s != "trainer"]
    violations = [v for root in roots for v in run_config_importers(root)]
    assert not violations, (
        "only the trainer may import rlserve.core.run_config (services take their settings "
        "from rlserve.core.worker_settings / reward_settings):\n" + "\n".join(violations)
    )


def test_run_config_checker_catches_both_import_forms(tmp_path):
    (tmp_path / "a.py").write_text("from rlserve.core.run_config import RunConfig\n")
    (tmp_path / "b.py").write_text("from rlserve.core import run_config\n")
    assert [v.split(":")[0] for v in run_config_importers(tmp_path)] == ["a.py", "b.py"]
