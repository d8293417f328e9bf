"""Fault injection points (moetrain.faults): parsing, matching, firing once."""

import signal

import pytest

from moetrain.faults import fault_point, parse


def test_parse_several_faults_and_refuse_bad_specs():
    assert parse("train.step:1:5,save.commit:0:4:SIGSTOP") == [
        ("train.step", 1, 5, signal.SIGKILL),
        ("save.commit", 0, 4, signal.SIGSTOP),
    ]
    for bad in ("nowhere:0:1", "train.step:x:1", "train.step:0:1:SIGNOPE", "train.step:0"):
        with pytest.raises(ValueError, match="MOETRAIN_FAULT"):
            parse(bad)


def test_fires_at_its_point_only_and_once(monkeypatch, tmp_path):
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        monkeypatch.setenv("MOETRAIN_FAULT", "train.step:1:3:SIGUSR1,save.commit:0:4:SIGUSR1")
        monkeypatch.setenv("MOETRAIN_FAULT_ONCE", str(tmp_path / "fired"))
        fault_point("train.step", 0, 3)  # another rank
        fault_point("train.step", 1, 4)  # another step
        fault_point("save.commit", 1, 3)  # another point
        assert got == []
        fault_point("train.step", 1, 3)
        fault_point("train.step", 1, 3)  # a restarted job runs through
        assert got == [signal.SIGUSR1]
        fault_point("save.commit", 0, 4)
        assert got == [signal.SIGUSR1] * 2
        assert sorted(p.name for p in (tmp_path / "fired").iterdir()) == [
            "save.commit-0-4",
            "train.step-1-3",
        ]
    finally:
        signal.signal(signal.SIGUSR1, previous)
