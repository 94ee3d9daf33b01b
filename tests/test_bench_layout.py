"""The benchmarks' layout holds: no import circle among their modules (lazy, type-checking and
by-name imports included), no module over 500 lines, the offline dump report and the ideal's
arithmetic import no Celery (nor Redis), celery_redsem's internal wait header is read in one
module only, and no module builds a workers' app on import but the workers' own entry points.
No server needed.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.celery_e2e.app import ENV_URL, WorkerConfig
from benchmarks.rate.app import worker_environ

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "benchmarks"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(name: str) -> set[str]:
    """Every dotted name module ``name`` imports, anywhere in it (at the top, in functions,
    under ``TYPE_CHECKING``), absolute: ``from a.b import c`` gives ``a.b.c``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _benchmark_modules(dotted: str) -> set[str]:
    """The benchmarks modules importing ``dotted`` runs: its longest prefix that is one, and
    the packages above it (their ``__init__`` runs first)."""
    parts = dotted.split(".")
    prefixes = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return prefixes & MODULES.keys()


def imports_of(name: str) -> set[str]:
    """The benchmarks modules ``name`` imports: by any import statement, and by name as a string
    (a worker's ``celery -A benchmarks....``, ``importlib.import_module``)."""
    targets: set[str] = set()
    for dotted in imported_names(name):
        targets |= _benchmark_modules(dotted)
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    targets.update(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in MODULES
    )
    own_packages = {".".join(name.split(".")[:n]) for n in range(1, name.count(".") + 1)}
    return targets - {name} - own_packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle in ``graph`` as ``[a, b, ..., a]``, or None if it has none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def _fresh_interpreter(code: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_import_graph_reads_lazy_and_by_name_imports():
    assert "benchmarks.celery_e2e.ideal" in imports_of("benchmarks.celery_e2e.dump_report")
    assert "benchmarks.celery_e2e.app" in imports_of("benchmarks.celery_e2e.worker")
    # the workers' `celery -A benchmarks.celery_e2e.worker`, a string
    assert "benchmarks.celery_e2e.worker" in imports_of("benchmarks.celery_e2e.harness")
    assert "benchmarks.rate.worker" in imports_of("benchmarks.rate.__main__")


def test_no_import_circle_among_the_benchmarks_modules():
    graph = {name: imports_of(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_benchmarks_module_is_over_500_lines():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in MODULES.values()
    }
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}


def test_the_dump_report_and_the_ideal_import_no_celery_nor_redis():
    code = (
        "import sys\n"
        "import benchmarks.celery_e2e.dump_report, benchmarks.celery_e2e.ideal\n"
        "heavy = ('celery', 'kombu', 'redis', 'celery_redsem')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    assert _fresh_interpreter(code) == "[]"


def test_the_benchmarks_use_no_module_of_the_celery_integration():
    """They read what a task author can (``celery_redsem.contention_retries``), not the
    integration's internals, which move."""
    readers = {
        name
        for name in MODULES
        if any(n.startswith("celery_redsem.integration") for n in imported_names(name))
    }
    assert readers == set()


def test_only_the_workers_entry_points_build_an_app_on_import():
    """With a worker's environment set, importing every other module builds no app; importing
    the workers' entry points builds theirs from it."""
    others = sorted(n for n in MODULES if n.rpartition(".")[2] not in ("worker", "__main__"))
    url = "redis://127.0.0.1:1/0"  # (nothing connects to it)
    env = {**WorkerConfig(url, url, "p", 2, "t").environ(), **worker_environ(url, url, "p", 20)}
    code = (
        "import importlib\n"
        "from celery._state import _get_active_apps\n"
        "def built():\n"
        "    return sorted(a.main for a in _get_active_apps() if a.main != 'default')\n"
        f"for name in {others!r}:\n"
        "    importlib.import_module(name)\n"
        "print(built())\n"
        "import benchmarks.celery_e2e.worker, benchmarks.rate.worker\n"
        "print(built())\n"
    )
    before, after = _fresh_interpreter(code, env).splitlines()
    assert before == "[]"
    assert after == "['bench_rate', 'redsembench']"


def test_the_workers_config_goes_through_the_environment_unchanged():
    config = WorkerConfig(
        url="redis://results/0",
        broker_url="amqp://broker//",
        prefix="redsem-bench-1",
        limit=3,
        tag="fair-plain",
        naive_countdown=0.25,
        settings={"redsem_worker_admission": False},
        stamps=True,
    )
    environ = config.environ()
    assert json.loads(environ["REDSEM_BENCH_SETTINGS"]) == config.settings
    assert WorkerConfig.from_environ(environ) == config
    no_broker = {**environ, "REDSEM_BENCH_BROKER_URL": ""}
    assert WorkerConfig.from_environ(no_broker).broker_url == environ[ENV_URL]
