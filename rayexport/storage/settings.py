"""Storage options: the S3 endpoint and credentials from the standard AWS variables, and how a
user's `--storage-options` are laid over defaults."""

from __future__ import annotations

import os
from typing import Any

_CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_SESSION_TOKEN": "token",
}


def storage_options_from_env(explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """S3 options from the standard AWS variables, overridden by `explicit` (`--storage-options`).

    Workers may run on other nodes with another environment, so the driver resolves the
    endpoint and credentials once and hands them to every actor.
    """
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    for variable, option in _CREDENTIAL_ENV.items():
        if os.environ.get(variable):
            options[option] = os.environ[variable]
    return merge_options(options, explicit or {})


def merge_options(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`defaults` with `overrides` applied at every depth: a user's `config_kwargs.read_timeout`
    replaces that one setting and keeps the default retries beside it."""
    merged = dict(defaults)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = merge_options(merged[key], value)
        merged[key] = value
    return merged


