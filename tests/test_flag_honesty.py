"""Every flag is honest: each flag of ``furlong train`` is read by the code, refused, or allow-listed.

A flag that parses but changes nothing must either work or be refused at validation
("not supported yet", :data:`furlong.core.config.UNSUPPORTED`), or, for a Miles flag that chooses only
a memory or layout detail furlong decides itself, be warned about as changing nothing
(:data:`furlong.core.config.unsupported.NO_EFFECT`). This test lists every flag
the parser defines (core's and the installed plugins' ``add_arguments``) and looks for a
use of its attribute in the package source (``hooks/``, ``kit/``, ``core/``, ``builtin_plugins/``,
and the module of every plugin that adds flags):

- ``args.<dest>`` (or ``self.args.<dest>``, ``ds_args.<dest>``, ...),
- ``getattr(x, "<dest>"...)``, or the text ``"<dest>"`` / the option string (``"--debug"``)
  as a value (tables of attribute names, argv checks); docstrings do not count.

Code that only defines or checks flags is not a use: the definitions
(``core/config/flags_*.py``, a plugin's ``add_argument`` calls), the checks and derived
defaults (``core/config/validate.py``, ``rules.py``, plugins' ``configure`` hooks:
``--colocate`` was read there and nowhere else) and ``unsupported.py``. Megatron-only flags
(declared with ``core.config._util.megatron``, and every flag of Megatron-LM's table) are
handed to the train backend unchanged; the core reports the given ones the chosen backend
does not honour (``MEGATRON_FLAGS``, :mod:`furlong.core.config.megatron_support`). Miles flags of
Miles' table that furlong does not implement are refused when given (``miles_refused``).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from furlong.core.config import UNSUPPORTED, build_parser
from furlong.core.config.unsupported import NO_EFFECT
from furlong.core.config._util import MEGATRON_ONLY

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("hooks", "kit", "core", "builtin_plugins")
NOT_A_USE = re.compile(r"(core/config/(flags_\w+|validate|rules|unsupported)|hooks/run_config)\.py$")
ARGS_NAME = re.compile(r"(^|_)(args|config)$")

# Flags whose effect is, by design, somewhere this scan does not see. Keep it small.
ALLOWED = {
    # train/entropy_loss is logged at every step whatever --entropy-coef is: nothing to turn on
    "observe_training_entropy": "entropy is always logged",
    # any value but 'default' is a validation error: it needs --use-session-server, which is refused
    "tito_model": "refused through --use-session-server",
    # --use-opd asks a served teacher, which is what 'sglang' names; rules.py refuses 'megatron'
    "opd_type": "its one accepted value is the served teacher the core always asks",
}


def _package_files() -> list[Path]:
    files = [f for d in SOURCE_DIRS for f in sorted((REPO / d).rglob("*.py"))]
    return [f for f in files if not NOT_A_USE.search(f.relative_to(REPO).as_posix())]


def _is_args(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(ARGS_NAME.search(name))


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def uses_in(source: str) -> set[str]:
    """Attribute names read from an args namespace, a run configuration or a plugin's section
    (``config.plugin_config(name)``), and string values, in ``source``.

    Skipped: docstrings, the bodies of ``configure`` hook implementations (which check flags
    and derive defaults, as validation does), a tuple or list naming a flag both ways,
    ``("colocate", "--colocate", ...)`` (a row of a table of error messages), and the names
    in an ``add_argument`` call (a plugin defining its own flag).
    """
    found: set[str] = set()
    tree = ast.parse(source)
    sections = _section_names(tree)

    def visit(node: ast.AST, skip: frozenset = frozenset()) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "configure":
            return
        body = getattr(node, "body", None)
        docstring = None
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstring = first
        if isinstance(node, (ast.Tuple, ast.List)):
            texts = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            named = {t for t in texts if "--" + t.replace("_", "-") in texts}
            skip = frozenset(named | {"--" + t.replace("_", "-") for t in named})
        if isinstance(node, ast.Call) and _called(node) in ("add_argument", "megatron"):
            defined = [a for a in node.args if isinstance(a, ast.Constant)]  # a plugin's own flag definition
            defined += [k for k in node.keywords if k.arg == "dest"]
            for child in ast.iter_child_nodes(node):
                if not any(child is d for d in defined):
                    visit(child)
            return
        if isinstance(node, ast.Attribute) and (_is_args(node.value) or _is_section(node.value, sections)):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value not in skip:
            found.add(node.value)
        for child in ast.iter_child_nodes(node):
            if child is not docstring:
                visit(child, skip if isinstance(node, (ast.Tuple, ast.List)) else frozenset())

    visit(tree)
    return found


def _is_section(node: ast.AST, names: set[str]) -> bool:
    """``config.plugin_config(...)`` itself, or a name (or attribute) bound to one in the same file."""
    if isinstance(node, ast.Call):
        return _called(node) == "plugin_config"
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in names


def _section_names(tree: ast.AST) -> set[str]:
    """Names and attributes assigned a plugin's section (``own = config.plugin_config("x")``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _called(node.value) == "plugin_config":
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    names.add(target.attr)
    return names


@pytest.fixture(scope="module")
def plugin_manager_with_flags():
    from furlong.core.plugins.manager import get_plugin_manager

    return get_plugin_manager()


