"""The facade's public API, pinned (issue 49): a script written against the documented API
keeps working, or a renamed argument fails with one line naming its new spelling. A change
to the pinned lists below is a decision: record it in docs/upgrading.md in the same commit.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
from kit import tiny_model

import diloco

PUBLIC_NAMES = [
    "IslandLearner",
    "Learner",
    "LearnerConfig",
    "ProtocolConfig",
    "StatefulSampler",
    "SyncerConfig",
    "SyncerServer",
    "SyncerUnreachable",
    "__version__",
]

# (callable, its parameters as "name kind=default"): kinds POSITIONAL_OR_KEYWORD "",
# KEYWORD_ONLY "*", VAR_KEYWORD "**"
SIGNATURES = {
    "Learner": [
        "model", "optimizer=None", "*syncer", "*config=None", "*layout=None",
        "*link_options=None", "*state=None", "*clock=monotonic", "**overrides",
    ],
    "Learner.step": ["self", "tokens", "loss=None"],
    "Learner.from_env": ["model", "optimizer=None", "**overrides"],
    "Learner.track": ["self", "data", "name='data'"],
    "StatefulSampler": ["num_samples", "*seed=0"],
    "Learner.wait_for_global": ["self", "timeout=60.0", "*required=True"],
    "Learner.close": ["self", "*flush=True"],
    "Learner.state_dict": ["self"],
    "Learner.accounting": ["self"],
    "IslandLearner": [
        "model", "optimizer=None", "*syncer", "*group=None", "*config=None", "*state=None",
        "*link_options=None", "**overrides",
    ],
    "SyncerServer.for_model": ["model", "*config=None", "**kwargs"],
    "SyncerServer.start": ["self"],
    "SyncerServer.stop": ["self", "grace=1.0"],
    "SyncerServer.state_dict": ["self", "model=None"],
}  # fmt: skip

# the configuration dataclasses' fields, in order
FIELDS = {
    "ProtocolConfig": ["num_fragments", "comms", "sync_every"],
    "LearnerConfig": [
        "num_fragments", "rebase_foreign", "rebase_own", "alpha", "comms", "tokens_per_step",
        "delivery_file", "journal_file", "learner_id", "generation", "generation_file",
        "cpu_threads",
        "malloc_arenas", "flush_timeout_s", "drain_timeout_s", "max_stretch", "pace_lag_steps",
        "step_time_decay", "token", "tls_ca", "tls_cert", "tls_key",
    ],
}  # fmt: skip

KINDS = {
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "",
    inspect.Parameter.KEYWORD_ONLY: "*",
    inspect.Parameter.VAR_KEYWORD: "**",
    inspect.Parameter.VAR_POSITIONAL: "*args:",
    inspect.Parameter.POSITIONAL_ONLY: "/",
}


def described(parameter: inspect.Parameter) -> str:
    """``parameter`` as the pinned lists write it (a function default by its name)."""
    text = KINDS[parameter.kind] + parameter.name
    if parameter.default is not inspect.Parameter.empty:
        default = parameter.default
        text += "=" + (default.__name__ if callable(default) else repr(default))
    return text


def resolve(path: str):
    obj = diloco
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_facade_exports_what_is_pinned():
    assert sorted(diloco.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(diloco, name) is not None


@pytest.mark.parametrize("path", sorted(SIGNATURES))
def test_public_signatures_are_pinned(path):
    params = [described(p) for p in inspect.signature(resolve(path)).parameters.values()]
    assert params == SIGNATURES[path], f"{path} changed: record it in docs/upgrading.md"


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_configuration_fields_are_pinned(name):
    fields = [f.name for f in dataclasses.fields(getattr(diloco, name))]
    assert fields == FIELDS[name], f"{name} changed: record it in docs/upgrading.md"


def test_syncer_config_keeps_its_fields():
    """SyncerConfig grows (new syncer settings); a field it had is never silently dropped."""
    fields = {f.name for f in dataclasses.fields(diloco.SyncerConfig)}
    assert {"schedule", "protocol", "quorum", "gamma", "tau", "max_staleness"} <= fields


def test_p_and_h_are_configured_from_the_facade():
    config = diloco.SyncerConfig(protocol=diloco.ProtocolConfig(num_fragments=2, sync_every=4))
    server = diloco.SyncerServer.for_model(tiny_model(), config=config)
    try:
        assert server.layout.num_fragments == 2
    finally:
        server.stop()


def one_line_type_error(call) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError) as caught:
            call()
    message = str(caught.value)
    assert "\n" not in message and "not iterable" not in message
    return message


def test_the_previous_releases_syncer_for_model_fragments_names_the_new_spelling():
    message = one_line_type_error(lambda: diloco.SyncerServer.for_model(tiny_model(), fragments=8))
    assert "fragments=8" in message
    assert "SyncerConfig(protocol=ProtocolConfig(num_fragments=8))" in message


def test_the_previous_releases_learner_arguments_name_the_new_spelling():
    message = one_line_type_error(
        lambda: diloco.Learner(tiny_model(), syncer="127.0.0.1:1", fragments=8)
    )
    assert "num_fragments=8" in message
    message = one_line_type_error(
        lambda: diloco.Learner(tiny_model(), syncer="127.0.0.1:1", fragments=8, sync_every=8)
    )
    assert "H is the syncer's" in message or "num_fragments=8" in message
    message = one_line_type_error(lambda: diloco.LearnerConfig(fragments=8))
    assert "num_fragments=8" in message


def test_the_previous_releases_protocol_spellings_name_the_new_ones():
    message = one_line_type_error(lambda: diloco.SyncerConfig(sync_every=8))
    assert "SyncerConfig(protocol=ProtocolConfig(sync_every=8))" in message
    message = one_line_type_error(lambda: diloco.ProtocolConfig(fragments=8))
    assert "num_fragments=8" in message
