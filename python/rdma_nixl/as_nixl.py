"""Run code written for NVIDIA's NIXL on ``rdma_nixl`` without editing it.

``python -m rdma_nixl.as_nixl program.py [args...]`` runs ``program.py`` (as
``__main__``, with ``sys.argv`` as if it were run directly) with ``nixl``,
``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging`` mapped to
``rdma_nixl``'s modules; ``python -m rdma_nixl.as_nixl -m module [args...]`` runs a
module. ``install()`` does the mapping in the current process (before the code that
imports ``nixl``). Unlike the ``rdma-nixl-as-nixl`` package (``python/nixl-shim``),
this changes no installed file, so it cannot shadow NVIDIA's ``nixl`` for anyone else.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import types

__all__ = ["install", "main", "SUBMODULES"]

#: NIXL's modules that ``install`` maps (``nixl.<name>`` -> ``rdma_nixl.<name>``).
SUBMODULES = ("_api", "_bindings", "_utils", "logging")


def install() -> types.ModuleType:
    """Maps ``nixl`` and ``nixl.<name>`` to ``rdma_nixl`` in this process; returns the
    ``nixl`` module. Idempotent; ``RuntimeError`` if another ``nixl`` (NVIDIA's) is
    already imported."""
    present = sys.modules.get("nixl")
    if present is not None:
        if getattr(present, "__implementation__", None) == "rdma_nixl":
            return present
        raise RuntimeError(
            f"another `nixl` is already imported ({getattr(present, '__file__', present)!r}): "
            "map the name before anything imports it"
        )
    api = importlib.import_module("rdma_nixl._api")
    module = types.ModuleType("nixl", "``nixl``, answered by ``rdma_nixl`` (rdma_nixl.as_nixl).")
    module.__path__ = []  # a package: ``import nixl._api`` finds the entries below
    module.__implementation__ = "rdma_nixl"
    for name in api.__all__:
        setattr(module, name, getattr(api, name))
    sys.modules["nixl"] = module
    for name in SUBMODULES:
        sub = importlib.import_module(f"rdma_nixl.{name}")
        sys.modules[f"nixl.{name}"] = sub
        setattr(module, name, sub)
    return module


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if args else 2)
    install()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("rdma_nixl.as_nixl: -m needs a module name")
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        # As `python program.py` does: the program's folder first on the path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
