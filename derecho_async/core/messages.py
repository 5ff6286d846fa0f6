"""Messages of the reliable channel the core uses (joins and state transfer).

They are frozen dataclasses. ``encode_message``/``decode_message`` turn them into plain,
msgpack-ready lists and back, validating every field of what came from the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from derecho_async.core.schema import MAX_MEMBERS
from derecho_async.errors import ProtocolViolation

__all__ = ["JoinRequest", "Message", "Welcome", "decode_message", "encode_message"]

_MAX_ID = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """``joiner`` asks to be admitted to the group."""

    joiner: int


@dataclass(frozen=True, slots=True)
class Welcome:
    """Admits a joiner: view ``view_id`` with ``members`` (rank order) and its ``state`` (a
    state-transfer ticket from the driver)."""

    view_id: int
    members: tuple[int, ...]
    state: bytes | None = None


Message = JoinRequest | Welcome

_JOIN = 1
_WELCOME = 2


def encode_message(msg: Message) -> list[object]:
    """A plain list (msgpack-ready) for ``msg``."""
    if isinstance(msg, JoinRequest):
        return [_JOIN, msg.joiner]
    return [_WELCOME, msg.view_id, list(msg.members), msg.state]


def _member_id(value: object) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_ID:
        raise ProtocolViolation(f"bad member id {value!r}")
    return value


def decode_message(raw: object) -> Message:
    """Validate and rebuild a message; :class:`ProtocolViolation` for anything malformed."""
    if not isinstance(raw, list | tuple) or not raw:
        raise ProtocolViolation("channel message is not a non-empty list")
    tag = raw[0]
    if tag == _JOIN and len(raw) == 2:
        return JoinRequest(_member_id(raw[1]))
    if tag == _WELCOME and len(raw) == 4:
        view_id = raw[1]
        if type(view_id) is not int or not 0 <= view_id <= _MAX_ID:
            raise ProtocolViolation(f"bad view id {view_id!r}")
        members = raw[2]
        if not isinstance(members, list | tuple) or not 1 <= len(members) <= MAX_MEMBERS:
            raise ProtocolViolation("welcome: members must be a list of 1..64 ids")
        ids = tuple(_member_id(m) for m in members)
        if len(set(ids)) != len(ids):
            raise ProtocolViolation("welcome: duplicate member ids")
        state = raw[3]
        if state is not None and not isinstance(state, bytes):
            raise ProtocolViolation("welcome: state must be bytes or nil")
        return Welcome(view_id, ids, state)
    raise ProtocolViolation(f"unknown channel message {tag!r} of {len(raw)} fields")
