"""Session table: the placement record of each live session (sticky decode instance, known context).

Bounded (`max_sessions`, least recently seen evicted first) and expiring (`ttl_s` since last seen).
Time is passed in so tests do not sleep.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from router.placement import SessionRecord


class SessionTable:
    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()

    def get(self, session_id: str, now: float) -> SessionRecord | None:
        record = self._records.get(session_id)
        if record is None:
            return None
        if now - record.last_seen > self.ttl_s:
            del self._records[session_id]
            return None
        return record

    def put(self, record: SessionRecord) -> None:
        self._records[record.session_id] = record
        self._records.move_to_end(record.session_id)
        while len(self._records) > self.max_sessions:
            self._records.popitem(last=False)

    def expire(self, now: float) -> None:
        for session_id in [s for s, r in self._records.items() if now - r.last_seen > self.ttl_s]:
            del self._records[session_id]

    def count_by_pool(self, now: float) -> dict[str, int]:
        self.expire(now)
        return dict(Counter(r.pool for r in self._records.values()))

    def records(self) -> list[SessionRecord]:
        return list(self._records.values())

    def drop_instance(self, decode: str) -> None:
        """Forget stickiness to a drained or removed decode instance (the pool choice stays)."""
        for session_id, record in list(self._records.items()):
            if record.decode == decode:
                self._records[session_id] = SessionRecord(record.session_id, record.pool, "", record.context_tokens,
                                                          record.last_seen)
