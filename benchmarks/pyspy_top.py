"""Top entries of a py-spy raw profile of benchmark member processes.

Usage: python benchmarks/pyspy_top.py RAW [--top N] [--one] [--entry FUNC]

RAW is ``py-spy record --subprocesses --format raw`` output (see benchmarks/shm_stream.py).
Only stacks of member processes count: those through ``bench_members.member_entry``, or through
``--entry`` (``run_member`` for members started by ``derecho_async.launch``, as in
gpu_bandwidth.py). The event loop's own frame (``Runner.run``, time in uvloop) is left out of the own-time list. Prints the share of
samples per function by own time (the leaf frame) and by inclusive time. ``--one`` keeps only the
member process with the lowest pid (member 0: members are spawned in id order), ``--member K``
the K-th lowest.
"""

from __future__ import annotations

import argparse
import collections
import re

_PID = re.compile(r"(?:^|;)process (\d+):")
_FRAME = re.compile(r" \((?:/.*/)?([^/]+?)(?::\d+)?\)$")
_SKIP = ("process ", "spawn_main", "<module>", "BaseProcess", "_main (", "member_entry",
         "run_member", "run (")


def _name(frame: str) -> str:
    return _FRAME.sub(r" (\1)", frame)


def _member_pid(line: str) -> str | None:
    """The pid of the innermost process frame of a stack (the member, under its launcher)."""
    pids = _PID.findall(line)
    return pids[-1] if pids else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--one", action="store_true", help="member 0's process only")
    parser.add_argument("--member", type=int, default=None, metavar="K",
                        help="member K's process only (the K-th lowest member pid)")
    parser.add_argument("--entry", default="member_entry",
                        help="the frame every member stack passes through (default member_entry)")
    args = parser.parse_args()
    keep: str | None = None
    if args.one and args.member is None:
        args.member = 0
    if args.member is not None:
        with open(args.raw) as f:
            pids = {
                pid
                for line in f
                if args.entry in line and (pid := _member_pid(line)) is not None
            }
        ranked = sorted(pids, key=int)
        keep = ranked[args.member] if args.member < len(ranked) else None
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.raw) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not count.isdigit() or not any(args.entry in fr for fr in frames):
                continue
            if keep is not None and _member_pid(line) != keep:
                continue
            n = int(count)
            total += n
            names = [_name(fr) for fr in frames]
            own[names[-1]] += n
            for name in set(names):
                incl[name] += n
    print(f"{total} samples in member process{' ' + keep if keep else 'es'}")
    print("own time:")
    for name, n in own.most_common(args.top + 1):
        if not name.startswith("Runner.run"):
            print(f"  {100 * n / total:5.1f}%  {name}")
    print("inclusive time:")
    shown = 0
    for name, n in incl.most_common():
        # (a process frame's command line holds a ';', so part of it reads as a frame)
        if name.startswith((*_SKIP, " ", "Runner.run")):
            continue
        print(f"  {100 * n / total:5.1f}%  {name}")
        shown += 1
        if shown >= args.top:
            break


if __name__ == "__main__":
    main()
