"""The relay: outbox rows -> broker, publish first, mark after (DESIGN rules 2-5).

``relay.kombu_publisher`` (the only kombu importer) is not imported here, so the core and the
in-memory publisher load without a broker library.
"""

from relay.breaker import CircuitBreaker
from relay.dispatch import BatchResult, dispatch_batch, dispatch_with_settings
from relay.memory import InMemoryPublisher, PublisherCrashed
from relay.publisher import Publisher, PublishReport

__all__ = [
    "BatchResult",
    "CircuitBreaker",
    "InMemoryPublisher",
    "PublishReport",
    "Publisher",
    "PublisherCrashed",
    "dispatch_batch",
    "dispatch_with_settings",
]
