"""`tandem shm ls|gc`: list tandem shared memory, and unlink what dead owners left behind."""

from __future__ import annotations

import argparse

from shm import reaper
from shm.errors import ShmError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("shm", help="show or clean up shared-memory segments")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    ls = verbs.add_parser("ls", help="list segments and semaphores, and whether their owner lives")
    ls.set_defaults(func=_ls, user_errors=(ShmError,))
    gc = verbs.add_parser("gc", help="unlink segments and semaphores whose owner died")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be unlinked")
    gc.set_defaults(func=_gc, user_errors=(ShmError,))


def _ls(args: argparse.Namespace) -> int:
    entries = reaper.scan()
    print(f"{'NAME':<48} {'KIND':<9} {'SIZE':>12} {'PID':>8} {'OWNER':<6} AGE")
    for e in entries:
        owner = "alive" if e.alive else "dead"
        print(f"{e.path.name:<48} {e.kind:<9} {e.size:>12,} {e.pid:>8} {owner:<6} {e.age_s:.0f}s")
    total = sum(e.size for e in entries)
    print(f"{len(entries)} entries, {total:,} bytes")
    return 0


def _gc(args: argparse.Namespace) -> int:
    removed = reaper.reap(dry_run=args.dry_run)
    verb = "would unlink" if args.dry_run else "unlinked"
    for e in removed:
        print(f"{verb} {e.path.name} ({e.kind}, {e.size:,} bytes, pid {e.pid})")
    print(f"{verb} {len(removed)} entries, {sum(e.size for e in removed):,} bytes")
    return 0
