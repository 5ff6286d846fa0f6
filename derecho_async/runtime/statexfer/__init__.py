"""Fenced, streamed state transfer to a joiner.

Theory of operation: a member that welcomes a joiner sends a small ticket in the Welcome, not
its state. At that *sponsor* a hold goes into every actor's runner; once the calls delivered
before the joiner's view have finished, every ``snapshot()`` is taken and encoded with its large
values out of band, and the result streams to the joiner in checked chunks on the data planes.
The *joiner* holds its own runners until it has verified every chunk and called each
``restore()``; any failure fails its join alone. See docs/DESIGN.md §7.7.

- :mod:`.wire`: the ticket, and the msg_no of a chunk's data key (:data:`STATE_TAG`);
- :mod:`.chunks`: freezing the state, cutting it into chunks, digests and the GPU checksum;
- :mod:`.sponsor`: the sending end (fence, snapshot, stream);
- :mod:`.joiner`: the receiving end (verify, rebuild, restore);
- :mod:`.context`: what both ends share;
- :mod:`.transfer`: :class:`StateTransfer`, both ends wired to the driver.
"""

from __future__ import annotations

from derecho_async.runtime.statexfer.joiner import MAX_STATE_BYTES
from derecho_async.runtime.statexfer.sponsor import WINDOW
from derecho_async.runtime.statexfer.transfer import StateTransfer
from derecho_async.runtime.statexfer.wire import (
    STATE_TAG,
    chunk_msg_no,
    decode_ticket,
    encode_ticket,
    is_state_key,
)

__all__ = [
    "MAX_STATE_BYTES",
    "STATE_TAG",
    "WINDOW",
    "StateTransfer",
    "chunk_msg_no",
    "decode_ticket",
    "encode_ticket",
    "is_state_key",
]
