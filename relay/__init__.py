"""The reference deployment's composition: its ``Outbox`` (factory.py), Celery app (``relay.app``) for beat,
workers and ``outbox relay``, the Orders HTTP app (``relay.wsgi``) and the embedded Redis."""
