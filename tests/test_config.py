"""One house: configuration dataclasses are the one place a default lives; the import graph has
no cycle and nothing below the CLI imports it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from diloco.cli import build_parser
from diloco.cli.common import load_config_file
from diloco.config import (
    ConfigError,
    ProtocolConfig,
    add_options,
    field_docs,
    flat_values,
    from_dict,
    from_namespace,
    options,
    to_dict,
)
from diloco.config.common import LoggingConfig
from diloco.config.dp_worker import DpWorkerConfig
from diloco.config.run import RunConfig
from diloco.config.service import ServiceConfig
from diloco.config.worker import WorkerConfig
from diloco.launch.children import LearnerPlan, service_config, worker_config
from diloco.runtime.schema import default_of, flag_name, sections
from diloco.syncer.config import SyncerConfig
from diloco.wire.comms import DEFAULT_SETTING

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).resolve().parents[1] / "src" / "diloco"

#: sub-command -> the configuration dataclass its flags come from
COMMAND_CONFIGS = {
    "run": RunConfig,
    "learner": WorkerConfig,
    "syncer": ServiceConfig,
    "dp-worker": DpWorkerConfig,
}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def all_options(cls) -> dict[str, dataclasses.Field]:
    out = {}
    for sub in sections(cls).values():
        out.update(all_options(sub))
    out.update({f.name: f for f in options(cls)})
    return out


@pytest.mark.parametrize("command", sorted(COMMAND_CONFIGS))
def test_help_defaults_are_the_dataclass_defaults(command):
    """Every flag of a configured command is one of its dataclass's options or a common option
    of every configured command (``LoggingConfig``), and --help shows the dataclass default
    (the parser's own default, when it keeps one, is that default)."""
    cls = COMMAND_CONFIGS[command]
    fields = {**all_options(cls), **all_options(LoggingConfig)}
    parser = subparsers()[command]
    seen = set()
    for action in parser._actions:
        if action.dest in ("help", "config") or isinstance(action, argparse._HelpAction):
            continue
        assert action.dest in fields, f"{command}: --{action.dest} is not a {cls.__name__} option"
        seen.add(action.dest)
        default = default_of(fields[action.dest])
        if action.default is not argparse.SUPPRESS:
            assert action.default == default, (command, action.dest)
        shown = default not in (None, False, "", []) and action.help != argparse.SUPPRESS
        if shown:
            assert f"(default: {default})" in action.help, (command, action.dest, action.help)
    assert seen == set(fields), f"{command}: options without a flag: {set(fields) - seen}"


def test_every_option_has_a_docstring():
    for cls in COMMAND_CONFIGS.values():
        for name, f in all_options(cls).items():
            owner = next(c for c in [cls, *_all_sections(cls)] if f in dataclasses.fields(c))
            assert field_docs(owner).get(name), f"{owner.__name__}.{name} has no docstring"


def _all_sections(cls):
    for sub in sections(cls).values():
        yield sub
        yield from _all_sections(sub)


def test_the_protocol_defaults_are_written_once():
    """P (24) is written in ProtocolConfig only, H (16) in the default ``--comms`` setting
    only; everything else refers to them."""
    written = {"num_fragments": ("24", SRC / "wire" / "protocol.py"),
               "sync_every": ("16", SRC / "wire" / "comms.py")}  # fmt: skip
    offenders = []
    for name, (value, home) in written.items():
        pattern = re.compile(rf"\b{name}\b[^\n=]*(=|:)\s*(int\s*=\s*)?{value}\b")
        for path in SRC.rglob("*.py"):
            if path.name.startswith("diloco_pb2") or path == home:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if (
                    pattern.search(line)
                    and "default=" in line
                    or re.search(rf"^\s*{name}\s*:\s*int\s*=\s*{value}\b", line)
                ):
                    offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert offenders == []
    assert ProtocolConfig().num_fragments == 24
    assert ProtocolConfig().sync_every == DEFAULT_SETTING.sync_every == 16


def test_a_run_configuration_round_trips_through_json():
    config = RunConfig(learners=3, slow=["1=2"], chaos="kill:mtbf=60s", checkpoint_every_s=7.5)
    data = json.loads(json.dumps(to_dict(config)))
    assert from_dict(RunConfig, data) == config
    assert data["syncer"]["quorum"] == 1 and data["syncer"]["protocol"]["num_fragments"] == 24


def test_bad_configuration_data_names_the_key():
    with pytest.raises(ConfigError, match="unknown key.*quorom"):
        from_dict(RunConfig, {"syncer": {"quorom": 2}})
    with pytest.raises(ConfigError, match="learners: expected int"):
        from_dict(RunConfig, {"learners": "4"})
    with pytest.raises(ConfigError, match="quorum must be >= 1"):
        from_dict(RunConfig, {"syncer": {"quorum": 0}})
    with pytest.raises(ConfigError, match="--id is required"):
        from_namespace(WorkerConfig, argparse.Namespace())


def test_a_config_file_gives_defaults_that_flags_override(tmp_path):
    run = RunConfig(learners=2, steps=50, token_file=None)
    plan = LearnerPlan("learner-1", 1, 8, 1.5)
    worker = worker_config(
        run, plan, syncer="127.0.0.1:1", started=100.0, workdir=tmp_path, corrupt={}
    )
    path = tmp_path / "learner.json"
    path.write_text(json.dumps(to_dict(worker)))
    args = build_parser().parse_args(["learner", f"--config={path}", "--slow=3", "--seed=5"])
    config = from_namespace(WorkerConfig, args, base=load_config_file(args.config, WorkerConfig))
    assert config.slow == 3.0 and config.recipe.seed == 5  # the flags
    assert config.id == "learner-1" and config.total_steps == 50  # the file
    assert config.syncer == "127.0.0.1:1" and config.workdir == str(tmp_path)


def test_service_config_follows_the_mode():
    sync = service_config(RunConfig(mode="sync", learners=3))
    assert (sync.syncer.schedule, sync.syncer.wait_for_all, sync.syncer.gamma) == (
        "learner",
        3,
        0.0,
    )
    protocol = ProtocolConfig(sync_every=48)
    plain = service_config(RunConfig(learners=3, syncer=SyncerConfig(protocol=protocol)))
    assert plain.syncer.wait_for_all == 0 and plain.syncer.protocol.sync_every == 48


def test_flat_values_are_the_parser_destinations():
    parser = argparse.ArgumentParser()
    add_options(parser, RunConfig)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert set(flat_values(RunConfig())) == dests


def test_a_runs_config_json_repeats_it_with_flags_on_top(tmp_path, capsys):
    from diloco.cli import main
    from diloco.config.run import load_run_config
    from diloco.launch.children import write_config

    path = write_config(tmp_path / "config.json", RunConfig(learners=3, chaos="kill:at=5s"))
    args = build_parser().parse_args(["run", f"--config={path}", "--learners=4", "--quorum=2"])
    config = from_namespace(RunConfig, args, base=load_run_config(args.config))
    assert (config.learners, config.syncer.quorum, config.chaos) == (4, 2, "kill:at=5s")
    (tmp_path / "bad.json").write_text('{"learners": 2, "sycner": {}}')
    assert main(["run", f"--config={tmp_path / 'bad.json'}"]) == 2
    assert "unknown key(s) sycner" in capsys.readouterr().err
    assert main(["run", f"--config={tmp_path / 'missing.json'}"]) == 2


# The commands whose settings are a library dataclass: command -> (the dataclass, its fields
# that are no flag (only the Python API sets them), the command's own switches that are no
# setting). Every other flag of the command must be a field of the dataclass.
SETTINGS_COMMANDS = {
    "simulate": (
        "diloco.sim.config:SimConfig",
        set(),
        {"table", "chips", "mode", "learners", "twin", "calibrate_from", "seeds", "seed",
         "json", "plot"},
    ),
    "plan": ("diloco.plan:PlanInputs", set(), {"comms", "link", "json"}),
    "bench": (
        "diloco.bench.matrix:Budget",
        {"slow_factor"},
        {"out", "modes", "conditions", "seeds", "peer", "sweep", "sweep_seeds", "sweep_only"},
    ),
    "torchft-peer": (
        "diloco.config.torchft:PeerSettings",
        {"threads", "min_replicas", "join_timeout_ms", "quorum_tick_ms",
         "heartbeat_timeout_ms", "start_timeout_s", "stop_timeout_s", "max_minutes"},
        {"json"},
    ),
}  # fmt: skip


def settings_parser(command: str) -> argparse.ArgumentParser:
    if command == "torchft-peer":
        from diloco.cli.torchft_peer import parser

        return parser()
    return subparsers()[command]


def settings_fields(cls) -> dict[str, tuple[type, dataclasses.Field, object]]:
    """Every setting of ``cls`` and its sections: name -> (its class, its field, the default
    its flag must have: the field's, or for a section's field the value in its owner's
    default section)."""
    out = {}
    for f in dataclasses.fields(cls):
        sub = sections(cls).get(f.name)
        if sub is None:
            out[f.name] = (cls, f, default_of(f))
            continue
        owned = default_of(f)
        for name, (owner, g, _) in settings_fields(sub).items():
            out[name] = (owner, g, getattr(owned, name))
    return out


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_a_settings_class_makes_its_commands_flags(command):
    """Issue 47: SimConfig, PlanInputs, Budget and PeerSettings are schema dataclasses, and
    their commands' flags are made from them: each option field is a flag with its name, its
    default and its docstring as help; every other flag is a listed switch of the command."""
    import importlib

    where, api_only, switches = SETTINGS_COMMANDS[command]
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    actions = {
        a.dest: a
        for a in settings_parser(command)._actions
        if not isinstance(a, argparse._HelpAction)
    }
    flags = set()
    for field_name, (owner, f, default) in settings_fields(cls).items():
        if field_name in api_only:
            assert f not in options(owner), f"{command}: {field_name} is an option"
            continue
        assert f in options(owner), f"{command}: {owner.__name__}.{field_name} is no option"
        action = actions.get(field_name)
        assert action is not None, f"{command}: {owner.__name__}.{field_name} has no flag"
        assert flag_name(f) in action.option_strings
        repeated = list(default.items()) if isinstance(default, dict) else default
        if isinstance(repeated, tuple | list):
            repeated = list(repeated)
        assert action.default == repeated, (command, field_name, action.default, default)
        doc = field_docs(owner)[field_name].replace("``", "")
        assert action.help.replace("%%", "%").startswith(doc), (command, field_name)
        flags.add(field_name)
    assert set(actions) - flags == switches, command


def test_a_settings_commands_defaults_build_the_dataclass_defaults():
    """The flags' defaults, parsed, are the dataclass's own defaults (sections included)."""
    from diloco.bench.matrix import Budget
    from diloco.config.torchft import PeerSettings
    from diloco.plan import PlanInputs
    from diloco.sim.config import SimConfig

    assert from_namespace(SimConfig, settings_parser("simulate").parse_args([])) == SimConfig()
    assert from_namespace(Budget, settings_parser("bench").parse_args([])) == Budget()
    peer = settings_parser("torchft-peer").parse_args([])
    assert from_namespace(PeerSettings, peer) == PeerSettings()
    plan = settings_parser("plan").parse_args(["--params", "12B", "--step-time", "2"])
    assert from_namespace(PlanInputs, plan) == PlanInputs(params=12e9, step_time_s=2.0)
    given = settings_parser("torchft-peer").parse_args(["--slow", "1=3", "--wan", "rate=1mbit"])
    assert from_namespace(PeerSettings, given).slow == {1: 3.0}
    assert from_namespace(PeerSettings, given).wan == ("rate=1mbit",)


def test_the_peers_defaults_are_our_syncers_and_torchfts_lighthouses():
    """PeerSettings repeated the lighthouse's defaults and had outer lr 1.0 and momentum 0
    under a comment saying "like our syncer's": each now comes from where it is written."""
    from diloco.config.torchft import LighthouseConfig, PeerSettings

    peer = PeerSettings()
    assert (peer.outer_lr, peer.outer_momentum) == (
        SyncerConfig.outer_lr,
        SyncerConfig.outer_momentum,
    )
    assert peer.sync_every == DEFAULT_SETTING.sync_every
    for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
        assert getattr(peer, name) == default_of(
            {f.name: f for f in dataclasses.fields(LighthouseConfig)}[name]
        )


def test_a_learner_has_no_sync_every(tmp_path, capsys):
    """A learner takes H from the syncer: ``--sync-every`` is refused, and a configuration
    file that still holds H (written before) reads without it."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["learner", "--id=x", "--no-sync", "--sync-every=4"])
    assert info.value.code == 2
    assert "unrecognized arguments: --sync-every" in capsys.readouterr().err
    doc = to_dict(WorkerConfig(id="x"))
    assert "sync_every" not in doc["protocol"]
    doc["protocol"]["sync_every"] = 24
    path = tmp_path / "learner.json"
    path.write_text(json.dumps(doc))
    assert load_config_file(str(path), WorkerConfig) == WorkerConfig(id="x")


def test_version(capsys):
    from diloco import __version__
    from diloco.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"diloco {__version__}"


@pytest.mark.parametrize("cls", [RunConfig, ServiceConfig, WorkerConfig, DpWorkerConfig])
def test_a_configuration_reads_back_from_toml_as_from_json(tmp_path, cls):
    """Issue 36: ``--config`` takes the TOML people write as well as JSON; a run writes its
    resolved configuration as TOML too, and it reads back to the same configuration."""
    from diloco.runtime.config_files import read_config_file, toml_text

    required = {
        WorkerConfig: dict(id="site-a"),
        DpWorkerConfig: dict(store="h:1", rank=1, world=2, checkpoint_dir="c", workdir="w"),
    }.get(cls, {})
    changed = {
        RunConfig: dict(learners=3, slow=["1=2"], chaos="kill:mtbf=60s", name='t o"ml'),
        ServiceConfig: dict(model="my_model:build", snapshot_every_s=7.5, state_dir="s"),
        WorkerConfig: dict(syncer="127.0.0.1:7000", checkpoint_every_s=2.5),
        DpWorkerConfig: dict(threads=2),
    }[cls]
    plain = cls(**required)
    for config in (plain, dataclasses.replace(plain, **changed)):
        doc = to_dict(config)
        (tmp_path / "c.toml").write_text(toml_text(doc))
        (tmp_path / "c.json").write_text(json.dumps(doc))
        assert read_config_file(tmp_path / "c.toml", cls) == config
        assert load_config_file(str(tmp_path / "c.json"), cls) == config
    (tmp_path / "bad.toml").write_text("learners = [\n")
    with pytest.raises(ConfigError, match="not TOML"):
        read_config_file(tmp_path / "bad.toml", cls)


def test_a_run_gives_its_learners_time_to_stop_cleanly_before_it_kills_them():
    # with 30 s, learners of --comms lowest (H = 128: a drain of up to 30 s after a 10 s
    # flush) were killed on a 100 kbit/s link while their last progress was on its way
    from diloco.learner.config import CLOSE_BOUND_S, MAX_DRAIN_S, LearnerConfig

    learner = LearnerConfig()
    assert 2 * learner.flush_timeout_s + MAX_DRAIN_S < CLOSE_BOUND_S  # link, flush, drain
    assert RunConfig().stop_after_s > CLOSE_BOUND_S
    # a longer flush (a slow link) is waited for; without a drain, no time for one
    assert RunConfig(flush_timeout_s=60.0).stop_after_s > 2 * 60.0 + MAX_DRAIN_S
    flush = learner.flush_timeout_s
    assert 2 * flush < RunConfig(drain_timeout_s=0.0).stop_after_s < CLOSE_BOUND_S
    assert RunConfig(stop_timeout_s=7.0).stop_after_s == 7.0  # given: as given
    # derived when asked, not written: a saved run given a longer flush waits for it
    assert RunConfig().stop_timeout_s is None


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("flush_timeout_s", -1.0, "--flush-timeout"),
        ("flush_timeout_s", float("inf"), "--flush-timeout"),
        ("drain_timeout_s", float("nan"), "--drain-timeout"),
        ("stop_timeout_s", float("inf"), "--stop-timeout"),
    ],
)
def test_a_stop_timeout_that_is_negative_or_unbounded_is_refused(field, value, flag):
    from diloco.config.worker import WorkerConfig

    with pytest.raises(ValueError, match=flag):
        RunConfig(**{field: value})
    if field != "stop_timeout_s":  # a learner by hand: the same flags, the same refusal
        with pytest.raises(ValueError, match=flag):
            WorkerConfig(id="x", **{field: value})
