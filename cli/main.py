"""The `megagraph` console script: maps verbs to their modules, holds no logic itself."""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module exposing add_arguments(parser) and main(args) -> int
VERBS = {
    "compile": "megagraph.passes.cli",
    "inspect": "megagraph.passes.inspect",
    "runtime": "megagraph.runtime.cli",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megagraph", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    modules = {}
    for verb, modname in VERBS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:  # a verb whose module is not built yet
            if e.name != modname:
                raise
            continue
        modules[verb] = mod
        p = sub.add_parser(verb, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.verb].main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
