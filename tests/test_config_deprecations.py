"""Deprecated flags (docs/flags.md, "Deprecations and changed defaults"): one warning per
old flag below the removal version, an error at or above it, and an error for old and new
together."""

from __future__ import annotations

import logging

import pytest

import furlong.core.config.deprecations as deprecations
from furlong.core.config import DEPRECATIONS, ConfigError, Deprecation, parse_args

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4"]


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


@pytest.fixture
def version(monkeypatch):
    """``version("0.1.0")`` makes furlong report that version."""
    def set_version(text: str) -> None:
        monkeypatch.setattr(deprecations, "furlong_version", lambda: text)
    return set_version


def config_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "furlong.config" and r.levelno == logging.WARNING]


def test_the_table():
    assert DEPRECATIONS == (
        Deprecation("--rollout-router-ip", "--sglang-router-ip", "rename", "0.0.9", "0.1.0"),
        Deprecation("--rm-path", "--custom-rm-path", "rename", "0.0.9", "0.1.0"),
        Deprecation("--save-interval", "100", "default", "0.0.8", None, was="10"),
        Deprecation("--num-rollout", None, "required", "0.0.9", None, was="1000"),
        Deprecation("--apply-chat-template", None, "behavior", "0.0.8", None,
                    was="implied when a prompt is a list of messages; now never implied"),
    )


@pytest.mark.parametrize("argv, attr, value, message", [
    (["--rm-path", "my.rm"], "custom_rm_path", "my.rm",
     "--rm-path is deprecated since 0.0.9 and will be removed in furlong 0.1.0; use --custom-rm-path instead."),
    (["--rm-path=my.rm"], "custom_rm_path", "my.rm",
     "--rm-path is deprecated since 0.0.9 and will be removed in furlong 0.1.0; use --custom-rm-path instead."),
    (["--rollout-router-ip", "10.0.0.2"], "sglang_router_ip", "10.0.0.2",
     "--rollout-router-ip is deprecated since 0.0.9 and will be removed in furlong 0.1.0; use --sglang-router-ip "
     "instead."),
])
def test_old_flag_is_mapped_with_one_warning(caplog, version, argv, attr, value, message):
    version("0.1.0.dev0")
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        args = parse_args(BASE + argv)
    assert getattr(args, attr) == value
    assert config_warnings(caplog) == [message]
    assert attr in args.explicit_args


def test_old_flag_given_twice_warns_once(caplog, version):
    version("0.1.0.dev3")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        args = parse_args(BASE + ["--rm-path", "a.rm", "--rm-path", "b.rm"])
    assert args.custom_rm_path == "b.rm"
    assert len(config_warnings(caplog)) == 1


def test_two_old_flags_warn_once_each(caplog, version):
    version("0.0.9")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        parse_args(BASE + ["--rm-path", "a.rm", "--rollout-router-ip", "h"])
    assert [m.split(" ")[0] for m in config_warnings(caplog)] == ["--rollout-router-ip", "--rm-path"]


@pytest.mark.parametrize("current", ["0.1.0", "0.1.1", "1.0.0"])
def test_old_flag_is_an_error_from_the_removal_version(version, current):
    version(current)
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE + ["--rm-path", "my.rm", "--rollout-router-ip", "h"])
    assert str(excinfo.value) == (
        "--rollout-router-ip was removed in furlong 0.1.0; use --sglang-router-ip instead.\n"
        "--rm-path was removed in furlong 0.1.0; use --custom-rm-path instead.")


def test_removed_flag_error_comes_with_the_other_problems(version):
    version("0.1.0")
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE + ["--rm-path", "my.rm", "--bogus"])
    assert str(excinfo.value) == ("--rm-path was removed in furlong 0.1.0; use --custom-rm-path instead.\n"
                                  "unrecognized argument --bogus.")


def test_old_and_new_together_is_an_error(version):
    version("0.1.0.dev0")
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE + ["--rm-path", "a.rm", "--custom-rm-path", "b.rm"])
    assert str(excinfo.value) == ("--rm-path and --custom-rm-path are both given; --rm-path is a deprecated alias "
                                  "of --custom-rm-path: pass only --custom-rm-path.")


def test_new_flags_never_warn(caplog, version):
    version("0.1.0.dev0")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        parse_args(BASE + ["--custom-rm-path", "a.rm", "--sglang-router-ip", "h"])
    assert config_warnings(caplog) == []


def test_changed_defaults_from_the_migration_guide(caplog):
    args = parse_args(BASE)
    assert (args.save_interval, args.apply_chat_template) == (100, False)
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        parse_args(BASE + ["--save", "/ck"])
    assert "--save-interval defaults to 100 rollouts (it was 10 before 0.0.8)." in caplog.messages
