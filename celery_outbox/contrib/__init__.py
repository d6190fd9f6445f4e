"""Framework integrations: ``contrib.flask`` (dead-letter page, /metrics) and ``contrib.django``."""
