"""Members' listen addresses beyond the configured ``peers``: the ``contact`` key and
``MEMBER_ADDR``.

Theory of operation (docs/DESIGN.md §7.1, "Addresses"). A joiner may know one member: the
``contact`` address, whose member id the transport learns from the handshake
(:meth:`Addresses.reach_contact`), or a ``peers`` table naming some members. That member knows
the joiner (from its handshake) and the rest; the others know neither. So at a view with
joiners every member sends the addresses it knows of the view's members to every member it can
reach, and a member that is not the leader answers a joiner's ``JoinRequest`` with them; a
joiner adds those members to its core's contacts (only the leader admits). Addresses of members
the receiver's view does not name yet wait, boundedly, for a view that does. A learnt address
only fills a link that has none and admits nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from derecho_async.config import Config
from derecho_async.core import Member, MemberState
from derecho_async.errors import GroupClosed, JoinRefused
from derecho_async.transport.base import Transport
from derecho_async.wire import envelope as env

__all__ = ["Addresses"]

log = logging.getLogger("derecho_async.driver")

HEARD_AT_MOST = 256
"""Addresses of members not in this member's view yet, kept at most."""


class Addresses:
    """One member's share of the address exchange (see the module header)."""

    def __init__(self, me: int, transport: Transport) -> None:
        self.me = me
        self.transport = transport
        self._heard: dict[int, tuple[str, int]] = {}  # members not in the view yet

    async def reach_contact(self, config: Config) -> int:
        """The id of the member at the ``contact`` address (retried for ``join_timeout_s``)."""
        assert config.contact is not None
        try:
            member = await self.transport.identify(config.contact, config.join_timeout_s)
        except ConnectionError as exc:
            raise GroupClosed(f"member {self.me} was not admitted to group "
                              f"{config.group!r}: {exc}") from None
        if member == self.me:
            raise JoinRefused(f"the contact {config.contact} answers as member {member}: "
                              "this member's own id")
        log.info("member %d: the contact %s is member %d", self.me, config.contact, member)
        return member

    def share(self, members: Sequence[int], to: Sequence[int] | None = None) -> None:
        """Tell ``to`` (default: every member of ``members`` this one can reach) the listen
        addresses this member knows of ``members``."""
        known = self.transport.known_addresses()
        table = [[m, *known[m]] for m in members if m in known]
        if not table:
            return
        msg = env.encode(env.MEMBER_ADDR, table)
        for m in members if to is None else to:
            if m != self.me and m in known:
                self.transport.send(m, msg)

    def heard(self, core: Member | None, table: list[list[Any]]) -> None:
        """A ``MEMBER_ADDR`` table (validated by ``env.decode``): while joining, its members
        become contacts too; else the current view's members' addresses are used at once and
        the others' kept for a view that names them. Known addresses stay."""
        if core is not None and core.state is MemberState.JOINING:  # may name the leader
            for m, host, port in table:
                if m != self.me:
                    self.transport.learn_address(m, (host, port))
            core.add_contacts([m for m, _, _ in table])
            return
        members = () if core is None or core.view is None else core.view.members
        for m, host, port in table:
            if m == self.me:
                continue
            if m in members:
                self.transport.learn_address(m, (host, port))
            elif m in self._heard or len(self._heard) < HEARD_AT_MOST:
                self._heard[m] = (host, port)

    def on_view(self, members: Sequence[int], joined: Sequence[int]) -> None:
        """A view is installed: use what was heard of its members; with joiners, share."""
        for m in members:
            heard = self._heard.pop(m, None)
            if heard is not None:
                self.transport.learn_address(m, heard)
        if joined:
            self.share(members)
