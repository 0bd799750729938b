"""`tandem models list|fetch`: the models you can name, and fetching their files into the cache."""

from __future__ import annotations

import argparse

from engine import registry
from engine.errors import EngineError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="list or fetch the models you can name")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="show named models and whether they are cached")
    listing.set_defaults(func=_list)
    fetch = verbs.add_parser("fetch", help="download and verify named models into the cache")
    fetch.add_argument("names", nargs="+", metavar="NAME", help="model names (see `models list`)")
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    fetch.set_defaults(func=_fetch, user_errors=(EngineError,))


def _list(args: argparse.Namespace) -> int:
    print(f"{'NAME':<24} {'CACHED':<7} DESCRIPTION")
    models: list[registry.NamedModel | registry.RandomModel] = [
        *registry.REGISTRY.values(),
        *registry.RANDOM_MODELS.values(),
    ]
    for model in models:
        cached = "yes" if model.cached_path(args.home).exists() else "no"
        default = " [default]" if model.name == registry.DEFAULT_MODEL else ""
        print(f"{model.name:<24} {cached:<7} {model.description}{default}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    models = [registry.lookup(name) for name in args.names]
    for model in models:
        path = registry.fetch_any(model, args.home, quiet=args.quiet)
        print(f"{model.name}: {path}")
    return 0
