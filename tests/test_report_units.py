"""The report room's one JSONL reader, its one metrics writer and one duration grammar."""

import pytest

from diloco.runtime.jsonl import read_jsonl
from diloco.runtime.metrics import METRICS_FILE, append_metric
from diloco.runtime.units import YEAR_S, parse_duration

pytestmark = pytest.mark.timeout(30)


def test_read_jsonl_skips_a_torn_line_and_non_objects(tmp_path):
    path = tmp_path / "tape.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\n{"b": 2}\n{"c": ')  # killed mid-write
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]


def test_read_jsonl_of_a_missing_file(tmp_path):
    assert read_jsonl(tmp_path / "none.jsonl") == []
    with pytest.raises(OSError):
        read_jsonl(tmp_path / "none.jsonl", missing_ok=False)


def test_every_mode_writes_one_metrics_schema(tmp_path):
    """The launcher (a status, versions summed) and data-parallel (a step) write one record."""
    decoupled = append_metric(
        tmp_path, started=100.0, val_loss=2.5, scores={"acc": 0.5}, versions=7, tokens=640,
        rounds=3, now=112.3456,
    )  # fmt: skip
    dp = append_metric(
        tmp_path, started=100.0, val_loss=2.4, scores={}, versions=9, tokens=None, rounds=9,
        now=130.0,
    )  # fmt: skip
    read = read_jsonl(tmp_path / METRICS_FILE)
    assert read == [decoupled, dp]
    assert read[0] == {
        "t": 12.346, "val_loss": 2.5, "val_acc": 0.5, "versions": 7, "tokens": 640, "rounds": 3,
    }  # fmt: skip
    assert set(read[1]) == {"t", "val_loss", "versions", "tokens", "rounds"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("250ms", 0.25),
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1y", YEAR_S),
        (" 1.5M ", 90.0),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "-1s", "nan", "5 minutes", "1w"])
def test_bad_durations_name_the_text(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
