"""URLs: the market app's small API."""

from django.urls import include, path

urlpatterns = [
    path("market/", include("market.urls")),
]
