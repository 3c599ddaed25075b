"""Who gets in: shared token, non-loopback refusal, TLS and mutual TLS, allow-list."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from kit import join_request, local_syncer, tiny_model
from torch import nn

from diloco.learner.learner import Learner
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape
from diloco.wire import auth
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc

P = 2
TOKEN = "s3cret-token-for-tests-0123456789"


def make_model() -> nn.Module:
    return tiny_model(0, (4, 8, 1), tanh=False)


def make_server(tmp_path, **kwargs) -> SyncerServer:
    return local_syncer(
        make_model(), num_fragments=P, start=False, tape_path=tmp_path / "events.jsonl", **kwargs
    )


# ------------------------------------------------------------------------------- token
@pytest.mark.timeout(30)
def test_calls_without_the_right_token_are_unauthenticated_and_change_nothing(tmp_path):
    server = make_server(tmp_path, token=TOKEN).start()
    try:
        before = server.service.state_digest()
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SyncerStub(ch)
            for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
                calls = [
                    lambda md=metadata: stub.Join(
                        join_request(server.layout), timeout=5, metadata=md
                    ),
                    lambda md=metadata: stub.Status(pb.StatusRequest(), timeout=5, metadata=md),
                    lambda md=metadata: stub.Upload(
                        iter([pb.UploadChunk(learner_id="a")]), timeout=5, metadata=md
                    ),
                    lambda md=metadata: list(
                        stub.Subscribe(pb.SubscribeRequest(learner_id="a"), timeout=5, metadata=md)
                    ),
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert server.service.state_digest() == before and not server.state.learners
            # The right token gets in.
            reply = stub.Join(
                join_request(server.layout), timeout=5, metadata=auth.call_metadata(TOKEN)
            )
            assert reply.session
    finally:
        server.stop()
    refused = [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "refused"]
    assert len(refused) == 12 and all(r["code"] == "UNAUTHENTICATED" for r in refused)
    assert {r["reason"] for r in refused} == {"missing token", "wrong token"}


@pytest.mark.timeout(30)
def test_learner_with_the_token_receives_the_global_model(tmp_path):
    server = make_server(tmp_path, token=TOKEN).start()
    try:
        learner = Learner(make_model(), syncer=server.address, num_fragments=P, token=TOKEN)
        assert learner.wait_for_global(timeout=10)
        learner.close(flush=False)
        intruder = Learner(make_model(), syncer=server.address, num_fragments=P, learner_id="x")
        with pytest.raises(RuntimeError, match="missing token"):
            intruder.wait_for_global(timeout=10)
        intruder.close(flush=False)
    finally:
        server.stop()


def test_token_from_file_or_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert auth.load_token(f, env={}) == TOKEN
    assert auth.load_token(None, env={auth.TOKEN_ENV: TOKEN}) == TOKEN
    assert auth.load_token(f, env={auth.TOKEN_ENV: "other-token-0123456789"}) == TOKEN
    assert auth.load_token(None, env={}) is None
    f.write_text("short")
    with pytest.raises(auth.AuthConfigError, match="at least 16"):
        auth.load_token(f, env={})
    with pytest.raises(auth.AuthConfigError, match="cannot read"):
        auth.load_token(tmp_path / "missing", env={})


# ---------------------------------------------------------------------- non-loopback bind
@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.1.2.3", "example.org"])
def test_non_loopback_bind_without_token_refuses_to_start(tmp_path, host):
    with pytest.raises(auth.AuthConfigError, match="--token-file"):
        make_server(tmp_path, bind=f"{host}:0")


def test_loopback_needs_no_token():
    assert all(auth.is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost"))
    assert not any(auth.is_loopback(h) for h in ("0.0.0.0", "::", "192.168.0.1", "host"))


@pytest.mark.timeout(60)
def test_syncer_cli_refuses_a_network_bind_without_token(tmp_path, monkeypatch, capsys):
    from diloco.cli import main

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    argv = ["syncer", "--recipe=tiny", "--fragments=4", "--bind=0.0.0.0:0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to bind 0.0.0.0:0 without a shared token" in err and "--token-file" in err


@pytest.mark.timeout(30)
def test_network_bind_with_token_serves(tmp_path):
    server = make_server(tmp_path, bind="0.0.0.0:0", token=TOKEN).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            status = pb_grpc.SyncerStub(ch).Status(
                pb.StatusRequest(), timeout=5, metadata=auth.call_metadata(TOKEN)
            )
            assert list(status.versions) == [0] * P
    finally:
        server.stop()


# ----------------------------------------------------------------------------------- TLS
def self_signed(tmp_path, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1 made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return str(cert), str(key)


def status_over(address: str, credentials, timeout: float = 5.0):
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        return pb_grpc.SyncerStub(channel).Status(pb.StatusRequest(), timeout=timeout)


@pytest.mark.timeout(60)
def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = self_signed(tmp_path, "syncer")
    server = make_server(tmp_path, credentials=auth.server_credentials(cert, key)).start()
    try:
        address = f"localhost:{server.port}"
        assert status_over(address, auth.channel_credentials(cert)).versions == [0] * P
        with pytest.raises(grpc.RpcError):  # plain text to a TLS port
            status_over(address, None, timeout=2)
        other, _ = self_signed(tmp_path, "impostor")
        with pytest.raises(grpc.RpcError):  # server certificate not signed by the trusted CA
            status_over(address, auth.channel_credentials(other), timeout=2)
        learner = Learner(make_model(), syncer=address, num_fragments=P, tls_ca=cert)
        assert learner.wait_for_global(timeout=10)
        learner.close(flush=False)
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_mutual_tls_requires_a_client_certificate(tmp_path):
    cert, key = self_signed(tmp_path, "syncer")
    client_cert, client_key = self_signed(tmp_path, "learner")
    creds = auth.server_credentials(cert, key, client_ca_file=client_cert)
    server = make_server(tmp_path, credentials=creds, token=TOKEN).start()
    try:
        address = f"localhost:{server.port}"
        with pytest.raises(grpc.RpcError):
            status_over(address, auth.channel_credentials(cert), timeout=2)
        learner = Learner(
            make_model(),
            syncer=address,
            num_fragments=P,
            token=TOKEN,
            tls_ca=cert,
            tls_cert=client_cert,
            tls_key=client_key,
        )
        assert learner.wait_for_global(timeout=10)
        learner.close(flush=False)
    finally:
        server.stop()


# ----------------------------------------------------------------------------- allow-list
@pytest.mark.timeout(30)
def test_allow_list_refuses_other_learner_ids(tmp_path):
    server = make_server(tmp_path, allowed_learners=["site-a"]).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SyncerStub(ch)
            assert stub.Join(join_request(server.layout, "site-a"), timeout=5).session
            before = server.service.state_digest()
            with pytest.raises(grpc.RpcError) as info:
                stub.Join(join_request(server.layout, "site-b"), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "allow-list" in info.value.details()
            assert server.service.state_digest() == before
    finally:
        server.stop()
    refused = [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "refused"]
    assert [(r["rpc"], r["learner"], r["code"]) for r in refused] == [
        ("Join", "site-b", "PERMISSION_DENIED")
    ]


def test_syncer_security_flags(tmp_path, monkeypatch):
    import argparse

    from diloco.config import add_options, from_namespace
    from diloco.config.common import ServerSecurityConfig
    from diloco.launch.syncer_process import server_security

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_options(parser, ServerSecurityConfig)

    def security(argv):
        return server_security(from_namespace(ServerSecurityConfig, parser.parse_args(argv)))

    (tmp_path / "token").write_text(TOKEN)
    got = security([f"--token-file={tmp_path / 'token'}", "--allow-learners=a, b,"])
    assert got == {"token": TOKEN, "learner_tokens": False, "allowed_learners": ["a", "b"]}
    got = security([f"--token-file={tmp_path / 'token'}", "--learner-tokens"])
    assert got == {"token": TOKEN, "learner_tokens": True}
    with pytest.raises(auth.AuthConfigError, match="both --tls-cert and --tls-key"):
        security(["--tls-cert=x.pem"])
    with pytest.raises(auth.AuthConfigError, match="--tls-client-ca needs"):
        security(["--tls-client-ca=ca.pem"])
    with pytest.raises(auth.AuthConfigError, match="cannot read the TLS"):
        security(["--tls-cert=missing.pem", "--tls-key=missing.key"])


def test_learner_token_command(tmp_path, monkeypatch, capsys):
    from diloco.cli import main

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    (tmp_path / "secret").write_text(TOKEN)
    assert main(["learner-token", "site-a", f"--token-file={tmp_path / 'secret'}"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == auth.learner_token(TOKEN, "site-a") and printed.startswith("dl1.site-a.")
    assert auth.identity_of(printed, TOKEN) == "site-a"
    assert auth.identity_of(printed, "another-secret-0123456789") is None
    assert auth.identity_of(TOKEN, TOKEN) == auth.SHARED
    assert auth.identity_of(printed.replace("site-a", "site-b"), TOKEN) is None
    assert main(["learner-token", "bad id!", f"--token-file={tmp_path / 'secret'}"]) == 2
    assert "learner id must be" in capsys.readouterr().err
    assert main(["learner-token", "site-a"]) == 2
    assert "no secret" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_syncer_cli_bad_places_are_one_line_errors_and_leave_nothing(tmp_path, capsys):
    from diloco.cli import main

    busy = make_server(tmp_path).start()
    (tmp_path / "a-file").write_text("x")
    try:
        base = ["syncer", "--recipe=tiny", "--fragments=4"]
        for argv, message in [
            ([f"--bind={busy.address}", f"--state-dir={tmp_path / 'new'}"], "cannot bind"),
            ([f"--state-dir={tmp_path / 'a-file'}"], "is a file, not a directory"),
            (["--fragments=0"], "must be >= 1"),
        ]:
            assert main([*base, *argv]) == 2, argv
            err = capsys.readouterr().err.strip()
            assert message in err and "Traceback" not in err, (argv, err)
            assert len([line for line in err.splitlines() if line.startswith("diloco")]) == 1
        assert not (tmp_path / "new").exists()
    finally:
        busy.stop()
