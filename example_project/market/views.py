"""A small JSON API: enqueue a purchase, and look at the per-account limits."""

from __future__ import annotations

import json
import time

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from celery_redsem import get_client, get_config
from celery_redsem.ops.admin import state_to_dict, states

from .tasks import buy_item


@csrf_exempt
@require_POST
def buy(request: HttpRequest) -> JsonResponse:
    """``POST /market/buy/`` with ``account`` and ``item`` (form or JSON): enqueue a purchase."""
    if request.content_type == "application/json":
        data = json.loads(request.body or b"{}")
    else:
        data = request.POST
    account, item = data.get("account"), data.get("item")
    if not account or not item:
        return JsonResponse({"error": "account and item are required"}, status=400)
    result = buy_item.delay(str(account), str(item), 0.5, time.time())
    return JsonResponse({"task_id": result.id, "account": account, "item": item}, status=202)


@require_GET
def limits(request: HttpRequest) -> JsonResponse:
    """``GET /market/limits/``: every account's semaphore (holders and waiting line)."""
    app = buy_item.app
    found, total = states(get_client(app), prefix=get_config(app).key_prefix, pattern="market:*")
    return JsonResponse({"total": total, "accounts": [state_to_dict(s) for s in found]})
