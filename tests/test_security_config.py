"""Security options and limits are refused at start, naming the flag and what was wrong (never echoing a token)."""

from __future__ import annotations

import pytest

from coordinator.service import ReplicaNames
from tandem.cli import main
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.errors import InvalidRequestError
from tandem.rpc.auth import BearerAuth, read_token_file, token_from
from tandem.rpc.tls import ClientTLS, ServerTLS
from tests.tls_certs import make_pki

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_server_tls_files_must_exist_be_readable_and_hold_what_the_flag_says(pki, tmp_path):
    with pytest.raises(InvalidRequestError, match=r"--tls-cert .*/missing.pem: cannot read it \(No such file"):
        ServerTLS(tmp_path / "missing.pem", pki.server_key)
    with pytest.raises(InvalidRequestError, match=r"--tls-key .*: cannot read it \(Is a directory"):
        ServerTLS(pki.server_cert, tmp_path)
    with pytest.raises(InvalidRequestError, match=r"--tls-cert .*server.key: not a PEM certificate"):
        ServerTLS(pki.server_key, pki.server_key)  # key and certificate swapped
    with pytest.raises(InvalidRequestError, match=r"--tls-key .*server.crt: not a PEM private key"):
        ServerTLS(pki.server_cert, pki.server_cert)
    with pytest.raises(InvalidRequestError, match=r"--tls-client-ca .*: not a PEM certificate"):
        ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.client_key)
    assert ServerTLS(pki.server_cert, pki.server_key, pki.ca).mutual


