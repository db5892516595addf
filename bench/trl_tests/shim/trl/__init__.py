"""A ``trl`` that is ``rlhf_core``: ``import trl`` and every ``trl.X`` resolve to ``rlhf_core`` / ``rlhf_core.X``.

Nothing is re-implemented here: an import hook hands out the rlhf_core module objects themselves under the
trl names, so classes and private helpers are the very same objects (no second copy of any module).
"""

import importlib
import importlib.abc
import importlib.util
import sys

import rlhf_core


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``trl.a.b`` -> the already imported (or now imported) ``rlhf_core.a.b``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("trl."):
            return None
        target_name = "rlhf_core" + fullname[len("trl"):]
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module("rlhf_core" + spec.name[len("trl"):])

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _AliasFinder())
sys.modules[__name__] = rlhf_core
