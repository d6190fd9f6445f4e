"""The relay: outbox rows -> broker, publish first, mark after (docs/design.md, rules 2-5). No Celery here."""
