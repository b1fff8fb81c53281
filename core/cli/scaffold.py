"""``furlong new-plugin NAME --hook HOOK [...]``: write a plugin package that installs, loads and passes its tests.

The package holds a ``pyproject.toml`` registering ``NAME`` in the ``furlong`` entry-point
group, a module with one working, documented stub per chosen hook (its signature and
docstring are the hookspec's, from :mod:`furlong.hooks.specs`), a README, and a test that
checks the entry point and runs the contract kit (:mod:`furlong.hooks.testing`) on the
module. ``pip install -e`` the folder, then ``pytest`` in it passes before any edit.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import keyword
import re
import textwrap
from pathlib import Path

from furlong.hooks import PluginError, specs

__all__ = ["main", "write_plugin"]

NAME = re.compile(r"[a-z][a-z0-9_]*")

# what each stub does until the author writes the real thing; every one passes the contract kit
BODIES = {
    "add_arguments": """\
        group = parser.add_argument_group("{name}")
        group.add_argument("--{flag}-scale", type=float, default=1.0,
                           help="An example flag of {name}; read it as config.plugin_config('{name}').{name}_scale.")""",
    "configure": """\
        return None  # report.error(...) / report.warn(...) / report.default(args, dest, value)""",
    "executor": """\
        raise PluginError("plugin '{name}': `executor` is not written yet.")""",
    "executor_fit": """\
        return ExecutorFit(False, "{name} is not written yet")  # never the default until it says it fits""",
    "rollout_engine": """\
        raise PluginError("plugin '{name}': `rollout_engine` is not written yet.")""",
    "train_backend": """\
        raise PluginError("plugin '{name}': `train_backend` is not written yet.")""",
    "critic_backend": """\
        raise PluginError("plugin '{name}': `critic_backend` is not written yet.")""",
    "data_source": """\
        return JsonlRows(dataset.path)""",
    "rollout": """\
        raise PluginError("plugin '{name}': `rollout` is not written yet.")""",
    "generate": """\
        prompt_ids = engine.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        out = await engine.generate(prompt_ids, sampling_params)
        sample.tokens = list(prompt_ids) + list(out.output_ids)
        sample.response = engine.tokenizer.decode(out.output_ids)
        sample.response_length = len(out.output_ids)
        sample.rollout_log_probs = list(out.output_log_probs)
        sample.weight_versions.append(out.weight_version)
        sample.status = {{"stop": Status.COMPLETED, "length": Status.TRUNCATED}}.get(out.finish_reason, Status.ABORTED)
        return sample""",
    "reward": """\
        return [float(str(s.label).strip() in s.response) for s in samples]""",
    "filter": """\
        return FilterResult(keep=len({{s.reward for s in samples}}) > 1, reason="zero_std")""",
    "buffer_pop": """\
        popped = buffer[:num_samples]
        del buffer[:num_samples]
        return popped""",
    "abort": """\
        return None""",
    "advantage": """\
        advantages = [torch.full_like(m, float(r), dtype=torch.float32) for r, m in zip(batch.rewards, batch.loss_masks)]
        return AdvantageOutput(advantages=advantages, returns=None)""",
    "loss": """\
        ratios = [torch.exp(lp - old) for lp, old in zip(batch.log_probs, batch.old_log_probs)]
        token_loss = [-r * a for r, a in zip(ratios, batch.advantages)]
        return LossOutput(token_loss=token_loss, token_metrics={{
            "pg_loss": token_loss,
            "pg_clipfrac": [torch.zeros_like(r) for r in ratios],
            "ppo_kl": [(old - lp).detach() for lp, old in zip(batch.log_probs, batch.old_log_probs)],
        }})""",
    "loss_reducer": """\
        weights = [1.0 / max(float(m.sum()), 1.0) for m in loss_masks]
        return masked_sum(values, loss_masks, weights)""",
    "on_rollout_end": """\
        log.info("{name}: rollout %d: %s", rollout_id, metrics)""",
    "on_train_step_end": """\
        log.info("{name}: step %d: %s", step, metrics)""",
    "on_eval_end": """\
        log.info("{name}: eval after rollout %d: %s", rollout_id, metrics)""",
    "on_checkpoint_saved": """\
        log.info("{name}: checkpoint %s", path)""",
    "on_hook_call": """\
        log.debug("{name}: %s[%s] took %.3f s", hook, plugin, seconds)""",
}
ASYNC = {"generate"}
IMPORTS = {  # hook -> (module-level imports, names from furlong.hooks)
    "executor": ((), ("PluginError",)),
    "executor_fit": ((), ("ExecutorFit",)),
    "rollout_engine": ((), ("PluginError",)),
    "train_backend": ((), ("PluginError",)),
    "critic_backend": ((), ("PluginError",)),
    "rollout": ((), ("PluginError",)),
    "data_source": (("import json",), ()),
    "generate": ((), ("Status",)),
    "filter": ((), ("FilterResult",)),
    "advantage": (("import torch",), ("AdvantageOutput",)),
    "loss": (("import torch",), ("LossOutput",)),
    "loss_reducer": (("from furlong.kit.masked import masked_sum",), ()),
    **{h: (("import logging",), ()) for h in ("on_rollout_end", "on_train_step_end", "on_eval_end",
                                             "on_checkpoint_saved", "on_hook_call")},
}
JSONL_ROWS = '''

class JsonlRows:
    """The rows of a JSONL file ("prompt", "label", "metadata"), rolling over epochs; state is the offset."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as fh:
            self.rows = [json.loads(line) for line in fh if line.strip()]
        self.offset = 0

    def next_rows(self, k):
        out = [self.rows[(self.offset + i) % len(self.rows)] for i in range(k)]
        self.offset += k
        return [{"prompt": r["prompt"], "label": r.get("label"), "metadata": r.get("metadata") or {}} for r in out]

    def state(self):
        return {"offset": self.offset}

    def load_state(self, state):
        self.offset = int(state["offset"])
'''


