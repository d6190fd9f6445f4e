"""The reference deployment's relay: its Celery app (``relay.app``) for beat, workers and ``outbox relay``."""
