"""Golden scenario scripts for the simulated cluster.

A script (``tests/scenarios/*.txt``) is a list of commands, one per line, then a line
``--- expected ---`` and the recorded outcome. Commands::

    cluster N [seed=S] [window=W] [max_payload=P]
    send M PAYLOAD            # PAYLOAD as text; '*K' suffix repeats it K times (large messages)
    sends M1,M2,... COUNT TAG # COUNT messages round-robin over the members: TAG-0, TAG-1, ...
    run TICKS
    idle                      # run_until_idle, which must succeed
    crash M | leave M | join M | heal
    partition A,B,... C,D,...
    crash_when M proposed|committed   # crash M once it has published a proposal / a commit
    check

The outcome lists, per member, its views and its deliveries (view:seq:sender:payload, payloads
longer than 16 bytes shortened to a length). Re-record every script with
``DERECHO_ASYNC_RERECORD=1 pytest tests/test_scenarios.py``.
"""

from __future__ import annotations

from pathlib import Path

from derecho_async.core import Member
from derecho_async.testing import SimCluster

SEPARATOR = "--- expected ---"


def _proposed(core: Member) -> bool:
    return core.wedged and core.table.mine(core.schema.prop_ballot) != 0


def run_script(text: str) -> str:
    cluster: SimCluster | None = None
    start_views: dict[int, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cmd, *args = line.split()
        if cmd == "cluster":
            opts = dict(a.split("=") for a in args[1:])
            cluster = SimCluster(
                int(args[0]),
                seed=int(opts.get("seed", 0)),
                window=int(opts.get("window", 8)),
                max_payload=int(opts.get("max_payload", 256)),
            )
            continue
        assert cluster is not None, f"line {lineno}: 'cluster' must come first"
        c = cluster
        if cmd == "send":
            body = args[1]
            if "*" in body:
                text_part, count = body.rsplit("*", 1)
                payload = text_part.encode() * int(count)
            else:
                payload = body.encode()
            assert c.send(int(args[0]), payload), f"line {lineno}: send refused"
        elif cmd == "sends":
            members = [int(x) for x in args[0].split(",")]
            for i in range(int(args[1])):
                c.send(members[i % len(members)], f"{args[2]}-{i}".encode())
        elif cmd == "run":
            c.run(int(args[0]))
        elif cmd == "idle":
            assert c.run_until_idle(), f"line {lineno}: the cluster did not become idle"
        elif cmd == "crash":
            c.crash(int(args[0]))
        elif cmd == "leave":
            c.leave(int(args[0]))
        elif cmd == "join":
            c.join(int(args[0]))
        elif cmd == "heal":
            c.heal()
        elif cmd == "partition":
            c.partition(*[[int(x) for x in side.split(",")] for side in args])
        elif cmd == "crash_when":
            m = int(args[0])
            if args[1] == "proposed":
                c.crash_when(m, _proposed)
            elif args[1] == "committed":
                start_views[m] = c.members[m].view.view_id
                v0 = start_views[m]
                c.crash_when(m, lambda core, v0=v0: core.view.view_id > v0)  # type: ignore[misc]
            else:
                raise AssertionError(f"line {lineno}: unknown condition {args[1]!r}")
        elif cmd == "check":
            c.check()
        else:
            raise AssertionError(f"line {lineno}: unknown command {cmd!r}")
    assert cluster is not None
    cluster.check()
    return describe(cluster)


def describe(c: SimCluster) -> str:
    out = [f"alive {sorted(c.alive())}"]
    for m in sorted(c.members):
        status = "crashed" if m in c.crashed else c.members[m].state.value
        views = " ".join(f"{v.view_id}{list(v.members)}".replace(" ", "") for v in c.views(m))
        out.append(f"member {m} {status} views {views}")
        items = []
        for d in c.delivered(m):
            p = d.payload.decode() if len(d.payload) <= 16 else f"<{len(d.payload)}B>"
            items.append(f"{d.view_id}:{d.seq}:{d.sender}:{p}")
        out.append("  " + " ".join(items))
    return "\n".join(out) + "\n"


def split(path: Path) -> tuple[str, str | None]:
    text = path.read_text()
    if SEPARATOR in text:
        script, expected = text.split(SEPARATOR + "\n", 1)
        return script, expected
    return text, None
