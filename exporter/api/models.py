"""Request and response bodies of the HTTP API (they make the OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Format = Literal["merged-safetensors", "lora-adapter", "gguf", "gguf-lora"]
Destination = Literal["signed-url", "hf-hub"]
EventType = Literal["export.started", "export.succeeded", "export.failed", "export.cancelled", "checkpoint.expiring"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExportOptions(Strict):
    quant: str | None = Field(None, description="GGUF type: f16, bf16, f32, q8_0, q4_0, q5_0, q3_k_m, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k", max_length=20)
    dtype: str | None = Field(None, description="safetensors dtype: bf16, fp16, fp32 (default: the base model's)", max_length=20)
    verify: bool | None = Field(None, description="compare the export's outputs with the reference (default: on for models up to 2B parameters)")
    private: bool | None = Field(None, description="hf-hub: create the repo private (default true)")
    revision: str | None = Field(None, description="hf-hub: the branch to commit to (created from main if new)", max_length=200)
    commit_message: str | None = Field(None, max_length=1000)
    replace_card: bool = Field(False, description="hf-hub: replace an existing README.md model card")
    hf_token_ref: str | None = Field(None, description="hf-hub: secret:NAME, resolved on the workers; default the server's token", max_length=80)
    allow_unknown_pretokenizer: bool | None = Field(None, description="gguf: export even when llama.cpp does not know the tokenizer's pre-tokenizer")


class ExportBody(ExportOptions):
    format: Format
    destination: Destination = "signed-url"
    hf_repo: str | None = Field(None, description="hf-hub: namespace/name", max_length=200)


class ExportAccepted(BaseModel):
    operation: str
    format: str
    status: str


class Progress(BaseModel):
    percent: float | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    eta_seconds: float | None = None
    message: str | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str | None = None


class OperationOut(BaseModel):
    operation: str
    type: str
    status: str
    stage: str | None = None
    progress: Progress
    format: str | None = None
    run_id: str | None = None
    checkpoint_id: str | None = None
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    attempts: int
    created_at: str
    started_at: str | None = None
    updated_at: str
    finished_at: str | None = None


def operation_out(op) -> dict:
    d = op.to_dict()
    d.pop("request", None)  # holds internals (archive URI, secret references): not echoed back
    return d


class OperationList(BaseModel):
    data: list[OperationOut]
    next_cursor: str | None = None


class EventOut(BaseModel):
    seq: int
    at: str
    kind: str
    data: dict[str, Any] | None = None


class EventList(BaseModel):
    data: list[EventOut]


class CheckpointBody(Strict):
    checkpoint_id: str | None = Field(None, description="id within the run, e.g. sampler_weights/000240", max_length=200)
    checkpoint: str | None = Field(None, description="or the full name: nucleus://run_3Bz:train:0/sampler_weights/000240", max_length=400)
    uri: str = Field(..., description="where the archive is: s3://bucket/key, https://…, file:///…", min_length=1, max_length=2000)
    base_model: str | None = Field(None, max_length=300, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
                                   description="a Hub id (org/name), found in the workers' model store or on the Hub")
    step: int | None = Field(None, ge=0)
    sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$")
    size: int | None = Field(None, ge=0)
    ttl_seconds: int | None = Field(None, ge=1, le=10 * 365 * 24 * 3600)


class CheckpointOut(BaseModel):
    run_id: str
    checkpoint_id: str
    checkpoint: str
    uri: str
    sha256: str | None = None
    size: int | None = None
    base_model: str | None = None
    step: int | None = None
    created_at: str
    expires_at: str | None = None
    deleted: bool


class CheckpointList(BaseModel):
    data: list[CheckpointOut]


class ExpiryBody(Strict):
    ttl_seconds: int | None = Field(..., ge=1, le=10 * 365 * 24 * 3600, description="seconds from now; null clears the expiry")


class SignedUrlOut(BaseModel):
    url: str
    expires_at: str


class WebhookBody(Strict):
    url: str = Field(..., min_length=1, max_length=2000)
    events: list[EventType] = Field(..., min_length=1)


class WebhookOut(BaseModel):
    id: str
    url: str
    events: list[str]
    enabled: bool
    disabled_reason: str | None = None
    created_at: str


class WebhookCreated(WebhookOut):
    secret: str = Field(..., description="the whsec_ signing secret; shown only now")


class WebhookList(BaseModel):
    data: list[WebhookOut]


class DeliveryOut(BaseModel):
    id: str
    endpoint_id: str
    event_type: str
    status: str
    attempts: int
    next_attempt_at: str | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    created_at: str
    updated_at: str
    payload: dict[str, Any]
    log: list[dict[str, Any]] = []


class DeliveryList(BaseModel):
    data: list[DeliveryOut]


class RuleBody(ExportOptions):
    formats: list[Format] = Field(..., min_length=1)
    destination: Destination = "signed-url"
    hf_repo: str | None = Field(None, max_length=200)
    every_n_steps: int | None = Field(None, ge=1)


class RuleOut(BaseModel):
    id: str
    run_id: str
    formats: list[str]
    destination: str
    hf_repo: str | None = None
    every_n_steps: int | None = None
    options: dict[str, Any]
    created_at: str


class RuleList(BaseModel):
    data: list[RuleOut]


class HookOperation(BaseModel):
    operation: str
    format: str
    status: str
    rule_id: str
    created: bool


class HookResult(BaseModel):
    checkpoint: str
    operations: list[HookOperation]
