from django.urls import path
from orders.views import place

urlpatterns = [path("orders", place)]
