"""BFCL's multi-turn data and backends, loaded from ``bfcl-eval`` without its heavy dependencies.

``bfcl-eval`` (2026.3.23) declares dozens of pinned dependencies (numpy 1.26.4, sentence-transformers,
faiss, the model vendors' SDKs) that its multi-turn part does not use, so it is installed without
them: ``pip install --no-deps bfcl-eval==2026.3.23``. What this module imports of it is what runs
without them (checked: neither numpy nor torch is imported by it):

- the data files, read as JSON lines from the package's ``data`` directory (its loader,
  ``bfcl_eval.utils``, imports ``filelock`` and more, so it is not used): the questions
  (``BFCL_v4_<category>.json``), the possible answers (``possible_answer/``) and each backend
  class's function docs (``multi_turn_func_doc/``, by
  ``constants.executable_backend_config.MULTI_TURN_FUNC_DOC_FILE_MAPPING``) — a task's tools are the
  docs of all its ``involved_classes``, as ``bfcl_eval.utils.populate_test_cases_with_predefined_functions``
  makes them;
- the multi-turn executor and checker (``eval_checker.multi_turn_eval``), which import the eight
  backend modules of ``multi_turn_base`` (file system, math, messages, posting, tickets, trading,
  travel, vehicle control) only: pure Python, plus ``mpmath`` for ``MathAPI``, which saorl has
  already (sympy's dependency, which torch requires);
- ``constants.type_mappings.GORILLA_TO_OPENAPI``, to write the docs' types (``dict``, ``float``,
  ``tuple``, ``any``) as JSON schema types, as BFCL's function-calling handlers do.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
from importlib import resources
from typing import Any

MODULE = "bfcl_eval"
PACKAGE = "bfcl-eval==2026.3.23"
INSTALL = f"pip install --no-deps {PACKAGE}"
CATEGORIES = ("multi_turn_base",)
"""The BFCL categories this env plays (the others need more than the base flow: held-out functions,
missing parameters, long contexts)."""
TEST_TASKS = 40
"""How many of a category's tasks are held out (the test split): those whose ids' sha256 digests
(of ``bfcl/<id>``) sort first. The rest (160 of multi_turn_base's 200) are the train split."""


def _lines(path: Any) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=4)
def entries(category: str) -> dict[str, dict[str, Any]]:
    """The category's tasks by id: BFCL's entry (``question``, ``initial_config``, ``involved_classes``,
    ...) with ``ground_truth`` (its possible answer: the calls of each user turn) and ``function``
    (the docs of the tools it offers) added."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    data = resources.files(MODULE) / "data"
    answer_file = data / "possible_answer" / f"BFCL_v4_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _lines(answer_file)}
    out: dict[str, dict[str, Any]] = {}
    for entry in _lines(data / f"BFCL_v4_{category}.json"):
        docs = [doc for cls in entry["involved_classes"]
                for doc in _docs(MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])]
        out[entry["id"]] = {**entry, "ground_truth": answers[entry["id"]], "function": docs}
    return out


@functools.lru_cache(maxsize=16)
def _docs(file_name: str) -> tuple[dict[str, Any], ...]:
    return tuple(_lines(resources.files(MODULE) / "data" / "multi_turn_func_doc" / file_name))


def split_ids(category: str) -> dict[str, list[str]]:
    """``{"train": [...], "test": [...]}``: the category's ids, :data:`TEST_TASKS` of them held out
    by the sha256 of ``bfcl/<id>`` (stable across machines and versions of saorl), each list in
    BFCL's order."""
    ids = list(entries(category))
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"bfcl/{i}".encode()).hexdigest())
    test = set(ranked[:TEST_TASKS])
    return {"train": [i for i in ids if i not in test], "test": [i for i in ids if i in test]}


def _schema_type(spec: Any) -> Any:
    """A BFCL parameter spec with its types as JSON schema types (recursively)."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    if isinstance(spec, list):
        return [_schema_type(s) for s in spec]
    if not isinstance(spec, dict):
        return spec
    out = {k: _schema_type(v) for k, v in spec.items()}
    if isinstance(spec.get("type"), str):
        out["type"] = GORILLA_TO_OPENAPI.get(spec["type"], spec["type"])
    if isinstance(spec.get("properties"), dict):
        out["properties"] = {k: _schema_type(v) for k, v in spec["properties"].items()}
    return out


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function doc as a tool schema (``{"type": "function", "function": {...}}``): its
    name, description and parameters, the types as JSON schema's; its ``response`` left out."""
    params = _schema_type(doc.get("parameters") or {"type": "dict", "properties": {}})
    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": params}}


def backend_class(class_name: str) -> type:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    return getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def ground_truth_arguments(call: str, classes: list[str]) -> tuple[str, dict[str, Any]]:
    """A possible answer's call string (``"sort('final_report.pdf')"``: the package's own data, not
    model text) as a name and keyword arguments, positional ones named by the backend method's
    signature: the JSON a model would write for it."""
    node = ast.parse(call, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a function call: {call!r}")
    name = node.func.id
    method = next((getattr(backend_class(c), name) for c in classes if hasattr(backend_class(c), name)), None)
    if method is None:
        raise ValueError(f"no backend of {classes} has a method {name!r}")
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    args = {params[k]: ast.literal_eval(a) for k, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg})
    return name, args
