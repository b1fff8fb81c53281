"""SGLang's own contract, read from its released wheels, for the conformance tests.

The tests do not trust furlong's reading of SGLang's HTTP API. They take SGLang's:

- ``sglang/api/v1/api_types.py`` (0.5.23): the generated JSON contract of ``/generate``,
  ``/model_info``, ``/server_info``, ``/abort_request``; it needs only msgspec, so it loads
  on a CPU without the rest of SGLang. :func:`api_types` imports it.
- ``sglang/srt/entrypoints/http_server.py`` of each pinned version: which routes exist
  and which request type each control route reads (:func:`routes`);
- ``sglang/srt/managers/io_struct.py``: the fields of those request types, their
  annotations and which are required (:func:`request_fields`, :func:`check_control_body`);
- ``sglang/srt/entrypoints/http_server_engine.py``: SGLang's own HTTP client, and the
  ``MultiprocessingSerializer`` class of ``sglang/srt/utils/common.py`` it serializes
  tensors with (:func:`http_client`).

The wheels are downloaded from PyPI on first use (``pip download --no-deps``, about 55 MB
for both pins) into ``tests/.sglang-reference/`` (git-ignored), and only these files are
kept. Nothing of SGLang is in the repository.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

PINNED = ("0.5.16", "0.5.23")
CACHE = Path(__file__).parent / ".sglang-reference"
FILES = ("sglang/api/v1/api_types.py", "sglang/srt/entrypoints/http_server.py",
         "sglang/srt/managers/io_struct.py", "sglang/srt/entrypoints/http_server_engine.py",
         "sglang/srt/managers/scheduler_components/weight_updater.py", "sglang/srt/utils/common.py")


def source(version: str, path: str) -> Path:
    """The file ``path`` of SGLang ``version``'s wheel (downloaded once). Raises FileNotFoundError when
    that version has no such file (0.5.16 has no ``api/v1``)."""
    folder = CACHE / version
    marker = folder / "complete"
    if not marker.exists() or marker.read_text() != "\n".join(FILES):  # a new file was added to FILES since
        _fetch(version, folder)
    found = folder / path
    if not found.exists():
        raise FileNotFoundError(f"SGLang {version} has no {path}")
    return found


def _fetch(version: str, folder: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # the wheel is built per Python and platform; only its .py files are read, so any build will do
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.11", "--platform", "manylinux_2_34_x86_64", "-d", tmp, f"sglang=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"could not download the SGLang {version} wheel from PyPI:\n{done.stderr[-2000:]}")
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            for name in FILES:
                if name in archive.namelist():
                    target = folder / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(name))
    (folder / "complete").write_text("\n".join(FILES))


@functools.cache
def api_types():
    """SGLang 0.5.23's ``api_types`` module (msgspec structs with ``from_json_value``)."""
    path = source("0.5.23", "sglang/api/v1/api_types.py")
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_api_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- routes and control request types ------------------------------------------------------------


@functools.cache
def routes(version: str) -> dict[tuple[str, str], str | None]:
    """``(method, path) -> request type name`` (None when the route reads no typed body) of
    ``http_server.py``'s ``@app.get/post/api_route`` handlers."""
    tree = ast.parse(source(version, "sglang/srt/entrypoints/http_server.py").read_text())
    found: dict[tuple[str, str], str | None] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_type = next((_type_name(a.annotation) for a in node.args.args if a.arg == "obj" and a.annotation), None)
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"):
                continue
            if not (decorator.args and isinstance(decorator.args[0], ast.Constant)):
                continue
            path = decorator.args[0].value
            if decorator.func.attr in ("get", "post", "put", "delete"):
                methods = [decorator.func.attr.upper()]
            elif decorator.func.attr == "api_route":
                listed = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                methods = [e.value for e in listed.elts] if isinstance(listed, ast.List) else ["GET"]
            else:
                continue
            for method in methods:
                found[(method, path)] = body_type
    return found


