"""``--custom-config-path``: a YAML mapping applied on top of the validated flags."""

from __future__ import annotations

import base64
import binascii

import yaml

from .errors import ConfigError

__all__ = ["load_overlay"]

FLAG = "--custom-config-path"


def load_overlay(spec: str) -> dict:
    """Read the overlay: a YAML file, or ``base64:<base64 of the YAML text>``.

    Keys are attribute names; ``--flag-name`` and ``flag-name`` spellings are accepted and
    turned into ``flag_name``.

    :raises ConfigError: unreadable file, bad base64, bad YAML, or not a mapping.
    """
    if spec.startswith("base64:"):
        try:
            text = base64.b64decode(spec[len("base64:"):], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"{FLAG} base64:...: not valid base64-encoded UTF-8 text ({exc}).") from None
        where = f"{FLAG} base64:..."
    else:
        try:
            with open(spec, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise ConfigError(f"{FLAG} {spec}: cannot read the file ({exc.strerror or exc}).") from None
        where = f"{FLAG} {spec}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a YAML mapping of flag names to values, got {type(data).__name__}.")
    out = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            raise ConfigError(f"{where}: keys must be flag names, got {key!r}.")
        out[key.lstrip("-").replace("-", "_")] = value
    return out
