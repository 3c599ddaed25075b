"""Named communication settings (``--comms``): what each names, what overrides it, where it
travels, and a learner's link budget checked against a real syncer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kit import diloco_command, local_syncer, tiny_model, wait_until

from diloco import Learner
from diloco.cli import build_parser, main
from diloco.cli.common import config_from_args
from diloco.config import ConfigError, from_dict, to_dict
from diloco.config.run import RunConfig, load_run_config
from diloco.config.service import ServiceConfig
from diloco.launch.children import write_config
from diloco.learner.config import LearnerConfig
from diloco.syncer.config import SyncerConfig
from diloco.wire.comms import (
    COMMS,
    CommsBudgetError,
    bytes_per_value,
    check_budget,
    exchange_bytes,
    setting_bytes,
)
from diloco.wire.protocol import ProtocolConfig


def test_the_settings_table_holds_only_named_settings_and_experiments_stand_apart():
    """``wire.comms`` is the protocol's named settings; what was only measured (the former
    default, the sparse codec) lives in ``wire.experimental`` and no named setting uses it."""
    from diloco.algorithm.codecs import CODECS
    from diloco.wire import comms, experimental

    named = list(COMMS.values())
    in_comms = [v for v in vars(comms).values() if isinstance(v, comms.CommsSetting)]
    assert all(any(v is s for s in named) for v in in_comms), "a setting beside the table"
    assert experimental.FORMER_DEFAULT not in named
    assert set(experimental.EXPERIMENTAL_CODECS) <= set(CODECS)
    for setting in named:
        assert not {setting.up_codec, setting.down_codec} & set(experimental.EXPERIMENTAL_CODECS)


def test_each_setting_names_h_and_both_codecs_and_a_flag_beside_it_wins():
    assert list(COMMS) == ["default", "low", "lowest"]
    plain = SyncerConfig()
    assert (plain.protocol.sync_every, plain.up_codec, plain.down_codec) == (16, "sign1", "int2")
    for name, s in COMMS.items():
        c = SyncerConfig(protocol=ProtocolConfig(comms=name))
        assert (c.protocol.sync_every, c.up_codec, c.down_codec, c.down_feedback) == (
            s.sync_every,
            s.up_codec,
            s.down_codec,
            s.down_feedback,
        )
        flipped = SyncerConfig(
            protocol=ProtocolConfig(comms=name), down_feedback=not s.down_feedback
        )
        assert flipped.down_feedback is not s.down_feedback
    mixed = SyncerConfig(protocol=ProtocolConfig(comms="lowest", sync_every=64), up_codec="int8")
    assert (mixed.protocol.sync_every, mixed.up_codec, mixed.down_codec) == (64, "int8", "sign1w")
    with pytest.raises(ValueError, match="--comms must be one of default, low, lowest"):
        ProtocolConfig(comms="fast")
    with pytest.raises(ValueError, match="--comms must be one of"):
        ProtocolConfig(comms="fast", sync_every=8)  # refused even when H is given


def test_settings_are_ordered_densest_first_and_priced_with_real_codec_bytes():
    costs = [setting_bytes(name) for name in COMMS]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs)
    assert bytes_per_value("topk2") < 0.08 < bytes_per_value("int4") < bytes_per_value("int8")
    assert exchange_bytes(48, "int4", "int4") == pytest.approx(
        exchange_bytes(24, "int4", "int4") / 2
    )


def test_a_learners_budget_refuses_a_heavier_syncer_and_takes_a_lighter_one():
    check_budget("low", sync_every=24, up_codec="sign1", down_codec="sign1")  # exactly it
    check_budget("default", sync_every=96, up_codec="topk2", down_codec="int4")  # lighter
    with pytest.raises(CommsBudgetError, match=r"H=24, int4 up, int8 down: 5\.0x the traffic"):
        check_budget("low", sync_every=24, up_codec="int4", down_codec="int8")
    with pytest.raises(CommsBudgetError, match="cannot be priced"):  # fatal, not retried
        check_budget("low", sync_every=24, up_codec="int3", down_codec="int8")
    with pytest.raises(ValueError, match="--comms must be one of"):
        LearnerConfig(comms="fast")  # refused at once, not at join


def test_the_command_line_and_config_files_resolve_comms_the_same_way(tmp_path):
    def run_config(*argv):
        args = build_parser().parse_args(["run", *argv])
        return config_from_args(RunConfig, args, load_run_config)

    c = run_config("--comms", "lowest", "--up-codec", "int8")
    assert (c.syncer.protocol.sync_every, c.syncer.up_codec, c.syncer.down_codec) == (
        128,
        "int8",
        "sign1w",
    )
    assert c.syncer.down_feedback is False
    # a run's config.json holds the resolved values and repeats the run exactly
    assert from_dict(RunConfig, json.loads(json.dumps(to_dict(c)))) == c
    # --comms beside a file names H and the codecs anew (the file's were written resolved)
    path = write_config(tmp_path / "config.json", RunConfig())
    again = run_config(f"--config={path}", "--comms", "low")
    assert (again.syncer.protocol.sync_every, again.syncer.up_codec) == (24, "sign1")
    assert again.syncer.down_codec == "sign1"  # the file's int8 gave way
    assert again.syncer.down_feedback is False  # and its feedback
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(ServiceConfig, {"syncer": {"comms": "low"}})  # it lives in the protocol


def test_every_command_takes_comms_and_a_bad_name_is_one_line_exit_2(capsys):
    for command in ("run", "syncer", "learner"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--comms", "fast"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
        assert "--comms: invalid choice: 'fast'" in err


def test_a_runs_learners_leave_the_exchange_to_the_runs_syncer():
    from diloco.launch.children import LearnerPlan, service_config, worker_config

    config = from_dict(RunConfig, {"syncer": {"protocol": {"comms": "low"}, "up_codec": "int8"}})
    assert service_config(config).syncer.up_codec == "int8"
    worker = worker_config(
        config,
        LearnerPlan(id="learner-0", index=0, batch_size=8, slow=1.0),
        syncer="127.0.0.1:1",
        started=0.0,
        workdir=Path("/nonexistent"),
        corrupt={},
    )
    assert worker.protocol.comms is None  # no budget check against the run's own codecs


def test_a_learner_refuses_a_syncer_heavier_than_its_comms_and_says_why():
    model = tiny_model(0, (8, 8))
    server = local_syncer(model, SyncerConfig(heartbeat_s=0.2), num_fragments=2)
    learners = []
    try:
        light = Learner(
            tiny_model(0, (8, 8)), syncer=server.address, num_fragments=2, comms="low",
            learner_id="light-link",
        )  # fmt: skip
        learners.append(light)
        wait_until(lambda: light.link.error is not None, 15, "the learner refuses the syncer")
        with pytest.raises(
            RuntimeError, match="--comms: the syncer runs H=16, sign1 up, int2 down"
        ):
            light.step(8)
        fine = Learner(
            tiny_model(0, (8, 8)), syncer=server.address, num_fragments=2, comms="default",
            learner_id="default-link",
        )  # fmt: skip
        learners.append(fine)
        assert fine.wait_for_global(timeout=15) and fine.link.error is None
        fine.step(8)
    finally:
        for learner in learners:
            learner.close()
        server.stop()


@pytest.mark.slow
def test_a_learner_process_over_its_budget_exits_1_with_the_reason(tmp_path):
    from diloco.config.common import RecipeConfig
    from diloco.recipes import recipe_of

    model = recipe_of(RecipeConfig(recipe="tiny")).build_model(0)
    server = local_syncer(model, SyncerConfig(heartbeat_s=0.2))
    try:
        done = subprocess.run(
            diloco_command(
                "learner", "--recipe=tiny", f"--syncer={server.address}", "--id=site-a",
                "--comms=low", "--total-steps=5", f"--workdir={tmp_path}",
            ),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("diloco learner site-a: --comms: the syncer runs H=16, sign1 up")


def test_the_flags_that_rebuild_a_configuration_name_the_setting_not_its_values():
    from diloco.runtime.schema import command_flags

    lowest = SyncerConfig(protocol=ProtocolConfig(comms="lowest"))
    assert command_flags(lowest) == ["--comms", "lowest"]
    mixed = SyncerConfig(protocol=ProtocolConfig(comms="lowest", sync_every=96), up_codec="int8")
    assert command_flags(mixed) == ["--up-codec", "int8", "--comms", "lowest", "--sync-every", "96"]
    assert command_flags(SyncerConfig()) == []
    off = SyncerConfig(down_feedback=False)
    assert command_flags(off) == ["--down-feedback", "off"]
    assert SyncerConfig(down_feedback=True).down_feedback is True


def test_down_feedback_is_on_or_off_on_the_command_line(capsys):
    def syncer_of(*argv):
        args = build_parser().parse_args(["run", *argv])
        return config_from_args(RunConfig, args, load_run_config).syncer

    assert syncer_of().down_feedback is True
    assert syncer_of("--down-feedback", "off").down_feedback is False
    assert syncer_of("--down-feedback", "ON").down_feedback is True
    lowest = COMMS["lowest"].down_feedback
    assert syncer_of("--comms", "lowest").down_feedback is lowest
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["run", "--down-feedback", "maybe"])
    assert exc.value.code == 2
    assert "expected on or off, got 'maybe'" in capsys.readouterr().err


def test_a_configuration_file_from_before_down_feedback_keeps_it_on(tmp_path):
    """Files written before ``down_feedback`` existed hold the resolved H and codecs and no
    ``down_feedback``: their runs kept the down codec's rounding, and so does reading them,
    whatever their ``--comms`` name means now."""
    old = {"protocol": {"comms": "low", "sync_every": 64}, "up_codec": "int4", "down_codec": "int4"}
    assert from_dict(SyncerConfig, old).down_feedback is True
    written = to_dict(SyncerConfig(protocol=ProtocolConfig(comms="low")))
    assert from_dict(SyncerConfig, written).down_feedback is False  # new files say it
    assert from_dict(SyncerConfig, {"protocol": {"comms": "low"}}).down_feedback is False
    run = to_dict(RunConfig())
    del run["syncer"]["down_feedback"]
    run["syncer"]["protocol"]["comms"] = "lowest"
    assert from_dict(RunConfig, run).syncer.down_feedback is True
