"""One 3-member ordered throughput run (1 KB, depth 32), for profiling and quick A/B checks.

Usage: python benchmarks/shm_stream.py [--count N] [--transport shm|tcp] [--one-sender] [--one-way]
    [--max-payload BYTES] [--depth CALLS] [--spin-us US] [--send-batch N]

Prints the delivered msgs/s at the slowest member and the CPU time all members spent per
delivered message (user + system, from the phase start to its last delivery), which is steadier
than msgs/s on a machine shared with other work, and each member's delivered messages per
protocol step. ``--durable`` gives the members a ``data_dir`` (a fresh temporary directory,
removed afterwards), as table 6 of compare.py does. To profile with py-spy (top entries by own and
by inclusive time, GIL-holding samples of the member processes)::

    py-spy record --subprocesses --gil -r 400 --format raw -o /tmp/raw.txt -- \\
        python benchmarks/shm_stream.py --count 40000
    python benchmarks/pyspy_top.py /tmp/raw.txt
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import bench_members as bm
import compare as c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20000, help="calls per sender")
    parser.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    parser.add_argument("--one-sender", action="store_true", help="only member 0 sends")
    parser.add_argument("--one-way", action="store_true",
                        help="one-way calls (handle.put.cast): no replies")
    parser.add_argument("--max-payload", type=int, default=None,
                        help="Config.max_payload (the slot size; default the Config's)")
    parser.add_argument("--depth", type=int, default=c.DEPTH,
                        help=f"outstanding calls per sender (default {c.DEPTH})")
    parser.add_argument("--durable", action="store_true",
                        help="durable actors: a data_dir in a fresh temporary directory")
    parser.add_argument("--spin-us", type=float, default=None,
                        help="Config.spin_us of the members (default: the automatic choice, "
                             "which spins on 8 cores or more; 0 makes the CPU figure the work "
                             "alone)")
    parser.add_argument("--send-batch", type=int, default=None,
                        help="Config.send_batch of the members (default: automatic)")
    args = parser.parse_args()
    if args.spin_us is not None:
        bm.CONFIG_OVERRIDES["spin_us"] = args.spin_us
    if args.send_batch is not None:
        bm.CONFIG_OVERRIDES["send_batch"] = args.send_batch
    senders = [0] if args.one_sender else [0, 1, 2]
    plan = [c.warmup(3, c.FULL), c.plan_stream(senders, args.count, 1024, args.depth, one_way=args.one_way)]
    with contextlib.ExitStack() as stack:
        data_dir = (stack.enter_context(tempfile.TemporaryDirectory(prefix="derecho-durable-"))
                    if args.durable else None)
        run = bm.GroupRun(3, args.transport, plan, max_payload=args.max_payload,
                          data_dir=data_dir)
        res = run.run(300, 60)[1]
    cpu = sum(r["cpu_s"] for r in res.values())
    delivered = min(r["delivered"] for r in res.values())
    print(
        f"{args.transport}, 3 members, {len(senders)} sender(s), 1 KB"
        f"{', one-way' if args.one_way else ''}{', data_dir' if args.durable else ''}, "
        f"depth {args.depth}: "
        f"{c.min_rate(res):,.0f} msgs/s; CPU {cpu / delivered * 1e6:.1f} us per delivered "
        "message (all members together); delivered per step "
        + " ".join(f"{r['delivered'] / max(r['steps'], 1):.1f}" for _, r in sorted(res.items()))
    )


if __name__ == "__main__":
    main()