def write_plugin(name: str, hooks: list[str], parent: Path) -> Path:
    """Write the package of plugin ``name`` implementing ``hooks`` under ``parent``; return its folder.

    :param name: the plugin's name (its entry-point name): lower case, digits, ``_``.
    :param hooks: hook names from :data:`furlong.hooks.specs.__all__` (repeats ignored).
    :param parent: the folder to create ``furlong-<name>/`` in.
    :raises PluginError: a bad name, an unknown hook (with the valid ones), or an existing folder.
    """
    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        raise PluginError(f"new-plugin '{name}': a plugin name is lower case letters, digits and '_', starting "
                          "with a letter (it becomes a module name and what users type after a flag).")
    hooks = list(dict.fromkeys(hooks))
    if not hooks:
        raise PluginError(f"new-plugin {name}: name at least one hook with --hook HOOK. Hooks: "
                          f"{', '.join(specs.__all__)}.")
    for hook in hooks:
        if hook not in specs.__all__:
            close = difflib.get_close_matches(hook, specs.__all__, n=1)
            raise PluginError(f"--hook '{hook}': no such hook." + (f" Did you mean '{close[0]}'?" if close else "")
                              + f" Hooks: {', '.join(specs.__all__)}.")
    hooks = [h for h in specs.__all__ if h in hooks]  # loop order
    dist = "furlong-" + name.replace("_", "-")
    package = "furlong_" + name
    root = Path(parent) / dist
    if root.exists():
        raise PluginError(f"new-plugin {name}: {root} already exists; choose another --dir or remove it.")
    files = {
        "pyproject.toml": _pyproject(dist, package, name),
        f"{package}/__init__.py": _module(name, hooks),
        f"tests/test_{name}.py": _test(name, package, hooks),
        "README.md": _readme(name, dist, package, hooks),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def _pyproject(dist: str, package: str, name: str) -> str:
    return f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A furlong plugin: {name}."
requires-python = ">=3.10"
dependencies = ["furlong"]

[project.optional-dependencies]
test = ["pytest>=8"]

# furlong finds plugins here: the entry-point name is what users type after a flag
[project.entry-points.furlong]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''


def _module(name: str, hooks: list[str]) -> str:
    imports, names = set(), {"hookimpl"}
    for hook in hooks:
        module_imports, hook_names = IMPORTS.get(hook, ((), ()))
        imports.update(module_imports)
        names.update(hook_names)
    stdlib = sorted(i for i in imports if not i.startswith(("import torch", "from furlong")))
    third = sorted(i for i in imports if i.startswith("import torch"))
    furlong = [f"from furlong.hooks import {', '.join(sorted(names))}"] + sorted(
        i for i in imports if i.startswith("from furlong"))
    blocks = [b for b in (stdlib, third, furlong) if b]
    lines = [f'"""furlong plugin `{name}`: {", ".join(hooks)}.', "",
             "Each function below is a working stub: replace its body with your own. Its docstring is",
             'the hook\'s contract, from furlong.hooks.specs."""', "", "from __future__ import annotations", ""]
    for block in blocks:
        lines += block + [""]
    if "import logging" in imports:
        lines += ["log = logging.getLogger(__name__)", ""]
    for hook in hooks:
        lines += ["", _stub(name, hook)]
    text = "\n".join(lines).rstrip() + "\n"
    if "data_source" in hooks:
        text += JSONL_ROWS
    return text


def _stub(name: str, hook: str) -> str:
    """One hook function: the spec's parameters and docstring, and a body that works."""
    spec = getattr(specs, hook)
    names = list(inspect.signature(spec).parameters)
    params = ", ".join(n for n in names if not (n == "args" and "config" in names))  # the new form only
    doc = inspect.getdoc(spec) or ""
    quote = 'r"""' if "\\" in doc else '"""'
    body = textwrap.dedent(BODIES[hook]).format(name=name, flag=name.replace("_", "-"))
    head = "async def" if hook in ASYNC else "def"
    closing = '\n"""' if "\n" in doc else '"""'
    return f"@hookimpl\n{head} {hook}({params}):\n" + textwrap.indent(f"{quote}{doc}{closing}\n{body}\n", "    ")


def _test(name: str, package: str, hooks: list[str]) -> str:
    return f'''"""{name}: found through its entry point, and every hook the kit can call meets furlong's contract."""

from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks.testing import check_plugin

import {package}


def test_furlong_finds_the_plugin_by_its_entry_point():
    pm = get_plugin_manager()
    assert pm.get_plugin("{name}") is {package}, pm.broken.get("{name}")
    assert pm.hooks_of("{name}") == {sorted(hooks)!r}


def test_the_plugin_meets_the_hook_contract():
    # the configuration of a run with these flags; add yours, e.g. launch_config("--{name.replace("_", "-")}-scale", "2")
    report = check_plugin({package}, "{name}", config=launch_config())
    assert sorted(report.checked + list(report.not_exercised)) == {sorted(hooks)!r}
'''


def _readme(name: str, dist: str, package: str, hooks: list[str]) -> str:
    listed = "\n".join(f"- `{h}`: {(inspect.getdoc(getattr(specs, h)) or '').splitlines()[0]}" for h in hooks)
    return f"""# {dist}

A furlong plugin named `{name}`, implementing:

{listed}

## Develop

```console
$ pip install -e .          # add --no-build-isolation --no-deps when offline
$ furlong plugins           # lists {name} with its hooks
$ pytest                    # the entry point and furlong's contract kit
```

Edit `{package}/__init__.py`: each stub works as written and carries the hook's contract in
its docstring. `tests/test_{name}.py` runs `furlong.hooks.testing.check_plugin`, which calls
every hook it can with realistic inputs and fails naming the rule a hook breaks. PLUGINS.md
in furlong describes every hook and how it is chosen (`--rm-type {name}`,
`--advantage-estimator {name}`, ...).
"""


def main(argv: list[str]) -> int:
    """``furlong new-plugin``: parse ``argv``, write the package, print what to do next."""
    parser = argparse.ArgumentParser(prog="furlong new-plugin", allow_abbrev=False,
                                     description="Write a new plugin package: pyproject with the furlong entry "
                                                 "point, a module with a stub per hook, a README and a test.")
    parser.add_argument("name", help="the plugin's name (what users type after a flag), e.g. exact_match")
    parser.add_argument("--hook", action="append", default=[], metavar="HOOK", required=True,
                        help=f"a hook to implement (repeat for several): {', '.join(specs.__all__)}")
    parser.add_argument("--dir", default=".", help="folder to create furlong-<name>/ in (default: here)")
    opts = parser.parse_args(argv)
    root = write_plugin(opts.name, opts.hook, Path(opts.dir))
    print(f"wrote {root}/\n  pyproject.toml, README.md, furlong_{opts.name}/__init__.py, tests/test_{opts.name}.py\n"
          f"next: pip install -e {root} && (cd {root} && pytest)")
    return 0
