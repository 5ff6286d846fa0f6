"""Doorbells of shm members: UNIX datagram sockets that wake a sleeping peer and tell liveness.

Theory of operation (DESIGN.md §5.2): each member binds a datagram socket in the Linux abstract
namespace, ``\\0dasync/<uid>/<group>/<member>``. The kernel releases the name when the process
dies, so "is member m alive" is "does a datagram to its name get ECONNREFUSED"
(:func:`is_alive`); binding it is how a member knows it is the only live holder of its id.
Datagrams carry (kind, member, incarnation) and are only hints: the rings hold the truth. The
receiver asks for the sender's credentials (``SO_PASSCRED``) and ignores datagrams from other
uids and malformed ones.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

from derecho_async.errors import UsageError
from derecho_async.transport.base import log

__all__ = [
    "ABSENT",
    "DG",
    "D_BYE",
    "D_DATA",
    "D_PING",
    "D_RESTART",
    "D_SPACE",
    "FAILED",
    "FULL",
    "SENT",
    "Doorbell",
    "doorbell_name",
    "doorbell_prefix",
    "is_alive",
]

DG = struct.Struct("<IIQQ")  # kind, zero, member, incarnation
D_DATA, D_SPACE, D_BYE, D_RESTART, D_PING = 1, 2, 3, 4, 5
_UCRED = struct.Struct("iII")  # pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)

# what Doorbell.ring reports
SENT = 0  # the datagram is queued at the peer's socket
FULL = 1  # the peer's queue is full: retry later
ABSENT = 2  # nobody holds the peer's name (not running, or dead)
FAILED = 3  # another error (logged)


def doorbell_prefix(group: str) -> str:
    """What the names of this user's doorbells of ``group`` start with after their NUL byte."""
    return f"dasync/{os.getuid()}/{group}/"


def doorbell_name(group: str, member: int) -> str:
    """The abstract socket name of ``member``'s doorbell in ``group``."""
    return f"\0{doorbell_prefix(group)}{member}"


def is_alive(probe: socket.socket, group: str, member: int) -> bool:
    """Whether a process holds ``member``'s doorbell (conservative: unsure means alive).
    ``probe`` is any non-blocking UNIX datagram socket."""
    try:
        probe.sendto(DG.pack(D_PING, 0, 0, 0), doorbell_name(group, member))
        return True
    except BlockingIOError:
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True


class Doorbell:
    """The bound doorbell of ``member`` of ``group`` (incarnation ``inc``): rings peers' doorbells
    and reads its own. Raises :class:`UsageError` if the member is running already."""

    def __init__(self, group: str, member: int, inc: int) -> None:
        self.group = group
        self.member = member
        self.inc = inc
        self._names: dict[int, str] = {}
        self._uid = os.getuid()  # doorbells from other uids are ignored
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(self._name(member))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"member {member} of group {group!r} is already running on this host"
                ) from exc
            raise
        sock.setblocking(False)
        self._sock = sock

    def fileno(self) -> int:
        """The socket's fd (readable when datagrams wait)."""
        return self._sock.fileno()

    def alive(self, member: int) -> bool:
        """:func:`is_alive` for ``member`` of this group, probing from this socket."""
        return is_alive(self._sock, self.group, member)

    def _name(self, member: int) -> str:
        name = self._names.get(member)
        if name is None:
            name = self._names[member] = doorbell_name(self.group, member)
        return name

    def ring(self, peer: int, kind: int) -> int:
        """Send one datagram of ``kind`` to ``peer``: :data:`SENT`, :data:`FULL`,
        :data:`ABSENT` or :data:`FAILED` (logged)."""
        try:
            self._sock.sendto(DG.pack(kind, 0, self.member, self.inc), self._name(peer))
        except BlockingIOError:
            return FULL
        except (ConnectionRefusedError, FileNotFoundError):
            return ABSENT
        except OSError as exc:
            log.warning("member %d: doorbell to member %d failed: %s", self.member, peer, exc)
            return FAILED
        return SENT

    def receive(self) -> list[tuple[int, int, int]]:
        """(kind, member, incarnation) of the datagrams waiting (at most 256), from this uid
        and other members only."""
        sock = self._sock
        uid = self._uid
        cmsg_space = _CMSG_SPACE
        got = []
        for _ in range(256):
            try:
                data, anc, _flags, _addr = sock.recvmsg(64, cmsg_space)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("member %d: doorbell recv failed: %s", self.member, exc)
                break
            cred_uid = None
            for level, typ, cdata in anc:
                if (
                    level == socket.SOL_SOCKET
                    and typ == socket.SCM_CREDENTIALS
                    and len(cdata) >= _UCRED.size
                ):
                    cred_uid = _UCRED.unpack_from(cdata)[1]
            if cred_uid != uid or len(data) != DG.size:
                log.debug("member %d: ignored a foreign or malformed doorbell", self.member)
                continue
            kind, zero, member, inc = DG.unpack(data)
            if zero or member == self.member:
                continue
            got.append((kind, member, inc))
        return got

    def close(self) -> None:
        """Unbind: from now on peers see this member as not running."""
        self._sock.close()
