"""tools/pearl_replay.py: sd's and PEARL's loops replayed on given call latencies, literal cases worked by hand."""

import json

import pytest

from streamfuse.tools.pearl_replay import Latencies, main, pearl_seconds, sd_seconds

LAT = Latencies("unit", target_ms=10, verify_ms=12, draft_ms=1)
# matches (position 0 is the root), gamma -> (SD ms, PEARL ms):
#  all drafts right: SD 2 draft calls + verify (3 tokens), then 3 + verify (3 tokens) = 14 + 15;
#    PEARL: a plain pre-verify step (10), the worker's first draft is right, then two chains whose drafts
#    were made while the host worked (12 each): 10 + 12 + 12.
#  all wrong: SD (2 + 12) per token for 4 tokens; PEARL a plain step per token, the worker's draft long ready.
CASES = [
    ([False] + [True] * 6, 2, 29.0, 34.0),
    ([False] * 5, 2, 56.0, 40.0),
    ([False, True, False, True, True, True], 1, 41.0, 44.0),
]


@pytest.mark.parametrize("matches, gamma, sd_ms, pearl_ms", CASES)
def test_replayed_milliseconds_are_the_hand_worked_ones(matches, gamma, sd_ms, pearl_ms):
    assert 1000 * sd_seconds(matches, gamma, LAT) == pytest.approx(sd_ms)
    assert 1000 * pearl_seconds(matches, gamma, LAT) == pytest.approx(pearl_ms)


def test_a_slow_worker_makes_the_host_wait_for_its_drafts():
    """Drafts 20 ms each against a 12 ms verify: each chain waits for the worker."""
    slow = Latencies("slow draft", 10, 12, 20)
    assert pearl_seconds([False] + [True] * 6, 2, slow) > pearl_seconds([False] + [True] * 6, 2, LAT) + 0.05


@pytest.mark.parametrize(
    "text, message",
    [
        ("npu:1,2", "NAME:TARGET_MS,VERIFY_MS,DRAFT_MS"),
        (":1,2,3", "a name and three positive"),
        ("x:1,0,3", "three positive"),
    ],
)
def test_a_bad_device_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        Latencies.parse(text)


def test_the_table_is_labelled_simulated_and_repeats_its_latencies(tmp_path, capsys):
    matches = tmp_path / "matches.json"
    matches.write_text(json.dumps({"matches": [[False] + [True] * 6, [False] * 5]}))
    out = tmp_path / "replay.json"
    assert (
        main(
            [
                "--artifact",
                str(tmp_path),
                "--matches",
                str(matches),
                "--gamma",
                "2",
                "--device",
                "unit:10,12,1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = json.loads(out.read_text())
    assert table["simulated"] is True and table["rows"][0]["latencies_ms"]["draft_ms"] == 1
    assert table["rows"][0]["pearl_vs_sd"] == pytest.approx((29 + 56) / (34 + 40))
    assert "SIMULATED" in capsys.readouterr().out
