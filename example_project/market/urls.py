from django.urls import path

from . import views

app_name = "market"
urlpatterns = [
    path("buy/", views.buy, name="buy"),
    path("limits/", views.limits, name="limits"),
]
