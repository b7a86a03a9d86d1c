"""Typed settings in one place.

Values come from NUCLEUS_EXPORT_* environment variables, over a TOML settings
file named by NUCLEUS_EXPORT_SETTINGS_FILE (keys are the field names below,
lower case), over the defaults. Secrets are never part of a repr.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from converters.archive import ArchiveLimits

PREFIX = "NUCLEUS_EXPORT_"


def _env(name: str, default, cast, file_values: dict):
    raw = os.environ.get(PREFIX + name.upper())
    if raw is None or raw == "":
        if name in file_values:
            raw = file_values[name]
            if not isinstance(raw, str):
                return cast(raw)
        else:
            return default
    if cast is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return cast(raw)


@dataclass(frozen=True)
class Settings:
    data_dir: Path = field(default_factory=lambda: Path.home() / ".local" / "share" / "nucleus-export")
    # operations store: PostgreSQL URL (postgresql+psycopg://…) or empty for SQLite in data_dir
    database_url: str | None = None
    model_store: str | None = None
    hf_offline: bool | None = None
    max_member_bytes: int = ArchiveLimits.max_member_bytes
    max_archive_bytes: int = ArchiveLimits.max_total_bytes
    max_compression_ratio: float = ArchiveLimits.max_compression_ratio
    max_archive_members: int = ArchiveLimits.max_members
    verify_max_params: int = 2_000_000_000
    # signed URLs: "kid:secret,kid2:secret2" (the first signs; all verify). Empty: a random
    # key is created once in data_dir/signing.key (mode 0600). Never logged.
    signing_keys: str | None = field(default=None, repr=False)  # a secret: never in reprs or logs
    public_base_url: str = "http://127.0.0.1:8000"
    url_ttl_seconds: int = 7 * 24 * 3600
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    max_attempts: int = 3
    s3_endpoint_url: str | None = None
    # where archives and exports live: empty for data_dir/artifacts, or s3://bucket/prefix
    artifact_store: str | None = None
    # the Hugging Face Hub: endpoint (empty for huggingface.co) and the server's write token
    hf_endpoint: str | None = None
    hf_token: str | None = field(default=None, repr=False)  # a secret: never in reprs or logs
    # per-request secret references (secret:NAME) resolve to files in this directory
    # or to NUCLEUS_EXPORT_SECRET_<NAME> variables
    secrets_dir: Path | None = None
    hub_retries: int = 4
    # the queue: "auto" (procrastinate when database_url is PostgreSQL, else embedded), "embedded", "procrastinate"
    queue: str = "auto"
    stalled_seconds: float = 30.0  # distributed mode: a worker silent this long is stalled; its jobs are retried
    # the HTTP service
    # besides the tenant's own checkpoints/<tenant>/ in the artifact store, where keys may register archives from
    archive_roots: str = ""  # comma-separated directories (file://)
    archive_buckets: str = ""  # comma-separated S3 buckets
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # in-process export workers of `serve` (0: API only); one CPU-heavy conversion at a time by default
    idempotency_retention_seconds: int = 24 * 3600
    # webhook retry delays in seconds after each failed attempt; its length is the number of retries
    webhook_retry_schedule: str = "5,300,1800,7200,18000,36000"
    webhook_timeout_seconds: float = 10.0
    # CIDRs webhooks may reach besides public addresses (e.g. 10.0.0.0/8 inside a cluster); empty: public only
    webhook_allowed_networks: str = ""
    # the whsec_ secret the training side signs POST /v1/hooks/checkpoint-saved with
    inbound_webhook_secret: str | None = field(default=None, repr=False)
    # encrypts stored webhook secrets; empty: a random key created once in data_dir/secret.key (0600)
    secret_key: str | None = field(default=None, repr=False)
    expiring_notice_seconds: int = 24 * 3600  # checkpoint.expiring is sent this long before an archive's expiry
    sweep_interval_seconds: float = 60.0

    @classmethod
    def from_env(cls) -> "Settings":
        file_values: dict = {}
        if os.environ.get(PREFIX + "SETTINGS_FILE"):
            import tomllib

            path = Path(os.environ[PREFIX + "SETTINGS_FILE"])
            with path.open("rb") as fh:
                file_values = tomllib.load(fh)
            unknown = set(file_values) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"{path}: unknown settings {', '.join(sorted(unknown))}")
        values = {}
        for f in fields(cls):
            default = getattr(cls(), f.name)
            cast = {"data_dir": Path, "secrets_dir": Path, "hf_offline": bool}.get(f.name, str if default is None else type(default))
            values[f.name] = _env(f.name, default, cast, file_values)
        return cls(**values)

    def store_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / 'operations.db').absolute()}"

    def _private_file(self, name: str) -> bytes:
        """A random secret created once in data_dir with mode 0600."""
        path = self.data_dir / name
        if not path.exists():
            import secrets

            self.data_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
            except FileExistsError:
                pass  # another process made it first
        return path.read_text().strip().encode()

    def secret_key_bytes(self) -> bytes:
        return self.secret_key.encode() if self.secret_key else self._private_file("secret.key")

    def archive_root_list(self) -> list[Path]:
        return [Path(p.strip()) for p in self.archive_roots.split(",") if p.strip()]

    def archive_bucket_list(self) -> list[str]:
        return [b.strip() for b in self.archive_buckets.split(",") if b.strip()]

    def retry_schedule(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.webhook_retry_schedule.split(",") if x.strip())

    def signing_key_map(self) -> dict[str, bytes]:
        if self.signing_keys:
            pairs = [p.split(":", 1) for p in self.signing_keys.split(",") if p.strip()]
            if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
                raise ValueError("NUCLEUS_EXPORT_SIGNING_KEYS must look like kid:secret[,kid:secret]")
            return {k.strip(): v.strip().encode() for k, v in pairs}
        return {"local": self._private_file("signing.key")}

    def artifacts(self):
        """The artifact store these settings name."""
        from .artifacts import LocalStore, S3Store

        if self.artifact_store:
            if not self.artifact_store.startswith("s3://"):
                raise ValueError("NUCLEUS_EXPORT_ARTIFACT_STORE must be empty (a local folder) or s3://bucket/prefix")
            bucket, _, prefix = self.artifact_store[5:].partition("/")
            return S3Store(bucket, prefix, endpoint_url=self.s3_endpoint_url)
        return LocalStore(self.data_dir / "artifacts", self.signing_key_map(), base_url=self.public_base_url)

    def runner_config(self):
        from .runner import RunnerConfig

        return RunnerConfig(work_dir=self.data_dir / "work", lease_seconds=self.lease_seconds, heartbeat_seconds=self.heartbeat_seconds,
                            max_attempts=self.max_attempts, url_ttl_seconds=self.url_ttl_seconds, model_store=self.model_store,
                            s3_endpoint_url=self.s3_endpoint_url, hf_endpoint=self.hf_endpoint, hf_token=self.hf_token,
                            secrets_dir=self.secrets_dir, hub_retries=self.hub_retries)

    def archive_limits(self) -> ArchiveLimits:
        return ArchiveLimits(
            max_member_bytes=self.max_member_bytes,
            max_total_bytes=self.max_archive_bytes,
            max_compression_ratio=self.max_compression_ratio,
            max_members=self.max_archive_members,
        )


def redact_url(url: str) -> str:
    """A database URL fit for a log line: the password masked."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
