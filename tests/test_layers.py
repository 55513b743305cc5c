"""The house's structure, checked: imports run one way between layers (wire <- model <- engine <-
service <- nodes <- cli), no two files of the project import each other in a cycle (imports inside
functions included), the router never imports torch, and no installed distribution other than
pd ships a top-level package of one of pd's names.

Layers, lowest first (a file may import its own layer and those below):
  0 wire     pd.config, pd.wire, pd.text            torch-free types every process shares
  1 model    pd.model, pd_kernels, pd.testing       the network, its kernels, test checkpoints
  2 engine   pd.engine, pd.spec                     running the model over requests
  3 service  pd.service, shm_ipc                    node process parts, the KV transport
  4 nodes    prefill_node, decode_node, router      the services
  5 cli      pd.cli                                 the `pd` command
`pd/__init__.py` (the package facade, lazy) and `__main__` files are outside the layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pd", "prefill_node", "decode_node", "router", "shm_ipc", "pd_kernels")
LAYERS = [
    ("wire", ("pd.config", "pd.wire", "pd.text")),
    ("model", ("pd.model", "pd_kernels", "pd.testing")),
    ("engine", ("pd.engine", "pd.spec")),
    ("service", ("pd.service", "shm_ipc")),
    ("nodes", ("prefill_node", "decode_node", "router")),
    ("cli", ("pd.cli",)),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: Path, module_level_only: bool) -> set[str]:
    """Project modules `path` imports (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    known = project_modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import) and (top or not module_level_only):
                for alias in child.names:
                    found.add(resolve(alias.name))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module \
                    and (top or not module_level_only):
                base = child.module
                for alias in child.names:
                    found.add(resolve(f"{base}.{alias.name}") or resolve(base))
            elif isinstance(child, ast.ImportFrom) and child.level > 0 \
                    and (top or not module_level_only):
                pkg = module_name(path).split(".")
                if path.name != "__init__.py":
                    pkg = pkg[:-1]
                base = ".".join(pkg[:len(pkg) - child.level + 1] + ([child.module] if child.module else []))
                for alias in child.names:
                    found.add(resolve(f"{base}.{alias.name}") or resolve(base))
            visit(child, inner)

    visit(tree, True)
    found.discard(None)
    found.discard(module_name(path))
    return {m for m in found if m is not None}


def test_no_import_from_a_lower_layer_to_a_higher_one():
    wrong = []
    for module, path in project_modules().items():
        if module == "pd" or module.endswith("__main__"):
            continue
        rank = layer_of(module)
        assert rank is not None, f"{module} is in no layer: add it to LAYERS"
        for target in imports(path, module_level_only=False):
            target_rank = layer_of(target)
            if target_rank is not None and target_rank > rank:
                wrong.append(f"{module} ({LAYERS[rank][0]}) imports {target} "
                             f"({LAYERS[target_rank][0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_files():
    # NOTE: imports inside functions count too: a factory importing its implementations while
    # they import the factory's module is two files importing each other all the same
    graph = {m: imports(p, module_level_only=False) for m, p in project_modules().items()}
    # a package's __init__ is loaded by any import of its modules: not an edge of its own
    graph = {m: {t for t in ts if not (ROOT / t.replace(".", "/") / "__init__.py").exists()}
             for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                walk(nxt, stack + [node])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    assert not cycles, "\n".join(cycles)


def test_the_router_process_imports_no_torch():
    code = ("import sys; import router.command, router.main, router.server, router.zmq_backend; "
            "from pd.cli.main import build_parser; build_parser('router'); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_the_layer_table_covers_every_package():
    for module in project_modules():
        if module != "pd" and not module.endswith("__main__"):
            assert layer_of(module) is not None, module


def test_no_installed_distribution_shares_a_package_name():
    """A top-level package of pd's named like one another distribution installs is shadowed by
    it or shadows it: transformers 5.25 pulled in Hugging Face's `kernels`, and the folder of
    this project's kernels, then called `kernels`, made `import transformers`' model code fail
    (and a pip install of both would have written one over the other)."""
    from importlib.metadata import packages_distributions

    shipped = packages_distributions()
    others = {name: sorted(set(shipped.get(name, ())) - {"pd"}) for name in PACKAGES}
    assert not any(others.values()), others
