"""S3 backend specifics: settings from env/credentials file, secrets never shown, failures."""

from __future__ import annotations

import copy
import json
import pickle
import uuid
from pathlib import Path

import pytest
from tests.storage.support import ACCESS_KEY, SECRET_KEY, moto_endpoint, s3_env

from shoal.storage.errors import StorageConfigError, StorageUnavailable
from shoal.storage.s3 import S3Store
from shoal.storage.s3_config import S3Config, Secret
from shoal.storage.uri import open_store


def test_from_env_parses_endpoint_and_secure() -> None:
    c = S3Config.from_env({"S3_ENDPOINT": "https://s3.example:9000", "S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "s"})
    assert (c.endpoint, c.secure, c.access_key, c.secret_key.reveal()) == ("s3.example:9000", True, "a", "s")
    c = S3Config.from_env({"S3_ENDPOINT": "http://h:1", "S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "s"})
    assert c.secure is False
    c = S3Config.from_env({"S3_ENDPOINT": "h:1", "S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "s", "S3_SECURE": "no"})
    assert c.secure is False and c.endpoint == "h:1"
    with pytest.raises(StorageConfigError, match="S3_SECURE"):
        S3Config.from_env({"S3_ENDPOINT": "h:1", "S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "s", "S3_SECURE": "maybe"})


def test_credentials_file_with_env_overrides(tmp_path: Path) -> None:
    f = tmp_path / "creds.json"
    f.write_text(json.dumps({"endpoint": "http://file-host:9000", "access_key": "file-ak", "secret_key": "file-sk"}))
    c = S3Config.from_env({"S3_CREDENTIALS_FILE": str(f), "S3_ACCESS_KEY": "env-ak"})
    assert (c.endpoint, c.access_key, c.secret_key.reveal(), c.secure) == ("file-host:9000", "env-ak", "file-sk", False)
    f.write_text('{"secret_key": "leaky' )  # malformed JSON must not be quoted back
    with pytest.raises(StorageConfigError) as info:
        S3Config.from_env({"S3_CREDENTIALS_FILE": str(f)})
    assert "leaky" not in str(info.value)


def test_missing_settings_name_the_variables_not_values() -> None:
    with pytest.raises(StorageConfigError, match="S3_ENDPOINT, S3_SECRET_KEY") as info:
        S3Config.from_env({"S3_ACCESS_KEY": "visible-ak"})
    assert "visible-ak" not in str(info.value)
    with pytest.raises(StorageConfigError, match="credentials"):
        S3Config.from_env({"S3_ENDPOINT": "http://u:p@h:1", "S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "s"})


def test_secret_never_shown() -> None:
    config = S3Config.from_env(s3_env())
    store = S3Store(f"b-{uuid.uuid4().hex[:12]}", "p", config, create_bucket=True)
    shown = " ".join([repr(config), str(config), repr(store), str(store), store.uri, f"{config.secret_key}"])
    assert SECRET_KEY not in shown and "***" in shown
    assert ACCESS_KEY in repr(config)  # the key id is not secret; it helps debugging
    with pytest.raises(TypeError):
        pickle.dumps(config.secret_key)
    assert copy.deepcopy(config) == config
    assert Secret("x") == Secret("x") and Secret("x") != Secret("y")


def test_open_store_uses_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_env().items():
        monkeypatch.setenv(k, v)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s = open_store(f"s3://{bucket}/jobs/j1/", create_bucket=True)
    assert s.uri == f"s3://{bucket}/jobs/j1"
    s.put_bytes("x", b"1")
    assert open_store(f"s3://{bucket}/jobs").list() == ["j1/x"]


def test_missing_bucket_is_a_config_error() -> None:
    s = S3Store(f"missing-{uuid.uuid4().hex[:12]}", "", S3Config.from_env(s3_env()))
    with pytest.raises(StorageConfigError, match="NoSuchBucket"):
        s.put_bytes("k", b"x")


def test_unreachable_endpoint_is_unavailable_and_fast() -> None:
    from shoal.ops.embedded import free_port

    moto_endpoint()
    config = S3Config(endpoint=f"127.0.0.1:{free_port()}", access_key="a", secret_key=Secret(SECRET_KEY),
                      secure=False, region="us-east-1", connect_timeout_s=1, read_timeout_s=1, retries=0)
    s = S3Store("bucket", "", config)
    with pytest.raises(StorageUnavailable) as info:
        s.get_bytes("k")
    assert SECRET_KEY not in str(info.value)
    assert info.value.exit_code == 3
