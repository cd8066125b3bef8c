"""Names for requests in admin views and logs."""

from __future__ import annotations

import hashlib


def request_tag(request_id: str) -> str:
    """A short name for a request in admin views and logs that cannot be turned back into its id."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:12]
