"""How the settings are declared and checked; the declarations themselves are in celery_outbox/settings.py.

One way: ``masking`` (secrets never shown) <- ``rules`` (one variable's reading and values) <- ``declare``
(``setting()``, ``Option``, the relations between settings) <- ``celery_outbox.settings``.
"""
