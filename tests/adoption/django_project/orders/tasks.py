from celery import shared_task

from orders.models import Notification


@shared_task(name="orders.confirm")
def confirm(order_id):
    Notification.objects.create(order_id=f"confirmed:{order_id}")


@shared_task(name="orders.confirm_once_killed")
def confirm_once_killed(order_id, marker):
    """The first run SIGKILLs its own worker process mid-task (the test's stand-in for kill -9)."""
    import os
    import signal
    from pathlib import Path

    if not Path(marker).exists():
        Path(marker).write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    Notification.objects.create(order_id=f"confirmed:{order_id}")
