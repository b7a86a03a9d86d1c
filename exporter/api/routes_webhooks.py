"""Webhook endpoints, their delivery log, and redelivery."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..store.keys import ApiKey
from ..webhooks import check_url, new_secret
from .auth import require
from .models import DeliveryList, DeliveryOut, WebhookBody, WebhookCreated, WebhookList, WebhookOut

router = APIRouter()


@router.post("/v1/webhooks", status_code=201, response_model=WebhookCreated, tags=["webhooks"])
def create_webhook(body: WebhookBody, request: Request, key: ApiKey = require("train")):
    """Register an endpoint for some events. The answer holds its whsec_ secret: shown only this once."""
    s = request.app.state.services
    check_url(body.url, s.allowed_networks)
    secret = new_secret()
    ep = s.webhooks.create_endpoint(key.tenant, body.url, list(body.events), s.box.seal(secret))
    return {**ep.to_dict(), "secret": secret}


@router.get("/v1/webhooks", response_model=WebhookList, tags=["webhooks"])
def list_webhooks(request: Request, key: ApiKey = require("read")):
    return {"data": [e.to_dict() for e in request.app.state.services.webhooks.list_endpoints(key.tenant)]}


@router.get("/v1/webhooks/{webhook_id}", response_model=WebhookOut, tags=["webhooks"])
def get_webhook(webhook_id: str, request: Request, key: ApiKey = require("read")):
    return request.app.state.services.webhooks.get_endpoint(key.tenant, webhook_id).to_dict()


@router.delete("/v1/webhooks/{webhook_id}", status_code=204, tags=["webhooks"])
def delete_webhook(webhook_id: str, request: Request, key: ApiKey = require("train")):
    request.app.state.services.webhooks.delete_endpoint(key.tenant, webhook_id)


@router.get("/v1/webhooks/{webhook_id}/deliveries", response_model=DeliveryList, tags=["webhooks"])
def list_deliveries(webhook_id: str, request: Request, key: ApiKey = require("read")):
    """The delivery log: every delivery owed to this endpoint, newest first, with each attempt."""
    w = request.app.state.services.webhooks
    w.get_endpoint(key.tenant, webhook_id)
    return {"data": [{**d.to_dict(), "log": w.attempts(d.id)} for d in w.deliveries(webhook_id)]}


@router.post("/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver", status_code=202, response_model=DeliveryOut, tags=["webhooks"])
def redeliver(webhook_id: str, delivery_id: str, request: Request, key: ApiKey = require("train")):
    """Send a delivery again (same webhook-id, a fresh retry schedule)."""
    w = request.app.state.services.webhooks
    w.get_endpoint(key.tenant, webhook_id)
    w.get_delivery(delivery_id, webhook_id)
    d = w.redeliver(delivery_id, webhook_id)
    return {**d.to_dict(), "log": w.attempts(d.id)}
