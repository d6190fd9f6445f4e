"""An e-mail provider client with idempotency keys, and a local fake that honours them.

The pattern (rule 9): an effect outside the database cannot join the inbox transaction, so it is
called with an idempotency key derived from (message_id, consumer). A retry after a crash, a failed
commit or a parallel duplicate calls again with the SAME key and the provider sends nothing new.
Real providers (Postmark, SendGrid, SES via a wrapper, Stripe for payments) accept such a key; the
fake records one ``SentEmail`` row per key and counts the calls, so tests can prove "called twice,
sent once".
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox import Clock, DatabaseError, SystemClock, upsert
from consumers.models import SentEmail


class EmailProvider(Protocol):
    def send(self, *, to: str, subject: str, body: str, idempotency_key: str) -> str:
        """Send once per key; returns the provider's id for the message (same id for a repeated key)."""
        ...


def idempotency_key(message_id: object, consumer: str) -> str:
    """Stable per (message, consumer): every redelivery and replay derives the same key."""
    return f"{consumer}:{message_id}"


class FakeEmailProvider:
    """Records sends in ``sent_emails`` in its OWN committed transaction, like a remote service would."""

    def __init__(self, *, session: Session, clock: Clock | None = None) -> None:
        self._session = session
        self._clock = clock or SystemClock()

    def send(self, *, to: str, subject: str, body: str, idempotency_key: str) -> str:
        if self._session.in_transaction():
            self._session.commit()
        stmt = upsert(self._session, SentEmail, {
            "idempotency_key": idempotency_key, "to": to[:320], "subject": subject[:500], "calls": 1,
            "sent_at_ms": self._clock.now_ms(),
        }, keys=("idempotency_key",), update={"calls": SentEmail.calls + 1})
        try:
            self._session.execute(stmt)
            self._session.commit()
        except exc.DBAPIError as e:
            self._session.rollback()
            raise DatabaseError(f"fake e-mail provider could not record {idempotency_key}: {e.orig}") from e
        return idempotency_key
