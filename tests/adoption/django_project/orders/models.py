from django.db import models


class Order(models.Model):
    id = models.CharField(max_length=64, primary_key=True)


class Notification(models.Model):  # the consumer's effect; NOT unique per order, so a double effect would show
    order_id = models.CharField(max_length=64)
