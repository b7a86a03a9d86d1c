"""``nucleus-export keys create|list|revoke``: API keys, printed once, stored hashed."""

from __future__ import annotations

import json

from converters.errors import EXIT_OK, EXIT_USAGE

from ..settings import Settings
from .errors import guarded


def register(sub) -> None:
    p = sub.add_parser("keys", help="create, list and revoke API keys")
    ks = p.add_subparsers(dest="keys_command", required=True)
    c = ks.add_parser("create", help="create a key and print it once")
    c.add_argument("--scopes", required=True, help="comma-separated: read,train,infer")
    c.add_argument("--tenant", default="default", help="the owner: keys of one tenant see each other's operations and checkpoints")
    c.add_argument("--name", help="a label")
    c.set_defaults(func=create)
    ls = ks.add_parser("list", help="list keys (never their secrets)")
    ls.add_argument("--tenant")
    ls.set_defaults(func=list_keys)
    r = ks.add_parser("revoke", help="revoke a key by its id")
    r.add_argument("key_id")
    r.set_defaults(func=revoke)


def _keys():
    from ..store import Store
    from ..store.keys import ApiKeys

    return ApiKeys(Store(Settings.from_env().store_url()).engine)


@guarded
def create(args) -> int:
    try:
        record, key = _keys().create(args.tenant, [s.strip() for s in args.scopes.split(",") if s.strip()], args.name)
    except ValueError as exc:
        print(f"error [invalid_option]: {exc}")
        return EXIT_USAGE
    print(key)
    print(f"id {record.id}, tenant {record.tenant}, scopes {','.join(record.scopes)} (the key is shown only now; store it safely)", flush=True)
    return EXIT_OK


@guarded
def list_keys(args) -> int:
    for k in _keys().list(args.tenant):
        print(json.dumps(k.to_dict()))
    return EXIT_OK


@guarded
def revoke(args) -> int:
    if not _keys().revoke(args.key_id):
        print(f"error [not_found]: no active key with id {args.key_id}")
        return 65
    print(f"revoked {args.key_id}")
    return EXIT_OK
