"""The house rules of the package layout, checked on the source (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from saorl.algo.registry import AlgoPreset
from saorl.config import NOT_IN_CONFIG, AlgoConfig

SAORL = Path(__file__).resolve().parent.parent / "saorl"


def _modules(package: str) -> list[Path]:
    return sorted((SAORL / package).rglob("*.py")) if (SAORL / package).is_dir() else [SAORL / package]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in ``path``, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_only_the_cli_imports_commands():
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL).as_posix()
        if rel == "cli.py" or rel.startswith("commands/"):
            continue
        bad = [m for m, _ in _imports(path) if m.startswith("saorl.commands")]
        assert not bad, f"saorl/{rel} imports {bad}"


@pytest.mark.parametrize("package, forbidden", [
    ("runtime", ("saorl.stages", "saorl.commands", "saorl.training", "saorl.bench", "saorl.experiments")),
    ("stages", ("saorl.commands", "saorl.training", "saorl.bench", "saorl.experiments")),
    ("data", ("saorl.",)),
    ("models", ("saorl.engines", "saorl.runtime", "saorl.stages", "saorl.commands", "saorl.training",
                "saorl.agent", "saorl.envs")),
    ("envs", ("saorl.engines", "saorl.runtime", "saorl.stages", "saorl.commands", "saorl.training",
              "saorl.agent", "saorl.models", "saorl.bench", "saorl.experiments")),
    ("agent", ("saorl.runtime", "saorl.stages", "saorl.commands", "saorl.training", "saorl.bench",
               "saorl.experiments")),
    ("engines", ("saorl.runtime", "saorl.stages", "saorl.commands", "saorl.training", "saorl.agent",
                 "saorl.envs", "saorl.bench", "saorl.experiments")),
])
def test_imports_point_one_way(package, forbidden):
    for path in _modules(package):
        own = f"saorl.{package}"
        bad = [m for m, _ in _imports(path) if m.startswith(forbidden) and not m.startswith(own)]
        assert not bad, f"{path.relative_to(SAORL)} imports {bad}"


def _module_graph() -> dict[str, set[str]]:
    """saorl module → the saorl modules it imports, function-level imports included; ``from pkg
    import sub`` counts as an import of ``pkg.sub`` only (not of ``pkg/__init__``)."""
    names = {}
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL.parent).with_suffix("").as_posix().replace("/", ".")
        names[rel.removesuffix(".__init__")] = path
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in names]
                out |= set(subs) if len(subs) == len(node.names) else {base, *subs}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        graph[name] = {m for m in out if m in names and m != name}
    return graph


def test_no_import_cycle_even_through_function_level_imports():
    """A function-level import hides a cycle from Python, not from a reader: none is allowed."""
    graph = _module_graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_algo_imports_only_torch_and_the_standard_library():
    """The math imports torch alone; the presets (no torch) are pydantic models like the config."""
    allowed = set(sys.stdlib_module_names) | {"torch", "saorl"}
    for path in _modules("algo"):
        for module, _ in _imports(path):
            top = module.split(".")[0]
            ok = top in allowed or (path.name == "presets.py" and top == "pydantic")
            assert ok, f"{path.relative_to(SAORL)} imports {module}"
            assert top != "saorl" or module.startswith("saorl.algo"), f"{path.relative_to(SAORL)}: {module}"


@pytest.mark.parametrize("package", ["bench", "experiments"])
def test_tooling_uses_no_private_name_of_another_package(package):
    attr = re.compile(r"(?<![\w.])(?!self\b|cls\b)(\w+)\._[a-z]\w*")
    for path in _modules(package):
        for module, names in _imports(path):
            if module.startswith("saorl.") and not module.startswith(f"saorl.{package}"):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path.relative_to(SAORL)} imports {private} from {module}"
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in attr.finditer(code):
                assert m.group(1) in {"os", "sys"}, f"{path.relative_to(SAORL)}:{lineno}: {line.strip()}"


def test_each_algorithm_setting_is_declared_once():
    preset_fields = set(AlgoPreset.model_fields)
    assert set(AlgoConfig.model_fields) == {"name"} | (preset_fields - set(NOT_IN_CONFIG))
    config_src = "\n".join(p.read_text(encoding="utf-8") for p in (SAORL / "config").glob("*.py"))
    for name in preset_fields - {"name", "mode"}:  # derived, never written out in the config module
        # a field of that name, other than a section of the tree (SaorlConfig.value_pretrain)
        declared = re.search(rf"^\s+{name}\s*:(?!\s*\w+Config\b)", config_src, re.M)
        assert not declared, f"{name} is declared in saorl/config/ too"
    for name, f in AlgoPreset.model_fields.items():
        assert f.description, f"AlgoPreset.{name} has no documentation"
        if name not in NOT_IN_CONFIG:
            assert f.description in AlgoConfig.model_fields[name].description


def _calls(path: Path, attr: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each call of a function or method named ``attr`` in ``path``."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) == attr:
                    out.append((child.lineno, where))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return out


def test_the_preset_is_resolved_in_one_place():
    """A config's preset is resolved once, where the ``algo`` section is validated
    (``_AlgoSection._resolve``); everything else reads ``cfg.algo.preset``. ``with_overrides`` is how a
    preset is resolved: only the presets module (which builds the named presets from each other) and
    that validator call it."""
    assert not hasattr(AlgoConfig, "resolve")
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL).as_posix()
        calls = _calls(path, "with_overrides")
        if rel == "config/schema.py":
            assert [where for _, where in calls] == ["_resolve"], calls
        elif rel != "algo/presets.py":
            assert not calls, f"saorl/{rel} resolves a preset at lines {[n for n, _ in calls]}"


ONE_HOME = {
    # the adaptive λ: its typed value (spelled ``{adaptive: {alpha: α}}``), and the config's older
    # spellings, made that value where the section validates
    "adaptive": {"algo/presets.py", "config/schema.py"},
    "vapo_alpha": {"config/schema.py"},
    # an advantage estimator's name: declared with the presets, looked up in the registry
    "running_mean": {"algo/presets.py", "algo/registry.py"},
}


@pytest.mark.parametrize("word", sorted(ONE_HOME))
def test_a_decisions_spelling_is_compared_in_its_home_only(word):
    """The learner asks the registry (``keeps_running_baseline``), the estimator gets the typed
    ``lam_policy``: the strings these decisions were spelled with appear only where they are made."""
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL).as_posix()
        hits = [n.lineno for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(n, ast.Constant) and n.value == word]
        assert not hits or rel in ONE_HOME[word], f"saorl/{rel} spells {word!r} at lines {hits}"


WINGS = ("backends", "weights", "learner")


@pytest.mark.parametrize("wing", WINGS)
def test_the_runtime_wings_never_import_the_floor_above(wing):
    """runtime/ is the loop (run, parts, schedule, journal, checkpoint, recorder, ...) above three
    wings (backends, weights, learner): a wing imports other wings and lower packages, never a
    module of the loop, function-level imports included."""
    graph = _module_graph()
    own = f"saorl.runtime.{wing}"
    wings = tuple(f"saorl.runtime.{w}" for w in WINGS)
    for module in sorted(m for m in graph if m == own or m.startswith(own + ".")):
        up = sorted(m for m in graph[module]
                    if m.startswith("saorl.runtime") and m != "saorl.runtime" and not m.startswith(wings))
        assert not up, f"{module} imports {up} (the floor above its wing)"


KIND_TABLES = {"engines/kinds.py", "config/engines.py", "engines/serve/emulated.py"}
"""The kind table, the config sections, and the server APIs ``saorl serve --emulate`` imitates
(each named for the in-place kind whose client it serves: a test below)."""
KIND_NAMES = ("kind", "emulate")


def _kind_literal_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` that compare a kind (``x.kind``, ``kind``, ``x.emulate``, ``emulate``) with the
    name of an engine kind."""
    from saorl.config.engines import ENGINE_CONFIGS

    def is_kind(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in KIND_NAMES) or (
            isinstance(node, ast.Name) and node.id in KIND_NAMES)

    def is_literal(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in ENGINE_CONFIGS

    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_kind(s) for s in sides) and any(is_literal(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_engine_kinds_are_compared_only_in_their_tables():
    """What a kind can do (updated in place, loads adapters, is the local engine) is read from its
    config type (``IN_PLACE``, ``LOADS_ADAPTERS``, ``isinstance``), so a new kind cannot silently
    skip a check that compares names."""
    found = []
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL).as_posix()
        if rel not in KIND_TABLES:
            found += [f"saorl/{rel}:{n}" for n in _kind_literal_comparisons(path)]
    assert not found, f"engine kinds compared with a string outside {sorted(KIND_TABLES)}: {found}"


def test_the_kind_check_finds_a_literal(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(e, kind):\n    return e.kind != "vllm" or kind in ("local", "x")\n'
                     'def g(state):\n    return state.emulate == "sglang"\n')
    assert sorted(_kind_literal_comparisons(probe)) == [2, 2, 4]


def test_emulated_servers_are_the_in_place_kinds():
    """``saorl serve --emulate NAME`` exists to test the client of the in-place kind NAME."""
    from saorl.config.engines import IN_PLACE_KINDS
    from saorl.engines.serve.emulated import EMULATIONS
    from saorl.engines.serve.emulation import ROUTES

    assert set(EMULATIONS) == set(IN_PLACE_KINDS) == set(ROUTES)
    assert all(e.name == name for name, e in EMULATIONS.items())


def test_engine_kind_traits():
    from saorl.config.engines import ENGINE_CONFIGS

    assert {k for k, c in ENGINE_CONFIGS.items() if c.IN_PLACE} == {"vllm", "sglang"}
    assert {k for k, c in ENGINE_CONFIGS.items() if c.LOADS_ADAPTERS} == {"local", "vllm", "sglang"}
    from saorl.engines.kinds import KINDS, updated_in_place

    for name, config in ENGINE_CONFIGS.items():
        assert updated_in_place(name) == config.IN_PLACE
        assert (name in KINDS) == (name != "local")


ENGINE_FLOORS = {"serve": 2, "clients": 1}
"""engines/ in wings: ``serve/`` (the ``saorl serve`` stack) above ``clients/`` (clients of servers)
above the seam and the local engine at the top of the package (base, request, sampling, kv, prefix,
local). ``kinds.py``, the table of engine kinds, joins the clients to their config sections."""


def _engine_floor(module: str) -> int | None:
    if module == "saorl.engines.kinds":
        return None  # the table: reads clients/, read by the trainer and the workers
    rest = module.removeprefix("saorl.engines").lstrip(".")
    return ENGINE_FLOORS.get(rest.split(".")[0], 0) if module.startswith("saorl.engines") else None


def test_engine_wings_never_import_a_floor_above():
    """``saorl.engines`` itself (its ``__init__``) is the package's front and re-exports public names
    of any floor; every module under it keeps to its floor."""
    graph = _module_graph()
    for module in sorted(m for m in graph if m.startswith("saorl.engines.")):
        floor = _engine_floor(module)
        if floor is None:
            continue
        up = sorted(m for m in graph[module] if (m != "saorl.engines"
                    and (_engine_floor(m) or 0) > floor) or m == "saorl.engines.kinds")
        assert not up, f"{module} (floor {floor}) imports {up}, a floor above it"


def test_the_local_engine_is_built_only_from_its_config_section():
    """Every site builds the local engine with ``LocalEngine.from_config`` (a rollout worker,
    evaluation, value pretraining, ``saorl serve``, ``saorl bench``), so a setting of the
    ``rollout.engine`` section cannot reach one site and not another."""
    found = []
    for path in SAORL.rglob("*.py"):
        if path.relative_to(SAORL).as_posix() == "engines/local.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LocalEngine":
                found.append(f"saorl/{path.relative_to(SAORL).as_posix()}:{node.lineno}")
    assert not found, f"LocalEngine(...) called outside LocalEngine.from_config: {found}"


def test_stages_take_nothing_from_the_runs_assembly():
    """``runtime/parts.py`` assembles a run; what a stage needs of the config (the sampling settings,
    the trainer's threads, which prompts fit, the critic's LoRA) has a home below both, so a stage
    never imports the run's assembly."""
    bad = [f"{p.relative_to(SAORL)}" for p in _modules("stages")
           if any(m.startswith("saorl.runtime.parts") for m, _ in _imports(p))]
    assert not bad, f"stages importing saorl.runtime.parts: {bad}"


SOURCE_NAMES = {"TINY_KINDS", "TINY_NAMES", "REGISTRY_MODELS", "HUB_ID", "is_hub_id", "_is_hub_id"}
"""The tiny-kind list, the registry of short names and the Hub-id check: what classifies a model spec."""
SOURCE_HOMES = {"models/source.py": SOURCE_NAMES, "models/tiny.py": {"TINY_KINDS"},
                "models/__init__.py": {"TINY_KINDS"}, "models/gguf_source.py": {"REGISTRY_MODELS"}}
"""Where they may be named: the model source's table; the tiny builders, the package's public name and
the short names' conversion, which read the table's rows."""
SOURCE_LITERALS = {"tiny-moe", "tiny-dense", ".gguf"}


def _source_classifications(path: Path, allowed: set[str] = frozenset(), literals: bool = False) -> list[str]:
    """``line: what`` for each use in ``path`` of a name of :data:`SOURCE_NAMES` (but ``allowed``),
    and (unless ``literals``) each comparison with a tiny kind or the ``.gguf`` suffix (a spec
    classified by hand)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        found += [f"{node.lineno}: {n}" for n in names if n in SOURCE_NAMES - set(allowed)]
        if isinstance(node, ast.Compare) and not literals:
            sides = [e for s in (node.left, *node.comparators)
                     for e in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])]
            found += [f"{node.lineno}: compares with {e.value!r}" for e in sides
                      if isinstance(e, ast.Constant) and e.value in SOURCE_LITERALS]
    return found


def test_model_specs_are_classified_only_by_the_model_source():
    """``model.policy`` (and a critic, a tokenizer, an eval or serve target) is classified once, by
    the table of ``models/source.py``: no other module keeps a list of tiny kinds, looks a short name
    up, checks the form of a Hub id or compares with a tiny kind or the ``.gguf`` suffix."""
    found = []
    for path in SAORL.rglob("*.py"):
        rel = path.relative_to(SAORL).as_posix()
        literals = rel in ("models/source.py", "models/tiny.py")  # the table; the builders of its tiny kinds
        found += [f"saorl/{rel}:{f}" for f in _source_classifications(path, SOURCE_HOMES.get(rel, set()),
                                                                       literals)]
    assert not found, f"a model spec classified outside saorl/models/source.py: {found}"


def test_the_source_check_finds_a_classification(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from saorl.models.tiny import TINY_KINDS\n"
                     "def f(spec, path):\n"
                     "    return spec in TINY_KINDS or path.suffix.lower() == '.gguf'\n"
                     "def g(spec):\n"
                     "    return spec in ('tiny-moe', 'x') or hub.is_hub_id(spec)\n")
    assert sorted(_source_classifications(probe)) == [
        "1: TINY_KINDS", "3: TINY_KINDS", "3: compares with '.gguf'", "5: compares with 'tiny-moe'",
        "5: is_hub_id"]
    assert _source_classifications(probe, {"TINY_KINDS", "is_hub_id"}, literals=True) == []
