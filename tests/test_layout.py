"""The package's layout holds: the core (and the asyncio package) imports without Celery, no
import circle among the package's modules (lazy and type-checking imports included), no module
over 500 lines, and each :class:`Lock` takes exactly its :class:`FairSemaphore`'s options. No
server needed.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import redis

from celery_redsem.asyncio import FairSemaphore as AsyncFairSemaphore
from celery_redsem.asyncio import Lock as AsyncLock
from celery_redsem.core.semaphore import FairSemaphore, Lock, SemaphoreOptions
from celery_redsem.core.semaphore_spec import COMMON_DEFAULTS, CommonOptions

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_redsem"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _package_module(dotted: str) -> str | None:
    """The package module that importing ``dotted`` runs (its longest prefix that is one)."""
    parts = dotted.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


def imports_of(name: str) -> set[str]:
    """The package modules ``name`` imports anywhere: at the top, in functions, under
    ``TYPE_CHECKING``, and by name as a string (``importlib.import_module``, lazy loaders)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(_package_module(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                targets.add(_package_module(f"{base}.{alias.name}"))
        elif isinstance(node, ast.Constant) and node.value in MODULES:
            targets.add(node.value)
    return {target for target in targets if target is not None and target != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle in ``graph`` as ``[a, b, ..., a]``, or None if it has none."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


#: Packages that must work without Celery: the core, and the asyncio semaphore built on it.
CELERY_FREE = ("celery_redsem.core", "celery_redsem.asyncio")


def test_the_core_imports_without_celery():
    core = sorted(name for name in MODULES if name.startswith(CELERY_FREE))
    assert "celery_redsem.asyncio.semaphore" in core
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'celery' or m.startswith('celery.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing the core imported {result.stdout.strip()}"


def test_the_core_imports_only_the_core():
    """So the top-level package's eager imports (all core) never lead back to it or to the
    Celery wing: its lazy loader cannot close a circle while the package is half loaded."""
    outside = {
        name: sorted(t for t in imports_of(name) if not t.startswith("celery_redsem.core"))
        for name in MODULES
        if name.startswith("celery_redsem.core")
    }
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_asyncio_package_imports_only_itself_and_the_core():
    outside = {
        name: sorted(t for t in imports_of(name) if not t.startswith(CELERY_FREE))
        for name in MODULES
        if name.startswith("celery_redsem.asyncio")
    }
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_import_graph_reads_lazy_and_type_checking_imports():
    assert "celery_redsem.integration.settings" in imports_of("celery_redsem")  # lazy loader
    assert "celery_redsem.core.semaphore" in imports_of("celery_redsem")


def test_no_import_circle_among_the_packages_modules():
    graph = {name: imports_of(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_500_lines():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in MODULES.values()
    }
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}


def test_lock_takes_exactly_the_semaphores_options():
    def keyword_only(function: typing.Callable[..., object]) -> list[str]:
        params = inspect.signature(function).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]

    options = typing.get_type_hints(SemaphoreOptions)
    hints = typing.get_type_hints(FairSemaphore.__init__)
    assert list(options) == keyword_only(FairSemaphore.__init__)
    assert options == {name: hints[name] for name in options}
    lock_params = list(inspect.signature(Lock.__init__).parameters)
    assert lock_params == ["self", "client", "name", "options"]


def test_the_asyncio_semaphore_and_lock_take_the_common_options():
    def keyword_only(function: typing.Callable[..., object]) -> list[str]:
        params = inspect.signature(function).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]

    options = typing.get_type_hints(CommonOptions)
    assert list(options) == [n for n in SemaphoreOptions.__annotations__ if n in options]
    sync_defaults = inspect.signature(FairSemaphore.__init__).parameters
    assert {n: sync_defaults[n].default for n in options} == COMMON_DEFAULTS
    params = ["self", "client", "name", "limit", "options"]
    assert list(inspect.signature(AsyncFairSemaphore.__init__).parameters) == params
    assert list(inspect.signature(AsyncLock.__init__).parameters) == params[:3] + params[4:]


def test_lock_passes_each_option_on():
    def clock() -> float:
        return 0.0

    lock = Lock(
        redis.Redis(),
        "report",
        lease=7,
        waiter_lease=3,
        idle_ttl=9,
        prefix="p",
        clock=clock,
        min_replicas=0,
        replica_timeout=0.25,
    )
    assert (lock.limit, lock.lease, lock.waiter_lease, lock.idle_ttl) == (1, 7.0, 3.0, 9.0)
    assert (lock.keys.prefix, lock.min_replicas, lock.replica_timeout) == ("p", 0, 0.25)
    assert lock._clock is clock


def _keyword_only(function: typing.Callable[..., object]) -> list[str]:
    params = inspect.signature(function).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def test_with_semaphore_takes_exactly_the_guard_options_and_with_lock_passes_them_on():
    from celery_redsem import with_lock, with_semaphore
    from celery_redsem.integration.guards.semaphore_guard import GuardOptions

    assert _keyword_only(with_semaphore) == list(typing.get_type_hints(GuardOptions))
    assert list(inspect.signature(with_lock).parameters) == ["key", "options"]
    decorator: typing.Any = with_lock("k", lease=7.0, on_busy="skip", dedupe=True)
    assert decorator.options == {
        "limit": 1,
        "key": "k",
        "lease": 7.0,
        "max_wait": None,
        "lost_lease_policy": None,
        "on_busy": "skip",
        "dedupe": True,
        "debounce": None,
        "debounce_max": None,
        "fair_by": None,
        "weight": 1,
        "group_limit": None,
    }


def test_every_attempt_takes_exactly_the_attempt_options():
    from celery_redsem.core.semaphore_spec import AttemptOptions

    options = list(typing.get_type_hints(AttemptOptions))
    assert _keyword_only(FairSemaphore.attempt) == options
    for variadic in (AsyncFairSemaphore.attempt, FairSemaphore.attempt_command):
        assert list(inspect.signature(variadic).parameters)[-1] == "options"


# -- the integration wing, room by room ---------------------------------------------------------

#: Celery's and kombu's private names, which only the seam may use.
CELERY_PRIVATE = (
    "_waiting",
    "_process_task",
    "_process_task_sem",
    "_quick_release",
    "_get_active_apps",
    "connect_on_app_finalize",
    "outbound_buffer",
    "_pop_ready",
    "maybe_restore_messages",
    "_paused_brpop",
)
SEAM = "celery_redsem.integration.seam"
#: redis-py's private names, allowed in at most one module.
REDIS_PRIVATE = ("_sock",)


def names_used(name: str) -> set[str]:
    """The identifiers module ``name`` uses in code (attributes, names, imported names, and
    strings that are not docstrings)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found.add(node.value)
    return found


def test_celery_and_kombu_private_names_are_used_in_the_seam_only():
    users = {
        name: set(names_used(name) & set(CELERY_PRIVATE))
        for name in MODULES
        if names_used(name) & set(CELERY_PRIVATE)
    }
    outside = [name for name in users if name != SEAM and not name.startswith(f"{SEAM}.")]
    assert outside == [], users
    assert set().union(*users.values()) == set(CELERY_PRIVATE)  # (the scan sees them all)


def test_redis_py_private_names_are_used_in_one_module_at_most():
    users = [name for name in MODULES if names_used(name) & set(REDIS_PRIVATE)]
    assert len(users) <= 1, users


def longest_chain(graph: dict[str, set[str]], within: str) -> list[str]:
    """The longest chain of imports among the modules of ``graph`` under ``within``."""
    memo: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in memo:
            below = [chain(n) for n in sorted(graph[node]) if n.startswith(within)]
            memo[node] = [node, *max(below, key=len, default=[])]
        return memo[node]

    return max((chain(n) for n in graph if n.startswith(within)), key=len)


def test_import_chains_are_short():
    graph = {name: imports_of(name) for name in MODULES}
    wing = longest_chain(graph, "celery_redsem.integration")
    assert len(wing) <= 6, " -> ".join(wing)
    package = longest_chain(graph, "celery_redsem")
    assert len(package) <= 12, " -> ".join(package)


def test_longest_chain_counts_modules():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c", "q.x"}, "p.c": set(), "q.x": set()}
    assert longest_chain(graph, "p") == ["p.a", "p.b", "p.c"]


def test_no_folder_of_the_integration_wing_holds_more_than_12_modules():
    folders = {}
    for path in (PACKAGE / "integration").rglob("*.py"):
        folder = str(path.parent.relative_to(PACKAGE))
        folders[folder] = folders.get(folder, 0) + 1
    assert {f: n for f, n in folders.items() if n > 12} == {}
    assert len(folders) >= 5  # (the rooms are there to be counted)


def test_the_decorators_load_no_worker_side_module():
    """A process that only imports tasks and sends them (a web process) loads the guards, not
    admission or the worker's hooks: those load at worker_init."""
    code = (
        "import sys\n"
        "import celery_redsem\n"
        "from celery_redsem import with_lock, with_rate_limit, with_semaphore\n"
        "with_lock(key='k')(lambda: None)\n"
        "with_semaphore(2, key='k', dedupe=True)(lambda: None)\n"
        "with_rate_limit('1/s', key='k')(lambda: None)\n"
        "prefixes = ('celery_redsem.integration.admission', 'celery_redsem.integration.worker')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


MAP = ROOT / "tests" / "README.md"


def test_the_tests_map_lists_every_module_and_only_test_files_that_exist():
    rows = [
        line.split("|")[1:3]
        for line in MAP.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `")
    ]
    listed = {cell.strip().strip("`") for cell, _tests in rows}

    def covered(name: str) -> bool:
        return name in listed or any(
            entry.endswith(".*") and name.startswith(entry[:-1]) for entry in listed
        )

    modules = {n for n in MODULES if MODULES[n].name != "__init__.py" or n == "celery_redsem"}
    assert {name for name in modules if not covered(name)} == set()
    named = {t.strip().strip("`") for _cell, tests in rows for t in tests.split(",")}
    assert {t for t in named if not (ROOT / "tests" / t).exists()} == set()