def test_server_tls_flags_go_together():
    assert ServerTLS.from_flags(None, None, None) is None
    with pytest.raises(InvalidRequestError, match="--tls-cert and --tls-key go together"):
        ServerTLS.from_flags("a.crt", None, None)
    with pytest.raises(InvalidRequestError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        ServerTLS.from_flags(None, None, "ca.pem")


def test_client_tls_names_the_flags_it_came_from(pki):
    assert ClientTLS.from_flags(None, None, None) is None
    assert ClientTLS.from_flags(None, None, None, enabled=True) == ClientTLS()  # the system's roots
    with pytest.raises(InvalidRequestError, match="--worker-tls-cert and --worker-tls-key go together"):
        ClientTLS.from_flags(str(pki.ca), str(pki.client_cert), None, flag_prefix="--worker-tls-")
    with pytest.raises(InvalidRequestError, match="--worker-tls-server-name needs TLS"):
        ClientTLS.from_flags(None, None, None, "workers.internal", flag_prefix="--worker-tls-")
    with pytest.raises(InvalidRequestError, match="--tls-ca .*: not a PEM certificate"):
        ClientTLS.from_flags(str(pki.client_key), None, None)
    with pytest.raises(InvalidRequestError, match="--tls-server-name must be a host name"):
        ClientTLS(pki.ca, server_name="two words")


def test_token_files_and_the_environment(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# clients\n{TOKEN}\n\n{TOKEN}-second\n")
    assert read_token_file(path, "--auth-token-file") == [TOKEN, f"{TOKEN}-second"]
    auth = BearerAuth.from_sources(str(path))
    assert auth.identify({"authorization": f"Bearer {TOKEN}-second"}) == "token-2"
    assert auth.identify({"authorization": f"Bearer {TOKEN}"}) == "token-1"
    assert auth.identify({"authorization": TOKEN}) is None and auth.identify({}) is None
    assert TOKEN not in repr(auth)
    assert BearerAuth.from_sources(None, environ={}) is None
    assert BearerAuth.from_sources(None, environ={"TANDEM_AUTH_TOKEN": TOKEN}).tokens == (TOKEN,)
    assert token_from(str(path), "--token-file") == TOKEN
    assert token_from(None, "--token-file", {"TANDEM_AUTH_TOKEN": TOKEN}) == TOKEN
    assert token_from(None, "--token-file", {}) is None
    # a Kubernetes Secret made from a file keeps its line break: the token is the line, as in a token file
    assert BearerAuth.from_sources(None, environ={"TANDEM_AUTH_TOKEN": TOKEN + "\n"}).tokens == (TOKEN,)
    assert token_from(None, "--token-file", {"TANDEM_AUTH_TOKEN": f" {TOKEN}\r\n"}) == TOKEN
    with pytest.raises(InvalidRequestError, match="only whitespace"):
        BearerAuth.from_sources(None, environ={"TANDEM_AUTH_TOKEN": "\n"})


@pytest.mark.parametrize("content,message", [
    ("# nothing\n\n", "holds no token"),
    ("short\n", "line 1: a token must have at least 16 characters"),
    (f"{TOKEN}\nwith a space in it 0123456789\n", "line 2: a token must be printable ASCII without spaces"),
])
def test_bad_token_files_are_refused_without_echoing_the_token(tmp_path, content, message):
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match=message) as info:
        BearerAuth.from_sources(str(path))
    assert "0123456789" not in str(info.value) and "short" not in str(info.value)


def test_a_missing_token_file_is_named(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"--auth-token-file .*/nope: No such file"):
        BearerAuth.from_sources(str(tmp_path / "nope"))


def coordinator_config(**kwargs) -> CoordinatorConfig:
    return CoordinatorConfig(ServerOptions(), "tok", ["127.0.0.1:1"], **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_request_bytes=100), r"--max-request-bytes must be in 1024\.\.2147483647, got 100"),
    (dict(max_request_bytes=2**31), "--max-request-bytes must be in"),
    (dict(max_prompt_tokens=0), "--max-prompt-tokens must be a positive number of tokens, got 0"),
    (dict(max_new_tokens_limit=-1), "--max-new-tokens-limit must be a positive number of tokens, got -1"),
    (dict(max_new_tokens_limit=100), r"default max new tokens \(256, --max-new-tokens\) exceeds "
                                     r"--max-new-tokens-limit \(100\)"),
    (dict(max_concurrent_per_client=-2), r"--max-concurrent-per-client must be >= 0 \(0: unlimited\), got -2"),
    (dict(room_hold_s=-0.5), r"--room-hold must be in 0\.\.5 seconds \(0: refused at once\), got -0\.5"),
    (dict(room_hold_s=6.0), r"--room-hold must be in 0\.\.5 seconds"),
    (dict(room_hold_s=float("nan")), r"--room-hold must be in 0\.\.5 seconds .*got nan"),
    (dict(redis_url="http://cache:6379"), r"redis URL: scheme 'http' is not supported"),
])
def test_coordinator_limits_are_validated(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        coordinator_config(**kwargs)


def test_coordinator_limit_defaults():
    cfg = coordinator_config()
    assert (cfg.max_request_bytes, cfg.max_prompt_tokens, cfg.max_new_tokens_limit,
            cfg.max_concurrent_per_client, cfg.expose_worker_addresses, cfg.auth) == (4 << 20, None, None, 0,
                                                                                        False, None)
    assert coordinator_config().room_hold_s == 1.0 and coordinator_config(room_hold_s=0).room_hold_s == 0


def test_serve_refuses_a_missing_certificate_before_loading_anything(tmp_path, capsys):
    code = main(["serve", "coordinator", "--target-addr", "127.0.0.1:1", "--tokenizer", "smollm2",
                 "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")])
    assert code == 2
    assert "tandem: error: --tls-cert" in capsys.readouterr().err


def test_generate_refuses_half_a_client_certificate(pki, capsys):
    code = main(["generate", "hi", "--addr", "127.0.0.1:1", "--tls-ca", str(pki.ca), "--tls-cert",
                 str(pki.client_cert)])
    assert code == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


class _Client:
    def __init__(self, role: str, address: str) -> None:
        self.role, self.address = role, address


def test_replicas_have_opaque_names_stable_per_replica_unless_addresses_are_exposed():
    names = ReplicaNames(expose_addresses=False)
    t0, t1, d0 = _Client("target", "10.0.0.5:50052"), _Client("target", "10.0.0.6:50052"), _Client("draft", "x:1")
    assert [names(t1), names(t0), names(d0), names(t1), names(None)] == ["target-0", "target-1", "draft-0",
                                                                        "target-0", ""]
    assert ReplicaNames(expose_addresses=True)(t0) == "10.0.0.5:50052"
