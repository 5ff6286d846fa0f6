"""The user API: replicated actors (more of the API layer moves here; see docs/DESIGN.md §7.2)."""

from __future__ import annotations

from derecho_async.api.actor import Actor, ActorSpec, actor_spec, ordered, p2p

__all__ = ["Actor", "ActorSpec", "actor_spec", "ordered", "p2p"]
