"""Imports point one way: down the layers documented in docs/architecture.md ("Layers").

Every import of our own code is checked, wherever it is written (module top, inside a function, or
under TYPE_CHECKING: a deferred import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("config", "bus", "supervisors", "actors", "deploy")

# Bottom to top. A module may import its own unit and any unit of a lower layer; units that share a
# layer are siblings and import only each other's wire contracts (see CONTRACT).
LAYERS: list[tuple[str, ...]] = [
    ("config",),                                             # topology schema, loader, secrets, paths
    ("bus",),                                                # NATS plumbing, no LLM knowledge
    ("supervisors",),                                        # the OTP runtime, knows no actors
    ("actors.base", "actors.models", "actors.instances"),   # actor lifecycle, registry records, tiny model
    ("actors.engines",),                                     # engine protocol and implementations
    ("actors.kv",),                                          # router block hashing, event translation
    ("actors.router", "actors.worker"),                      # KV routing; what runs in a worker process
    ("actors.frontend", "actors.echo", "actors.planner"),    # actors that call workers
    ("deploy", "actors.supervisor"),                         # deployment assembly, the CLI (and its alias)
]
# A wire contract (an actor package's ``contract`` module) is the shared language of callers and
# responders: any actor may import one; a contract itself imports only lower layers.
CONTRACT = "contract"
# ``python -m actors.supervisor`` is the documented command; the module only hands over to deploy.cli.
ENTRY_ALIASES = {"actors.supervisor": "deploy.cli"}


def unit_of(module: str) -> str:
    for layer in LAYERS:
        for unit in layer:
            if module == unit or module.startswith(unit + "."):
                return unit
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS and docs/architecture.md")


def layer_of(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import mod`` imports pkg.mod when that is a module
            for a in node.names:
                sub = f"{target}.{a.name}"
                as_module = ROOT.joinpath(*sub.split(".")).with_suffix(".py").exists() or \
                    ROOT.joinpath(*sub.split("."), "__init__.py").exists()
                found.append((node.lineno, sub if as_module else target))
    return [(line, t) for line, t in found if t.split(".")[0] in PACKAGES]


def is_contract(module: str) -> bool:
    return module.rpartition(".")[2] == CONTRACT


def violation(src: str, dst: str) -> str | None:
    if ENTRY_ALIASES.get(src) == dst:
        return None
    su, du = unit_of(src), unit_of(dst)
    if su == du:
        return None
    sl, dl = layer_of(su), layer_of(du)
    if is_contract(src) and dl >= sl and not is_contract(dst):
        return "a contract imports only lower layers and other contracts"
    if dl < sl:
        return None
    if is_contract(dst) and su.startswith("actors.") and (not is_contract(src) or dl <= sl):
        return None
    return f"{su} (layer {sl}) may not import {du} (layer {dl})"


def all_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_every_import_points_down_the_layers() -> None:
    bad: list[str] = []
    for path, module in all_modules():
        for line, target in imports_of(path, module):
            why = violation(module, target)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}: {why}")
    assert not bad, "imports that point up the layering:\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    for _, module in all_modules():
        if module in PACKAGES:
            continue
        unit_of(module)


def test_the_checker_catches_an_upward_import() -> None:
    # the rules themselves: these are the knots this layering removed
    assert violation("bus.connection", "config.topology") is None
    assert violation("bus.connection", "supervisors.child") is not None
    assert violation("supervisors.supervisor", "actors.frontend.actor") is not None
    assert violation("actors.router.feed", "actors.worker.contract") is None
    assert violation("actors.router.feed", "actors.worker.serving") is not None
    assert violation("actors.worker.contract", "actors.worker.serving") is None  # same unit
    assert violation("actors.kv.contract", "actors.router.kv_router") is not None
    assert violation("actors.supervisor", "deploy.cli") is None
    assert violation("actors.frontend.app", "deploy.cli") is not None
