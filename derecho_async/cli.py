"""The ``derecho-async`` command: ``demo``, ``bench``, ``member``, ``status``, ``secret``,
``certs``, ``repair``.

``demo`` and ``bench`` start a local group as separate processes (spawned, so each member is a
real process with its own event loop), run the replicated-log workload of
:mod:`derecho_async.workload` and print what happened; ``demo`` also SIGKILLs one member halfway
and shows the view change. ``member`` runs one member of a multi-host group from a TOML file.
``status`` lists the shared-memory segments of local groups and whether their owners are alive;
``status --clean`` removes those of dead owners. ``secret`` prints a fresh shared secret for the
``secret`` key (256 random bits, tagged and checked: the only form ``Config`` takes; see
:mod:`derecho_async.config.strength`); ``certs`` makes a group CA and member certificates for
the TLS mode (:mod:`derecho_async.certs`); ``repair`` mends a member's damaged durable files
(:mod:`derecho_async.durability.repair`). ``--version``
prints the version and the active hot path; ``bench`` and ``status`` print one JSON object with
``--json``. ``--help`` shows the plain-text descriptions near :func:`main`, not this docstring.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from derecho_async.config.strength import new_secret
from derecho_async.localrun import LocalRun
from derecho_async.transport import registry

if TYPE_CHECKING:
    from derecho_async.transport.shm.cleanup import SegmentFile

__all__ = ["main"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    n = args.members
    print(
        f"derecho-async demo: {n} members over {args.transport}, {args.messages} ordered "
        f"appends each, {args.size} B"
        + ("" if args.no_kill else f"; member {n - 1} is killed halfway")
    )
    run = LocalRun(
        n,
        args.transport,
        args.messages,
        args.size,
        args.depth,
        n,
        args.heartbeat_ms,
        args.suspect_after_ms,
    )
    total = n * args.messages
    killed: int | None = None
    killed_at = 0.0
    start = time.monotonic()
    last_views: dict[int, tuple[int, list[int]]] = {}
    tty = sys.stdout.isatty()
    cr, end = ("\r", "") if tty else ("", "\n")
    last_line = 0.0
    while run.alive() and time.monotonic() - start < args.timeout:
        run.poll(0.05)
        done = max(run.progress.values(), default=0)
        for m, v in sorted(run.views.items()):
            if last_views.get(m) != v:
                last_views[m] = v
                print(f"{cr}  member {m} installed view {v[0]}: members {v[1]}" + " " * 20)
        if tty or time.monotonic() - last_line >= 1.0:
            last_line = time.monotonic()
            print(f"{cr}  delivered {done:>7}/{total}  alive {run.alive()}", end=end, flush=True)
        if not args.no_kill and killed is None and done >= total // 2:
            killed = n - 1
            killed_at = time.monotonic()
            run.kill(killed)
            print(f"{cr}  SIGKILL member {killed} at {done} delivered" + " " * 20)
        if len(run.reports) + (1 if killed is not None else 0) >= n:
            break
    print()
    run.finish(10.0)
    if killed is not None:
        after = [t - killed_at for (m, v), t in run.view_times.items() if v > 0 and t > killed_at]
        if after:
            print(
                f"view change after the kill: survivors installed the new view "
                f"{min(after) * 1000:.0f}-{max(after) * 1000:.0f} ms after SIGKILL "
                f"(suspect_after_ms = {args.suspect_after_ms:.0f})"
            )
    return _report(run, killed, n)


def _report(run: LocalRun, killed: int | None, n: int) -> int:
    rows = [["member", "state", "delivered", "msgs/s", "p50 µs", "p99 µs", "views", "log digest"]]
    for m in range(n):
        r = run.reports.get(m)
        if r is None:
            state = "killed" if m == killed else ("error" if m in run.errors else "no report")
            rows.append([str(m), state, "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                str(m),
                "survivor",
                str(r["delivered"]),
                f"{r['msgs_per_s']:.0f}",
                f"{r['p50_us']:.0f}",
                f"{r['p99_us']:.0f}",
                ",".join(map(str, r["views"])),
                r["digest"][:12],
            ]
        )
    print(_table(rows))
    for m, e in sorted(run.errors.items()):
        print(f"member {m}: {e}")
    survivors = [m for m in range(n) if m != killed]
    digests = {run.reports[m]["digest"] for m in survivors if m in run.reports}
    same = len(digests) == 1 and all(m in run.reports for m in survivors)
    if killed is not None and killed in run.reports:
        print(f"(member {killed} had finished before the kill: use more --messages)")
    print(f"\nsurvivors' logs identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


class _Progress:
    """Progress lines on stderr, every ``every`` seconds (0: none): rewritten in place on a
    terminal, one line each otherwise; stdout stays for the results."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.last = self.start
        self.width = 0

    def tick(self, text: str) -> None:
        now = time.monotonic()
        if self.every <= 0 or now - self.last < self.every:
            return
        self.last = now
        line = f"{text}, {now - self.start:.1f} s"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        """Erase the line rewritten in place (a terminal only)."""
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def cmd_bench(args: argparse.Namespace) -> int:
    n = args.members
    senders = n if args.senders == "all" else int(args.senders)
    run = LocalRun(
        n,
        args.transport,
        args.messages,
        args.size,
        args.depth,
        senders,
        args.heartbeat_ms,
        args.suspect_after_ms,
    )
    total = senders * args.messages + n  # the appends and every member's done marker
    progress = _Progress(args.progress)
    start = time.monotonic()
    try:
        while len(run.reports) < n and run.alive() and time.monotonic() - start < args.timeout:
            run.poll(0.1)
            done = min((run.progress.get(m, 0) for m in range(n)), default=0)
            progress.tick(f"bench: delivered {done}/{total} ({100 * done // total}%) at the "
                          f"slowest of {n} members")
    finally:
        progress.clear()
    run.finish(10.0)
    setup = {
        "transport": args.transport,
        "members": n,
        "senders": senders,
        "messages": args.messages,
        "size": args.size,
        "depth": args.depth,
        "cores": os.cpu_count(),
    }
    if len(run.reports) < n:
        why = f"reports from {sorted(run.reports)} only; errors {run.errors}"
        if args.json:
            print(json.dumps({**setup, "ok": False, "error": why}))
        print(f"bench failed: {why}", file=sys.stderr)
        return 1
    r = list(run.reports.values())
    same = len({x["digest"] for x in r}) == 1
    result = {
        "delivered": r[0]["delivered"],
        "msgs_per_s": min(x["msgs_per_s"] for x in r),
        "p50_us": max(x["p50_us"] for x in r),
        "p99_us": max(x["p99_us"] for x in r),
        "p999_us": max(x["p999_us"] for x in r),
    }
    if args.json:
        per_member = [
            {"member": m, **{k: run.reports[m][k] for k in (
                "delivered", "elapsed", "msgs_per_s", "p50_us", "p99_us", "p999_us", "digest")}}
            for m in sorted(run.reports)
        ]
        print(json.dumps({**setup, "ok": same, **result, "logs_identical": same,
                          "per_member": per_member}))
        return 0 if same else 1
    rows = [
        [
            "transport",
            "members",
            "senders",
            "size B",
            "msgs",
            "msgs/s (min member)",
            "p50 µs",
            "p99 µs",
            "p99.9 µs",
        ],
        [
            args.transport,
            str(n),
            str(senders),
            str(args.size),
            str(result["delivered"]),
            f"{result['msgs_per_s']:.0f}",
            f"{result['p50_us']:.0f}",
            f"{result['p99_us']:.0f}",
            f"{result['p999_us']:.0f}",
        ],
    ]
    print(_table(rows))
    print(
        f"(cores: {os.cpu_count()}; outstanding calls per sender: {args.depth}; "
        f"latency is the ordered call, submit to every member's reply)"
    )
    if not same:
        print("members' logs differ", file=sys.stderr)
    return 0 if same else 1