def _type_name(annotation: ast.expr) -> str | None:
    """``XReqInput`` out of ``XReqInput`` or ``Annotated[XReqInput, Body()]``."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) \
            and annotation.value.id == "Annotated" and isinstance(annotation.slice, ast.Tuple):
        return _type_name(annotation.slice.elts[0])
    return None


@functools.cache
def request_fields(version: str, type_name: str) -> dict[str, tuple[ast.expr, bool]]:
    """``field -> (annotation, required)`` of ``io_struct.py``'s class ``type_name`` (with its bases')."""
    tree = ast.parse(source(version, "sglang/srt/managers/io_struct.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def collect(name: str) -> dict[str, tuple[ast.expr, bool]]:
        node = classes.get(name)
        if node is None:
            return {}
        fields: dict[str, tuple[ast.expr, bool]] = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                fields.update(collect(base.id))
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and not _type_text(item.annotation).startswith("ClassVar"):
                fields[item.target.id] = (item.annotation, item.value is None)
        return fields

    if type_name not in classes:
        raise KeyError(f"SGLang {version}'s io_struct.py has no class {type_name}")
    return collect(type_name)


def _type_text(annotation: ast.expr) -> str:
    return ast.unparse(annotation)


def _matches(value: Any, annotation: ast.expr) -> bool:
    """Whether JSON ``value`` fits a field annotation of io_struct.py (the shapes control bodies use)."""
    text = _type_text(annotation)
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        outer, inner = annotation.value.id, annotation.slice
        args = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Optional":
            return value is None or _matches(value, args[0])
        if outer == "Union":
            return any(_matches(value, a) for a in args)
        if outer == "List":
            return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
        if outer in ("Dict", "dict"):
            return isinstance(value, dict)
        if outer == "Literal":
            return value in [a.value for a in args]
        if outer == "Annotated":
            return _matches(value, args[0])
    simple = {"str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
              "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "bytes": lambda v: isinstance(v, str), "Any": lambda v: True}
    check = simple.get(text)
    return True if check is None else check(value)  # a type these bodies never use: not judged


def check_control_body(version: str, method: str, path: str, body: Any) -> list[str]:
    """What is wrong with ``body`` for route ``method path`` of SGLang ``version`` (empty: nothing).

    Stricter than SGLang in one respect: a key the request type does not define is a
    violation (SGLang drops it silently, so a misspelt field would do nothing).
    """
    if (method, path) not in routes(version):
        return [f"{method} {path}: no such route in SGLang {version}"]
    type_name = routes(version)[(method, path)]
    if type_name is None or type_name == "GenerateReqInput":
        return []
    fields = request_fields(version, type_name)
    body = {} if body is None else body
    if not isinstance(body, dict):
        return [f"{path}: body is {type(body).__name__}, {type_name} is an object"]
    problems = [f"{path}: {type_name} has no field {key!r}" for key in sorted(set(body) - set(fields))]
    problems += [f"{path}: {type_name} needs {name!r}" for name, (_, required) in fields.items()
                 if required and name not in body]
    problems += [f"{path}: {type_name}.{name} = {body[name]!r:.80} does not fit {_type_text(annotation)}"
                 for name, (annotation, _) in fields.items() if name in body and not _matches(body[name], annotation)]
    return problems


def http_client(url: str, tp_size: int = 1):
    """SGLang 0.5.23's ``HttpServerEngineAdapter`` talking to the server at ``url`` (it does not start one).

    The module is loaded from the wheel with stand-ins for the imports that pull in the rest
    of SGLang (server arguments, the server itself); ``MultiprocessingSerializer`` is
    SGLang's own class, taken from ``utils/common.py``.
    """
    import base64
    import io
    import types
    from multiprocessing.reduction import ForkingPickler

    common = source("0.5.23", "sglang/srt/utils/common.py").read_text()
    node = next(n for n in ast.parse(common).body if isinstance(n, ast.ClassDef) and n.name == "MultiprocessingSerializer")
    namespace = {"io": io, "ForkingPickler": ForkingPickler, "pybase64": base64, "SafeUnpickler": None}
    exec(compile(ast.Module([node], []), "sglang/srt/utils/common.py", "exec"), namespace)  # noqa: S102 - SGLang's code

    class ServerArgs:
        def __init__(self):
            self.tp_size, self.api_key = tp_size, None

        def url(self):
            return url

    stubs = {
        "sglang.srt.arg_groups.overrides": {"resolving_view": lambda server_args: server_args},
        "sglang.srt.arg_groups.serving_hook": {"ssl_verify_of": lambda server_args: True},
        "sglang.srt.entrypoints.EngineBase": {"EngineBase": object},
        "sglang.srt.entrypoints.http_server": {"launch_server": None},
        "sglang.srt.server_args": {"ServerArgs": ServerArgs},
        "sglang.srt.utils": {"MultiprocessingSerializer": namespace["MultiprocessingSerializer"],
                             "kill_process_tree": None},
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, members in stubs.items():
            sys.modules[name] = types.SimpleNamespace(**members)
        spec = importlib.util.spec_from_file_location(
            "sglang_0_5_23_http_server_engine", source("0.5.23", "sglang/srt/entrypoints/http_server_engine.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    client = module.HttpServerEngineAdapter.__new__(module.HttpServerEngineAdapter)
    client.server_args = ServerArgs()
    return client
