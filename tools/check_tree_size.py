#!/usr/bin/env python3
"""Fail when the tree a lent GPU machine receives is too large.

A lent GPU machine gets a copy of the working tree (tracked files, and untracked files git does not
ignore) plus ../shared, 64 MiB at most. This sums the sizes of those files of this checkout and
exits 1 above the limit (default 60 MiB, SPECDEC_TREE_LIMIT_MIB or --limit-mib to change it),
printing the total and the largest files either way.

    tools/check_tree_size.py [--limit-mib 60] [--top 10]
"""
import argparse
import os
import subprocess
import sys

MIB = 1024 * 1024


def tree_files(root):
    """(size in bytes, path) of every tracked or untracked-but-not-ignored file under root."""
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    files = []
    for name in sorted(set(out.decode().split("\0")) - {""}):
        try:
            files.append((os.lstat(os.path.join(root, name)).st_size, name))
        except FileNotFoundError:  # tracked but deleted in the working tree: not copied
            pass
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=float, default=float(os.environ.get("SPECDEC_TREE_LIMIT_MIB", 60)))
    parser.add_argument("--top", type=int, default=10, help="how many of the largest files to list")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = tree_files(root)
    total = sum(size for size, _ in files)
    over = total > args.limit_mib * MIB
    print(f"tree size: {total / MIB:.2f} MiB in {len(files)} files (limit {args.limit_mib:g} MiB; a lent GPU "
          f"machine takes this tree plus ../shared, 64 MiB at most)")
    print(f"largest {min(args.top, len(files))} files:")
    for size, name in sorted(files, reverse=True)[:args.top]:
        print(f"  {size / MIB:8.2f} MiB  {name}")
    if over:
        print(f"FAIL: the tree is {total / MIB:.2f} MiB, over the {args.limit_mib:g} MiB limit: shrink or untrack "
              "the largest files above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
