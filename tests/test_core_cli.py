"""helios-core inspect | verify | keygen | sign."""
from __future__ import annotations

import pytest

from helios_backend.cli.core import main
from helios_backend.core import open_core, public_key_bytes, load_or_create_publisher_key, write_logical_core
from tests.contract_samples import sample_contract, sample_manifest
from tests.core_helpers import NAMESPACE, SIGNING_KEY, data_offset, flip_byte, sample_resources, write_sample_core


@pytest.fixture
def core_path(tmp_path):
    return write_sample_core(tmp_path / "a.core")


def test_inspect_prints_the_summary(core_path, capsys):
    # spec: FMT-6
    assert main(["inspect", str(core_path)]) == 0
    out = capsys.readouterr().out
    for expected in ("sample-model", "execution ABI helios-abi6 | contract 3 | payload format 2", "weights",
                     "RESOURCE_KIND_WEIGHTS", "speculative_r4_w4", "B=4 D=3 W=4 P=16",
                     "TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS", NAMESPACE, "contract        valid"):
        assert expected in out


def test_verify_accepts_a_good_core(core_path, capsys):
    # spec: FMT-21, FMT-22
    assert main(["verify", str(core_path), "--accept", NAMESPACE]) == 0
    assert capsys.readouterr().out.startswith("OK:")


def test_verify_verbose_reports_each_resource(core_path, capsys):
    assert main(["verify", "-v", str(core_path)]) == 0
    err = capsys.readouterr().err
    assert all(f"verified {name} " in err for name in ("weights", "kernels", "tokenizer", "chat_template"))


def test_verify_refuses_a_wrong_acceptance(core_path, capsys):
    # spec: FMT-21
    assert main(["verify", str(core_path), "--accept", NAMESPACE.upper()]) == 1
    assert "AuthorizationError" in capsys.readouterr().err


def test_verify_reports_tampering(core_path, capsys):
    # spec: FMT-14
    flip_byte(core_path, data_offset(core_path) + 2)
    assert main(["verify", str(core_path)]) == 1
    assert "IntegrityError" in capsys.readouterr().err


def test_verify_reports_a_missing_file(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "none.core")]) == 1
    assert "FAIL" in capsys.readouterr().err


def test_keygen_then_sign_under_a_new_namespace(core_path, tmp_path, capsys):
    # spec: FMT-21, FMT-22
    key_path = tmp_path / "keys" / "me.pem"
    assert main(["keygen", "--key", str(key_path)]) == 0
    assert "created publisher key" in capsys.readouterr().out
    out_path = tmp_path / "signed.core"
    assert main(["sign", str(core_path), "--out", str(out_path), "--key", str(key_path), "--namespace", "me.example"]) == 0
    with open_core(out_path) as core:
        core.verify()
        core.authorize("me.example")
        assert core.public_key == public_key_bytes(load_or_create_publisher_key(key_path))
        assert core.public_key != public_key_bytes(SIGNING_KEY)
    assert main(["verify", str(out_path), "--accept", NAMESPACE]) == 1  # the old namespace no longer matches


def test_sign_refuses_a_tampered_core(core_path, tmp_path):
    # spec: FMT-14
    flip_byte(core_path, data_offset(core_path) + 2)
    assert main(["sign", str(core_path), "--out", str(tmp_path / "x.core"), "--key", str(tmp_path / "k.pem")]) == 1
    assert not (tmp_path / "x.core").exists()


def test_v4_core_with_a_content_key_file(tmp_path, capsys):
    # spec: FMT-11
    key = bytes(range(32))
    path = tmp_path / "v4.core"
    write_logical_core(path, version=4, contract=sample_contract(), manifest=sample_manifest(),
                       resources=sample_resources(), namespace=NAMESPACE, signing_key=SIGNING_KEY, content_key=key)
    key_file = tmp_path / "content.key"
    key_file.write_text(key.hex())
    assert main(["verify", str(path)]) == 1
    assert "ContentKeyError" in capsys.readouterr().err
    assert main(["verify", str(path), "--content-key-file", str(key_file), "--accept", NAMESPACE]) == 0


def test_verify_stored_checks_stored_bytes_without_decoding(core_path):
    # spec: FMT-14
    from helios_backend.core import IntegrityError
    with open_core(core_path) as opened:
        opened.verify_stored()                      # an intact core passes
    flip_byte(core_path, data_offset(core_path) + 2)
    with open_core(core_path) as opened, pytest.raises(IntegrityError, match="sha256 commitment"):
        opened.verify_stored()
