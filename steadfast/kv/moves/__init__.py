"""KV moves: every change of a request's KV owner (handoff, transfer, migration, offload)."""
