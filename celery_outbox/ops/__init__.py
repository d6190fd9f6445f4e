"""Operations: dead-letter inspection and replay, retention, stats, metrics, Celery events, admin page.

Everything here reads the same tables the relay and consumers write, so a person on call sees one
picture whichever process failed.
"""
