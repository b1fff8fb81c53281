"""Old import paths of the helpers that moved from ``furlong.hooks`` to ``furlong.kit``.

``import furlong.hooks.hf`` (and the other moved modules) still works until the next minor
version: it imports the module from :mod:`furlong.kit` and warns with a ``DeprecationWarning``
naming the new path (PLUGINS.md, "Deprecations").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED_TO_KIT"]

MOVED_TO_KIT = frozenset({"answers", "compute_thread", "dist", "epochs", "hf", "kl", "masked", "master_weights",
                          "packed_attention", "trainer", "vocab_softmax"})


class _KitAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package != "furlong.hooks" or leaf not in MOVED_TO_KIT:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        leaf = spec.name.rpartition(".")[2]
        warnings.warn(f"{spec.name} moved to furlong.kit.{leaf}; the old path goes away in the next minor version",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(f"furlong.kit.{leaf}")

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _KitAlias) for finder in sys.meta_path):
    sys.meta_path.append(_KitAlias())
