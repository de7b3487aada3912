"""Secrets a process connects or serves with, read from where the topology points: a file (best),
or the value itself. Never logged: errors name the file and the setting, not the content."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class SecretError(ValueError):
    """A secret named by the topology cannot be read (missing file, empty file, unset variable)."""


class _Password(Protocol):  # config.topology.BusAuth or BusCluster, without importing the topology
    password: str | None
    password_file: str | None
    password_env: str | None


class _Auth(_Password, Protocol):
    token: str | None
    token_file: str | None
    token_env: str | None


def read_secret_file(path: str, what: str) -> str:
    """The file's content without surrounding whitespace (a trailing newline is common)."""
    try:
        value = Path(os.path.expanduser(path)).read_text().strip()
    except OSError as e:
        raise SecretError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not value:
        raise SecretError(f"{what}: {path} is empty")
    return value


def read_secret_env(name: str, what: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise SecretError(f"{what}: environment variable {name} is not set")
    return value


def token(auth: _Auth, what: str = "bus.auth") -> str | None:
    return resolve(auth.token, auth.token_file, auth.token_env, f"{what}.token")


def password(auth: _Password, what: str = "bus.auth") -> str | None:
    return resolve(auth.password, auth.password_file, auth.password_env, f"{what}.password")


def resolve(value: str | None, file: str | None, env: str | None, what: str) -> str | None:
    """A secret given as a value, a file (``<what>_file``) or an environment variable (``<what>_env``)."""
    if file is not None:
        return read_secret_file(file, f"{what}_file")
    if env is not None:
        return read_secret_env(env, f"{what}_env")
    return value