def _stamp(wall: float | None = None) -> str:
    """Local wall-clock time in ISO 8601, to the millisecond, with the UTC offset."""
    when = datetime.datetime.fromtimestamp(time.time() if wall is None else wall).astimezone()
    return when.isoformat(timespec="milliseconds")


class _MemberLines:
    """Turns the workload's reports into lines on stdout (progress at most once a second)."""

    def __init__(self, me: int, every: float = 1.0) -> None:
        self.me = me
        self.every = every
        self.last = 0.0

    def say(self, text: str, wall: float | None = None, err: bool = False) -> None:
        print(f"{_stamp(wall)} member {self.me}: {text}", flush=True,
              file=sys.stderr if err else sys.stdout)

    def put(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "view":
            _, _, view_id, members, installed_at = msg
            wall = time.time() - (time.monotonic() - installed_at)
            self.say(f"installed view {view_id}: members {', '.join(map(str, members))}", wall)
        elif kind == "progress":
            if time.monotonic() - self.last >= self.every:
                self.last = time.monotonic()
                self.say(f"delivered {msg[2]}")
        elif kind == "done":
            r = msg[2]
            self.say(
                f"done: delivered {r['delivered']} in {r['elapsed']:.2f} s "
                f"({r['msgs_per_s']:.0f} msgs/s); call latency p50 {r['p50_us']:.0f} µs, "
                f"p99 {r['p99_us']:.0f} µs, p99.9 {r['p999_us']:.0f} µs; views "
                f"{', '.join(map(str, r['views']))}; log digest {r['digest'][:12]}"
            )
        else:
            self.say(" ".join(map(str, msg)))


def cmd_member(args: argparse.Namespace) -> int:
    import uvloop

    import derecho_async as da
    from derecho_async.workload import run_member

    try:
        config = da.Config.load(args.config)
    except da.DerechoError as exc:
        print(f"derecho-async member: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    lines = _MemberLines(config.member_id)
    lines.say(f"joining group {config.group} over {config.transport}; {args.messages} appends "
              f"of {args.size} B, at most {args.depth} outstanding")

    async def go() -> None:
        await run_member(config, lines, args.messages, args.size, args.depth)

    try:
        uvloop.run(go())
    except da.DerechoError as exc:
        lines.say(f"failed: {type(exc).__name__}: {exc}", err=True)
        return 3
    lines.say("left the group")
    return 0


def _mib(files: Sequence[SegmentFile]) -> str:
    return f"{sum(f.size for f in files) / (1 << 20):.1f} MiB"


def _state(f: SegmentFile) -> str:
    if f.alive is not None:
        return "alive" if f.alive else "dead"
    return "another user's" if not f.mine else "not a segment name"


def cmd_status(args: argparse.Namespace) -> int:
    """List local groups' shared-memory segments with their owners' liveness; with ``--clean``
    remove those of dead owners (never a live owner's)."""
    from derecho_async.transport.shm.cleanup import remove_dead_owners, survey

    groups = survey()
    if args.groups:
        groups = {g: files for g, files in groups.items() if g in args.groups}
    out: list[dict[str, Any]] = []
    lines: list[str] = []
    for group, files in groups.items():
        alive = sorted({f.owner for f in files if f.alive and f.owner is not None})
        dead = sorted({f.owner for f in files if f.alive is False and f.owner is not None})
        other = sum(1 for f in files if f.alive is None)
        owners = (f"owners alive: {', '.join(map(str, alive)) or 'none'}; "
                  f"dead: {', '.join(map(str, dead)) or 'none'}")
        if other:
            owners += f"; {other} not judged (another user's, or a foreign name)"
        lines.append(f"group {group}: {len(files)} segments, {_mib(files)}; {owners}")
        for f in files:
            who = f"owner {f.owner}" if f.owner is not None else "owner ?"
            lines.append(f"  {f.name}  {f.size} bytes  {who} ({_state(f)})")
        gone = remove_dead_owners(group) if args.clean and dead else []
        if gone:
            lines.append(
                f"  removed {len(gone)} segments of dead owners "
                f"{', '.join(map(str, sorted({f.owner for f in gone if f.owner is not None})))}"
                f": {_mib(gone)}")
        out.append({
            "group": group,
            "segments": len(files),
            "bytes": sum(f.size for f in files),
            "owners_alive": alive,
            "owners_dead": dead,
            "not_judged": other,
            "files": [{"name": f.name, "size": f.size, "owner": f.owner, "mine": f.mine,
                       "alive": f.alive, "state": _state(f)} for f in files],
            "removed": [f.name for f in gone],
        })
    removed = sum(len(g["removed"]) for g in out)
    if args.json:
        print(json.dumps({"clean": args.clean, "groups": out, "removed": removed}, indent=2))
        return 0
    if not groups:
        print("no derecho_async shared-memory segments on this host"
              + (f" of {', '.join(args.groups)}" if args.groups else ""))
        return 0
    print("\n".join(lines))
    if args.clean:
        print(f"removed {removed} segments in all" if removed else
              "nothing to remove: no segment of a dead owner")
    elif any(g["owners_dead"] for g in out):
        print("(status --clean removes the segments of the dead owners)")
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    from derecho_async.durability.repair import repair_member
    from derecho_async.errors import DerechoError

    try:
        reports = repair_member(args.dir, accept_loss=args.accept_loss)
    except (DerechoError, OSError) as exc:
        print(f"derecho-async repair: {exc}", file=sys.stderr)
        return 2
    gaps = 0
    for r in reports:
        print(f"{r.name}: {'; '.join(r.cuts) if r.cuts else 'no damage found'}")
        print(f"  the files hold calls up to {r.held}; acknowledged as durable: {r.acked}")
        if r.gap and not args.accept_loss:
            gaps += 1
            print(f"  missing here: the calls after {r.held}. Start the member: it rejoins a "
                  "running group (which holds them), or restarts with members whose files "
                  "hold them; a restart where none does is refused unless --accept-loss")
        elif r.gap:
            print("  the acknowledged frontier is lowered to what the files hold "
                  "(--accept-loss): those calls are given up")
    return 0


def cmd_secret(args: argparse.Namespace) -> int:
    print(new_secret())
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from derecho_async.certs import CA_CERT, CA_KEY, issue, issue_clients, parse_members
    from derecho_async.errors import UsageError

    if args.members is None and args.clients is None:
        print("derecho-async certs: name --members, --clients or both", file=sys.stderr)
        return 2
    try:
        made = ([] if args.members is None else issue(
            args.dir, args.group, parse_members(args.members), days=args.days,
            overwrite=args.force))
        names = [] if args.clients is None else [n.strip() for n in args.clients.split(",")]
        clients = issue_clients(args.dir, args.group, names, days=args.days,
                                overwrite=args.force) if names else []
    except UsageError as exc:
        print(f"derecho-async certs: {exc}", file=sys.stderr)
        return 2
    ca = Path(args.dir) / CA_CERT
    print(f"CA: {ca} (keep {ca.with_name(CA_KEY)} private: it makes members and clients)")
    for m in made:
        print(f"member {m.member_id}: tls_cert = \"{m.cert}\", tls_key = \"{m.key}\","
              f" tls_ca = \"{m.ca}\"")
    for c in clients:
        print(f"client {c.name}: ctx = ssl.create_default_context(cafile=\"{c.ca}\");"
              f" ctx.load_cert_chain(\"{c.cert}\", \"{c.key}\"); Client.connect(..., tls=ctx)")
    return 0


def _count(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _version_line() -> str:
    """What ``derecho-async --version`` prints: the version, the active hot path (``native``
    or ``pure``) and the Python running it."""
    import derecho_async
    from derecho_async import hotpath

    return (f"derecho-async {derecho_async.__version__} (hot path: {hotpath.IMPLEMENTATION}, "
            f"Python {platform.python_version()})")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; each option's default after its help, unless it has none (a
    flag, a required option, an optional list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


_DESCRIPTION = """\
Run derecho_async groups on this host (a demo, a benchmark), one member of a
multi-host group, and the tools around them: shared-memory status and cleanup,
shared secrets, TLS certificates and the repair of damaged durable files.
"""

_EPILOG = 'Run "derecho-async COMMAND --help" for the options of a command.'

_DEMO = """\
Start a local group of member processes (each its own process and event
loop), let every member make ordered appends to a replicated log, SIGKILL the
last member halfway and show the view change. At the end the survivors' logs
are compared: they must be identical.
"""

_BENCH = """\
Measure the ordered throughput and call latency of a local group: each sender
makes ordered appends to a replicated log, keeping a window of calls
outstanding. Prints a table (with --json, one JSON object) of the slowest
member's messages per second and the worst member's latency percentiles.
Progress lines go to stderr.
"""

_MEMBER = """\
Run one member of a group (typically one of several hosts) from a TOML file
with a [derecho_async] table: group, member_id, transport, listen, peers,
secret and so on (see the README). The member runs the replicated-log
workload and prints one line per event, with the local wall-clock time.
"""

_STATUS = """\
List the shared-memory segments of derecho_async groups on this host (in
/dev/shm), by group, with each segment's owner and whether that owner is alive
now. With --clean, remove the segments whose owners are dead (what a group
whose members were killed leaves); a live owner's segments are never touched.
"""

_SECRET = """\
Print a fresh shared secret for the `secret` key: `dasec1.`, 256 random bits
as URL-safe text, and a check that catches a mistyped or cut copy. The secret
key takes nothing else. Give every member of a tcp or rdma group (and their
clients) the same one.
"""

_CERTS = """\
Make a group CA (once; reused when it exists) and a certificate and key for
each member, for the TLS mode (the tls_cert, tls_key and tls_ca keys), and for
external clients (--clients: a member's client port requires one in the TLS
mode; a member port refuses it). Needs the cryptography package (the tls
extra).
"""


_REPAIR = """\
Mend the durable files of one member (DIR: <data_dir>/<group>/member-<id>)
that refuses to start because a file is damaged (LogCorrupted): each
subgroup's log is cut at the first damaged record (what follows a hole cannot
be replayed), a damaged newest snapshot is removed, and what the files then
hold is printed beside the frontier the member acknowledged as durable. Start
the member again afterwards: it gets the calls it lacks from the others. Stop
the member first: never repair the files of a running member.
"""


def main(argv: list[str] | None = None) -> int:
    fmt = _HelpFormatter
    parser = argparse.ArgumentParser(
        prog="derecho-async", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=_version_line(),
                        help="print the version, the active hot path and the Python, and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, members: int, messages: int) -> None:
        p.add_argument("--members", type=int, default=members, metavar="N",
                       help="member processes, at least 2")
        p.add_argument("--transport", default="shm", choices=[
            n for n in registry.names() if not registry.kind(n).in_process],
            help="how the members talk")
        p.add_argument("--messages", type=_count, default=messages, metavar="N",
                       help="appends per sender")
        p.add_argument("--size", type=_count, default=1024, metavar="BYTES",
                       help="message size")
        p.add_argument("--depth", type=_count, default=32, metavar="N",
                       help="outstanding calls per sender")
        p.add_argument("--heartbeat-ms", type=float, default=50.0, metavar="MS",
                       help="heartbeat interval")
        p.add_argument("--suspect-after-ms", type=float, default=500.0, metavar="MS",
                       help="a member silent this long is suspected")
        p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                       help="give up after this long")

    demo = sub.add_parser("demo", help="a local group with a member killed halfway",
                          description=_DEMO, formatter_class=fmt)
    common(demo, 3, 10000)
    demo.add_argument("--no-kill", action="store_true", help="do not kill a member")
    demo.set_defaults(fn=cmd_demo)
    bench = sub.add_parser("bench", help="ordered msgs/s and latency of a local group",
                           description=_BENCH, formatter_class=fmt)
    common(bench, 3, 20000)
    bench.add_argument("--senders", default="all", metavar="N",
                       help="how many of the members send: 'all' or a number")
    bench.add_argument("--json", action="store_true",
                       help="print the results as one JSON object (and nothing else on stdout)")
    bench.add_argument("--progress", type=float, default=1.0, metavar="SECONDS",
                       help="seconds between progress lines on stderr; 0: none")
    bench.set_defaults(fn=cmd_bench)
    member = sub.add_parser("member", help="run one member of a multi-host group",
                            description=_MEMBER, formatter_class=fmt)
    member.add_argument("--config", required=True, metavar="TOML",
                        help="the member's TOML file (see the README)")
    member.add_argument("--messages", type=_count, default=1000, metavar="N",
                        help="appends this member makes")
    member.add_argument("--size", type=_count, default=1024, metavar="BYTES",
                        help="message size")
    member.add_argument("--depth", type=_count, default=32, metavar="N",
                        help="outstanding calls")
    member.set_defaults(fn=cmd_member)
    status = sub.add_parser(
        "status", help="local groups' shared-memory segments and whether their owners are alive",
        description=_STATUS, formatter_class=fmt)
    status.add_argument("--clean", action="store_true",
                        help="remove the segments of dead owners (a live owner's are never "
                        "touched)")
    status.add_argument("--json", action="store_true",
                        help="print one JSON object (with --clean: what was removed)")
    status.add_argument("groups", nargs="*", metavar="GROUP",
                        help="only these groups (none named: every group on this host)")
    status.set_defaults(fn=cmd_status)
    secret = sub.add_parser("secret", help="print a fresh shared secret for the `secret` key",
                            description=_SECRET, formatter_class=fmt)
    secret.set_defaults(fn=cmd_secret)
    certs = sub.add_parser(
        "certs", help="make a group CA and member certificates for the TLS mode",
        description=_CERTS, formatter_class=fmt)
    certs.add_argument("--group", required=True, help="the group's name (`group` key)")
    certs.add_argument("--members", metavar="IDS",
                       help="member ids: 0-2, 0,1,5 or 7 (a joiner's id later)")
    certs.add_argument("--clients", metavar="NAMES",
                       help="external clients' names, comma-separated (1-64 of A-Za-z0-9_.-"
                       " each): certificates a member's client port takes in the TLS mode")
    certs.add_argument("--dir", default="certs",
                       help="where the CA and the members' files are (the CA is made if "
                       "absent, else reused)")
    certs.add_argument("--days", type=_count, default=365, metavar="N",
                       help="member certificates' validity in days")
    certs.add_argument("--force", action="store_true",
                       help="replace members' files that exist")
    certs.set_defaults(fn=cmd_certs)
    repair = sub.add_parser(
        "repair", help="mend a stopped member's damaged durable files (cut at the damage)",
        description=_REPAIR, formatter_class=fmt)
    repair.add_argument("dir", metavar="DIR", help="the member's directory: "
                        "<data_dir>/<group>/member-<id>")
    repair.add_argument("--accept-loss", action="store_true",
                        help="also lower the acknowledged frontier to what the files hold, "
                        "so that a restart after total failure may go on without the calls "
                        "that are gone")
    repair.set_defaults(fn=cmd_repair)
    args = parser.parse_args(argv)
    if args.cmd in ("demo", "bench") and args.members < 2:
        sub.choices[args.cmd].error("--members must be at least 2")
    if args.cmd == "bench" and args.senders != "all" and not (
            args.senders.isdigit() and 1 <= int(args.senders) <= args.members):
        bench.error(f"--senders must be 'all' or 1 to {args.members}, not {args.senders!r}")
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
