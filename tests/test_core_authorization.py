"""authorize(acceptance) and publisher keys."""
from __future__ import annotations

import os
import stat

import pytest

from helios_backend.core import (
    AuthorizationError,
    PublisherKeyError,
    default_key_path,
    load_or_create_publisher_key,
    open_core,
    public_key_bytes,
)
from tests.core_helpers import NAMESPACE, SIGNING_KEY, write_sample_core


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    path = write_sample_core(tmp_path_factory.mktemp("auth") / "a.core")
    with open_core(path) as opened:
        yield opened


def test_exact_namespace_is_accepted(core):
    # spec: FMT-21
    core.authorize(NAMESPACE)


@pytest.mark.parametrize(
    "acceptance",
    [
        NAMESPACE.upper(),                 # case
        NAMESPACE[:-1],                    # prefix
        NAMESPACE + "/sub",                # extension
        " " + NAMESPACE,                   # leading whitespace
        NAMESPACE + "\n",                  # trailing newline
        NAMESPACE.replace("/", "\u2215"),  # look-alike character
        "",
        "*",
    ],
)
def test_any_other_acceptance_is_refused(core, acceptance):
    # spec: FMT-21, FMT-23
    with pytest.raises(AuthorizationError):
        core.authorize(acceptance)


def test_acceptance_must_be_a_string(core):
    # spec: FMT-21
    with pytest.raises(AuthorizationError):
        core.authorize(None)  # type: ignore[arg-type]


def test_signature_is_carried_with_the_signing_key(core):
    # spec: FMT-22, FMT-23: acceptance names the namespace; the signature is checked regardless
    assert core.public_key == public_key_bytes(SIGNING_KEY)


def test_publisher_key_is_created_once_and_private(tmp_path):
    path = tmp_path / "keys" / "publisher.pem"
    first = load_or_create_publisher_key(path)
    second = load_or_create_publisher_key(path)
    assert public_key_bytes(first) == public_key_bytes(second)
    assert len(public_key_bytes(first)) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_default_key_path_follows_helios_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HELIOS_HOME", str(tmp_path))
    assert default_key_path() == tmp_path / "keys" / "publisher.ed25519.pem"
    key = load_or_create_publisher_key()
    assert (tmp_path / "keys" / "publisher.ed25519.pem").exists()
    assert public_key_bytes(load_or_create_publisher_key()) == public_key_bytes(key)


def test_a_non_key_file_is_a_typed_error(tmp_path):
    path = tmp_path / "bad.pem"
    path.write_text("not a key")
    with pytest.raises(PublisherKeyError):
        load_or_create_publisher_key(path)
