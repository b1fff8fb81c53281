"""``--disable-plugins`` and ``FURLONG_DISABLE_PLUGINS`` in every command: a name no installed plugin has is one
error line (exit 2) before anything else runs, and a plugin they turned off is reported as turned off, naming
which of them did it. Runs ``furlong`` in-process on the installed plugins; every message is compared whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong.core.cli.commands import main

pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
TRAIN = ["train", "--print-config", "--hf-checkpoint", str(DEMO / "model"), "--prompt-data",
         str(DEMO / "data" / "train.jsonl"), "--input-key", "prompt", "--label-key", "label", "--num-rollout", "2",
         "--rollout-batch-size", "4"]
SERVE = ["serve", "--hf-checkpoint", str(DEMO / "model"), "--port", "31339"]
TYPO = "megatorn: no installed plugin has that name (furlong plugins lists them). Did you mean 'megatron'?"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("FURLONG_TRACE_HOOKS", raising=False)


def errors_of(capsys, argv: list[str]) -> list[str]:
    """The ``error:`` lines of ``furlong ARGV``, which must exit 2."""
    capsys.readouterr()
    assert main(argv) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("argv, env, source", [
    (SERVE, "megatorn", "FURLONG_DISABLE_PLUGINS"),
    (SERVE + ["--disable-plugins", "megatorn"], None, "--disable-plugins"),
    (["plugins", "--disable-plugins", "megatorn"], None, "--disable-plugins"),
    (["plugins"], "megatorn", "FURLONG_DISABLE_PLUGINS"),
    (TRAIN, "megatorn", "FURLONG_DISABLE_PLUGINS"),
    (TRAIN + ["--disable-plugins", "megatorn"], None, "--disable-plugins"),
])
def test_a_misspelled_disabled_name_is_one_error_in_every_command(capsys, monkeypatch, argv, env, source):
    if env:
        monkeypatch.setenv("FURLONG_DISABLE_PLUGINS", env)
    assert errors_of(capsys, argv) == [f"error: {source} {TYPO}"]


@pytest.mark.parametrize("item, why", [
    (":math", "no distribution before ':'; write math (the plugin of that name in every distribution) or DIST:math."),
    ("furlong:", "no plugin name after ':'; write furlong:NAME."),
])
@pytest.mark.parametrize("command", [["plugins"], TRAIN])
def test_an_empty_distribution_or_name_around_the_colon_is_an_error(capsys, command, item, why):
    assert errors_of(capsys, command + ["--disable-plugins", item]) == [f"error: --disable-plugins {item}: {why}"]


@pytest.mark.parametrize("argv, env, message", [
    (TRAIN + ["--rm-type", "math", "--disable-plugins", "furlong:math"], None,
     "--rm-type 'math': plugin 'math' (furlong {v}) is installed but turned off by --disable-plugins furlong:math; "
     "remove 'furlong:math' from --disable-plugins to use it."),
    (TRAIN + ["--rm-type", "math"], "math",
     "--rm-type 'math': plugin 'math' (furlong {v}) is installed but turned off by FURLONG_DISABLE_PLUGINS math; "
     "remove 'math' from FURLONG_DISABLE_PLUGINS to use it."),
    (TRAIN + ["--disable-plugins", "megatron", "--train-backend", "megatron"], None,
     "--train-backend 'megatron': plugin 'megatron' (furlong {v}) is installed but turned off by --disable-plugins "
     "megatron; remove 'megatron' from --disable-plugins to use it."),
    (SERVE, "embedded",
     "--rollout-backend 'embedded': plugin 'embedded' (furlong {v}) is installed but turned off by "
     "FURLONG_DISABLE_PLUGINS embedded; remove 'embedded' from FURLONG_DISABLE_PLUGINS to use it."),
])
def test_a_plugin_turned_off_is_reported_as_turned_off(capsys, monkeypatch, argv, env, message):
    import importlib.metadata as md

    if env:
        monkeypatch.setenv("FURLONG_DISABLE_PLUGINS", env)
    assert errors_of(capsys, argv) == [f"error: {message.format(v=md.version('furlong'))}"]


@pytest.mark.parametrize("flag", ["--embedded-torch-compile", "--no-embedded-torch-compile"])
def test_an_embedded_flag_with_sglang_servers_is_one_error_naming_the_flag_as_typed(capsys, flag):
    assert errors_of(capsys, TRAIN + ["--rollout-backend", "sglang", flag]) == [
        f"error: {flag} sets the embedded engine, which SGLang servers do not run (they reach `furlong serve` with "
        "--sglang-server-impl furlong); SGLang's own are --sglang-enable-torch-compile and "
        "--sglang-max-running-requests."]


def test_a_plugin_flag_given_is_named_as_typed():
    """``plugin_flags_given`` (what the unused-plugin check names) holds the spelling given, ``--no-X`` included; the
    parser lists a ``--X/--no-X`` flag as ``--X``."""
    from furlong.core.config import build_parser, parse_args
    from furlong.core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    base = ["--num-rollout", "2", "--rollout-batch-size", "4"]
    assert build_parser(pm).plugin_flags["embedded_torch_compile"] == ("--embedded-torch-compile", "embedded")
    for flag in ("--embedded-torch-compile", "--no-embedded-torch-compile"):
        assert parse_args(base + [flag], pm).plugin_flags_given == {flag: "embedded"}