@pytest.fixture(scope="module")
def parser(plugin_manager_with_flags):
    return build_parser(plugin_manager_with_flags)


def uses_of(pm) -> set[str]:
    """Every use found in the package and in the plugins that add flags (third-party ones too)."""
    files = set(_package_files())
    for impl in pm.hook.add_arguments.get_hookimpls():
        path = Path(inspect.getsourcefile(impl.function))
        files |= set(path.parent.rglob("*.py")) if path.name == "__init__.py" else {path}
    found: set[str] = set()
    for path in files:
        found |= uses_in(path.read_text(encoding="utf-8"))
    return found


@pytest.fixture(scope="module")
def used(plugin_manager_with_flags) -> set[str]:
    return uses_of(plugin_manager_with_flags)


def unread(parser, used: set[str]) -> list[str]:
    """Flags neither read, nor refused, nor allow-listed (nor Megatron-only), as typed."""
    refused = {row.dest for row in (*UNSUPPORTED, *NO_EFFECT)}
    offending = []
    for dest, action in _flags(parser).items():
        if dest in used or any(opt in used for opt in action.option_strings):
            continue
        if dest in refused or dest in ALLOWED or getattr(action, MEGATRON_ONLY, False) \
                or getattr(action, "miles_refused", False):
            continue
        offending.append(action.option_strings[0])
    return offending


def _flags(parser):
    """``{dest: action}`` of every flag, in parser order."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_flag_is_read_refused_or_allow_listed(parser, used):
    offending = unread(parser, used)
    assert not offending, (
        "flags parsed but never read: make each one work, or refuse a non-default value in "
        f"core/config/unsupported.py (UNSUPPORTED): {' '.join(offending)}")


TOY = '''
from furlong.hooks import hookimpl


@hookimpl
def add_arguments(parser):
    group = parser.add_argument_group("toy")
    group.add_argument("--toy-used", type=int, default=1, help="Read below.")
    group.add_argument("--toy-unused", action="store_true", help="Read nowhere.")


@hookimpl
def on_rollout_end(args, metrics):
    metrics["toy"] = args.toy_used
'''


def test_a_plugin_flag_nobody_reads_is_named(plugin_dist):
    """The scan covers plugins' own flags, read in the plugin's own source."""
    from furlong.core.plugins.manager import get_plugin_manager

    plugin_dist("furlong-toy", "furlong_toy", TOY, {"toy": "furlong_toy"})
    pm = get_plugin_manager()
    assert unread(build_parser(pm), uses_of(pm)) == ["--toy-unused"]


def test_allow_list_holds_only_flags_that_need_it(parser, used):
    """A flag of ALLOWED that is now read or refused leaves the list; every entry is a flag."""
    flags = _flags(parser)
    refused = {row.dest for row in (*UNSUPPORTED, *NO_EFFECT)}
    stale = sorted(d for d in ALLOWED if d in flags and (d in used or d in refused))
    assert not stale, f"allow-listed but read or refused, remove them from the allow-list: {' '.join(stale)}"
    unknown = sorted(d for d in ALLOWED if d not in flags)
    assert not unknown, f"allow-listed but not a flag: {' '.join(unknown)}"


def test_refused_rows_name_real_flags_and_their_defaults(parser):
    """Each row of UNSUPPORTED and NO_EFFECT names a defined flag, and its default is a supported value."""
    flags = _flags(parser)
    for row in (*UNSUPPORTED, *NO_EFFECT):
        assert row.dest in flags, row
        assert row.flag in flags[row.dest].option_strings, row
        assert flags[row.dest].default in row.supported, row


def test_megatron_flags_are_judged_against_the_backend_declaration():
    """The allow-list rule for Megatron-only flags holds only while the core reports them
    against the chosen backend's declaration (and fsdp declares one)."""
    from furlong.builtin_plugins.backends import fsdp
    from furlong.hooks import MegatronFlags

    source = (REPO / "core" / "config" / "megatron_support.py").read_text(encoding="utf-8")
    assert "megatron_flags_given" in uses_in(source)
    assert isinstance(fsdp.MEGATRON_FLAGS, MegatronFlags)


def test_the_scan_sees_a_flag_that_is_only_checked():
    """What counts as a use: reads of an args namespace and string values, not docstrings."""
    source = '''
def f(args, self):
    """args.in_docstring"""
    x = args.read_plain + self.args.read_on_self + ds_args.read_copy
    y = getattr(args, "read_by_getattr", None)
    return "--read-by-option" in argv, self.not_args


def configure(args, report):
    report.default(args, "only_derived", args.only_checked)


EXCLUSIVE = (("only_named", "--only-named", "why"), ("table_value", "rollout_value"))


def add_arguments(parser):
    parser.add_argument("--only-defined", dest="only_defined_dest", help="--help-text")
'''
    found = uses_in(source)
    assert {"read_plain", "read_on_self", "read_copy", "read_by_getattr", "--read-by-option", "table_value",
            "--help-text"} <= found
    assert not {"in_docstring", "not_args", "only_derived", "only_checked", "only_named", "--only-named",
                "--only-defined", "only_defined_dest"} & found
