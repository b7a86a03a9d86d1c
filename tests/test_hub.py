"""The hf-hub destination, published with the real huggingface_hub client to a local Hub-compatible server."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from converters import samples
from exporter.artifacts import LocalStore
from exporter.runner import RunnerConfig, Worker
from exporter.store import Store, sqlite_url

from .hub_server import HubServer

TOKEN = "hf_alice_write_token_0123456789"
READ_ONLY = "hf_bob_token_9876543210"
BASE_ID = "acme/tiny-qwen3"


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as C

    # the test server speaks the LFS protocol, not Xet
    monkeypatch.setattr(C, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)  # the suite runs offline; this Hub is on loopback
    server = HubServer()
    server.state.add_token(TOKEN, "alice", write=("alice", "acme-org"))
    server.state.add_token(READ_ONLY, "bob")
    yield server
    server.close()


@pytest.fixture
def env(tmp_path, model_dir, hub):
    store_root = tmp_path / "model-store"
    base = store_root / BASE_ID
    shutil.copytree(model_dir("qwen3"), base)
    archive = samples.build_archive(tmp_path / "ckpt.tar.gz", base, rank=8, meta={"run_id": "run_3Bz", "checkpoint_id": "000240", "step": 240})
    store = Store(sqlite_url(tmp_path / "ops.db"))
    config = RunnerConfig(work_dir=tmp_path / "work", lease_seconds=30, heartbeat_seconds=0.2, backoff_base=0.01, backoff_max=0.05,
                          model_store=str(store_root), hf_endpoint=hub.url, hf_token=TOKEN, hub_backoff_base=0.01)
    yield {"base": base, "archive": archive, "store": store, "artifacts": LocalStore(tmp_path / "artifacts", {"k": b"s"}), "config": config,
           "tmp": tmp_path, "sha": hashlib.sha256(archive.read_bytes()).hexdigest()}
    store.close()


def request(env, fmt="merged-safetensors", repo="alice/qwen3-export", **over) -> dict:
    return {"run_id": "run_3Bz", "checkpoint_id": "000240", "format": fmt, "destination": "hf-hub", "hf_repo": repo,
            "source": {"uri": str(env["archive"]), "sha256": env["sha"]}, "base": BASE_ID, "options": {"verify": False}, **over}


def run(env, req, config=None, key=None):
    op, _ = env["store"].create(req, idempotency_key=key)
    return Worker(env["store"], env["artifacts"], config or env["config"], "w1").run_once()


def download(hub, repo, tmp_path, token=TOKEN, revision=None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, endpoint=hub.url, token=token, revision=revision, cache_dir=str(tmp_path / "hf-cache")))


def test_merged_model_published_in_one_commit_and_loads_from_the_hub(env, hub, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = run(env, request(env))
    assert done.status == "succeeded", done.error_message
    repo = hub.state.repos["alice/qwen3-export"]
    history = repo.history()
    assert len(history) == 2, "one commit for the export, after the repo's initial commit"
    commit = history[0]
    r = done.result
    assert r["commit"] == commit.sha and r["repo"] == "alice/qwen3-export" and r["revision"] == "main"
    assert r["repo_url"].endswith("/alice/qwen3-export") and r["commit_url"].endswith(commit.sha)
    assert {f["name"] for f in r["files"]} | {"README.md", ".gitattributes"} == set(commit.files)
    assert repo.private, "repos are private unless the request says otherwise"
    assert commit.files["model.safetensors"].lfs_oid, "weights went through LFS"

    local = download(hub, "alice/qwen3-export", tmp_path)
    for f in r["files"]:
        assert hashlib.sha256((local / f["name"]).read_bytes()).hexdigest() == f["sha256"]
    model = AutoModelForCausalLM.from_pretrained(local)
    tok = AutoTokenizer.from_pretrained(local)
    ids = tok("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

    from huggingface_hub import ModelCard

    card = ModelCard.load(local / "README.md")
    assert card.data.base_model == BASE_ID and card.data.base_model_relation == "merge"
    assert card.data.library_name == "transformers" and "nucleus-export" in card.data.tags
    assert 'AutoModelForCausalLM.from_pretrained("alice/qwen3-export"' in card.text


def test_private_repo_needs_the_token_and_the_token_is_never_recorded(env, hub, tmp_path, caplog):
    from huggingface_hub.errors import HfHubHTTPError

    caplog.set_level(logging.DEBUG)
    done = run(env, request(env, fmt="lora-adapter"))
    assert done.status == "succeeded", done.error_message
    with pytest.raises(HfHubHTTPError):
        download(hub, "alice/qwen3-export", tmp_path / "anon", token=False)
    store = env["store"]
    recorded = json.dumps(done.to_dict()) + json.dumps([e.data for e in store.events(done.id)]) + caplog.text
    assert TOKEN not in recorded
    assert TOKEN.encode() not in (env["tmp"] / "ops.db").read_bytes()
    assert TOKEN not in repr(env["config"])


def test_publishing_again_adds_no_commit(env, hub):
    """A job resumed in the publishing stage sends the same files: no upload, no second commit."""
    from exporter.publish import PublishContext, publish

    done = run(env, request(env, fmt="lora-adapter"))
    assert done.status == "succeeded", done.error_message
    repo = hub.state.repos["alice/qwen3-export"]
    before = len(repo.history())
    # the converted output as a resumed job holds it: the same conversion, run again
    from converters import ConvertOptions, convert

    out = env["tmp"] / "again"
    convert(str(env["archive"]), BASE_ID, "lora-adapter", out, ConvertOptions(verify=False, model_store=env["config"].model_store, reproducible=True))
    uploads = sum(1 for m, p, _ in hub.state.requests if m == "PUT")
    ctx = PublishContext(env["artifacts"], 60, hf_endpoint=hub.url, hf_token=TOKEN)
    again = publish(done, out, ctx)
    assert again["commit"] == done.result["commit"]
    assert len(repo.history()) == before
    assert sum(1 for m, p, _ in hub.state.requests if m == "PUT") == uploads, "nothing uploaded twice"


def test_existing_card_is_kept_unless_replaced(env, hub):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("alice/carded", private=False)
    api.upload_file(path_or_fileobj=b"---\nlicense: mit\n---\n# My own card\n", path_in_repo="README.md", repo_id="alice/carded")
    done = run(env, request(env, fmt="lora-adapter", repo="alice/carded"))
    assert done.status == "succeeded", done.error_message
    repo = hub.state.repos["alice/carded"]
    assert repo.resolve("main").files["README.md"].data.endswith(b"# My own card\n")
    assert not repo.private, "an existing repo keeps its visibility"
    done = run(env, request(env, fmt="merged-safetensors", repo="alice/carded", hub={"replace_card": True}))
    assert done.status == "succeeded", done.error_message
    card = repo.resolve("main").files["README.md"].data.decode()
    assert "library_name: transformers" in card and "base_model_relation: merge" in card


def test_branch_revision_commit_message_and_public_repo(env, hub, tmp_path):
    req = request(env, fmt="lora-adapter", repo="acme-org/adapters", hub={"revision": "step-240", "commit_message": "Step 240 adapter", "private": False})
    done = run(env, req)
    assert done.status == "succeeded", done.error_message
    repo = hub.state.repos["acme-org/adapters"]
    assert not repo.private
    assert [c.message for c in repo.history("step-240")] == ["Step 240 adapter", "initial commit"]
    assert [c.message for c in repo.history("main")] == ["initial commit"], "main is untouched"
    assert done.result["revision"] == "step-240"
    local = download(hub, "acme-org/adapters", tmp_path, token=None, revision="step-240")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(env["base"]), local)
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_rate_limits_and_server_errors_are_retried(env, hub):
    hub.state.fail(r"POST /api/models/.*/preupload/", 429, times=1, headers={"Retry-After": "0"})
    hub.state.fail(r"POST /api/models/.*/commit/", 503, times=2)
    done = run(env, request(env, fmt="lora-adapter"))
    assert done.status == "succeeded", done.error_message
    assert len(hub.state.repos["alice/qwen3-export"].history()) == 2, "still exactly one commit"
    assert not hub.state.faults, "every injected fault was met"


def test_a_hub_that_stays_down_sends_the_job_back_for_retry(env, hub):
    hub.state.fail(r"POST /api/repos/create", 502, times=50)
    cfg = replace(env["config"], hub_retries=2, max_attempts=2)
    done = run(env, request(env, fmt="lora-adapter"), config=cfg)
    assert done.status == "queued" and done.error_code == "hub_unavailable"
    hub.state.faults.clear()
    import time

    time.sleep(0.1)  # the retry's backoff
    done = Worker(env["store"], env["artifacts"], cfg, "w2").run_once()
    assert done.status == "succeeded" and done.attempts == 2


@pytest.mark.parametrize("token, repo, code", [
    ("hf_not_a_real_token", "alice/x", "hub_unauthorized"),
    (READ_ONLY, "alice/x", "hub_forbidden"),
])
def test_auth_failures_fail_at_once_with_a_clear_code(env, hub, token, repo, code):
    done = run(env, request(env, fmt="lora-adapter", repo=repo), config=replace(env["config"], hf_token=token))
    assert done.status == "failed" and done.error_code == code and done.attempts == 1
    assert token not in done.error_message


def test_per_request_secret_reference(env, hub, tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "alice-hub").write_text(TOKEN + "\n")
    cfg = replace(env["config"], hf_token=None, secrets_dir=secrets)
    done = run(env, request(env, fmt="lora-adapter", hf_token_ref="secret:alice-hub"), config=cfg)
    assert done.status == "succeeded", done.error_message
    done = run(env, request(env, fmt="lora-adapter", hf_token_ref="secret:nobody"), config=cfg)
    assert done.status == "failed" and done.error_code == "secret_not_found"
    done = run(env, request(env, fmt="lora-adapter"), config=cfg)
    assert done.status == "failed" and done.error_code == "hub_unauthorized", "no token anywhere is a clear error"


@pytest.mark.parametrize("repo", [None, "no-namespace", "a/b/c", "alice/bad name", "alice/x--y", "../etc/passwd"])
def test_invalid_repo_ids_are_refused(env, hub, repo):
    done = run(env, request(env, fmt="lora-adapter", repo=repo))
    assert done.status == "failed" and done.error_code == "hub_repo_invalid"
