"""furlong's launch flags: the ``furlong train`` parser, validation and derived values.

``parse_args(argv, pm)`` returns the resolved ``argparse.Namespace`` or raises
:class:`ConfigError` listing every problem; ``build_parser(pm)`` gives the parser (for
``--help``); ``config_to_dict(args)`` makes the Namespace JSON-ready (``--print-config``).
Flags, groups, deprecations and the versioning policy: docs/flags.md.
"""

from .deprecations import DEPRECATIONS, Deprecation
from .errors import ConfigError
from .parse import config_to_dict, expand_argsfiles, parse_args
from .parser import GROUP_TITLES, build_parser
from .unsupported import UNSUPPORTED

__all__ = [
    "DEPRECATIONS",
    "GROUP_TITLES",
    "UNSUPPORTED",
    "ConfigError",
    "Deprecation",
    "build_parser",
    "config_to_dict",
    "expand_argsfiles",
    "parse_args",
]
