"""Issue 29: what a progress bar says (progress.py), how it reaches the dashboard's rows, and the
job's events (notify.py): pure parts, fake clock and fake senders."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from orchestrator.errors import ConfigError
from orchestrator.job.events import LogLine
from orchestrator.node.supervise import notify as node_notify
from orchestrator.run.notifier import Notifier
from orchestrator.config.notify import Target, targets
from orchestrator.diagnose import progress
from orchestrator.diagnose.progress import Bar, ProgressBoard, chosen_rank, read


@pytest.mark.parametrize("text, n, total, rate, unit, remaining", [
    (" 45%|████▌     | 450/1000 [00:12<00:15, 36.20it/s]", 450, 1000, 36.2, "it", 15),
    ("Epoch 0:  45%|████▌     | 450/1000 [00:12<00:15, 36.20it/s, v_num=0, loss=0.1]", 450, 1000, 36.2, "it", 15),
    ("train:   0%|          | 0/3 [00:00<?, ?it/s]", 0, 3, None, "it", None),
    ("step:  33%|###3      | 1/3 [00:01<00:02,  1.23s/it]", 1, 3, 1 / 1.23, "it", 2),
    ("copy: 4.50k/10.0k [01:02<1:00:05, 3.62kB/s]", 4500, 10000, 3620, "B", 3605),
    ("progress: 7/20", 7, 20, None, "it", None),
])
def test_the_tqdm_format_and_its_variants_are_read(text, n, total, rate, unit, remaining):
    got = read(text)
    assert (got.n, got.total, got.unit, got.remaining) == (n, total, unit, remaining)
    assert got.rate == pytest.approx(rate) if rate is not None else got.rate is None


@pytest.mark.parametrize("text", ["loss 0.5 acc 10/20", "450it [00:12, 36.20it/s]", "0/0 [00:00<?, ?it/s]",
                                  "my progress: 3/4"])
def test_what_is_no_progress_is_not_read_as_one(text):
    assert read(text) is None


def test_a_node_shows_the_first_of_the_ranks_asked_for_else_its_first():
    assert chosen_rank(range(4, 8), None) == 4
    assert chosen_rank(range(4, 8), frozenset({1, 6, 5})) == 5
    assert chosen_rank(range(4, 8), frozenset({1})) == 4


def bar(rank: int, done: int, total: int = 100, rate: str = "10.00it/s", left: str = "00:09") -> Bar:
    return Bar("err", rank, (f"train: {done}%|##| {done}/{total} [00:01<{left}, {rate}]",))


def test_the_board_gives_each_node_its_bar_its_pace_and_the_job_its_slowest_eta():
    board = ProgressBoard([range(0, 2), range(2, 4)])
    board.bars(0, [bar(1, 90), bar(0, 10)], now=100.0)  # rank 1 is not node 0's chosen rank
    board.bars(1, [bar(2, 40, left="01:00")], now=100.0)
    assert board.cells(0, 100.0) == ("train: 10%|##| 10/100 [00:01<00:09, 10.00it/s]", "10% 10it/s eta 0:09")
    assert board.cells(1, 130.0)[1] == "40% 10it/s eta 0:30"  # the bar's own ETA, gone down since it said so
    assert board.eta(130.0, [0, 1]) == pytest.approx(30.0)
    board.bars(0, [Bar("err", 0, ())], now=131.0)  # the bar is cleared: the row goes, the last reading stays
    assert board.cells(0, 131.0)[0] == ""


def test_without_the_bars_rate_the_board_measures_it_and_marks_a_slow_node_once():
    board = ProgressBoard([range(0, 1), range(1, 2), range(2, 3)])
    for t in range(0, 12, 2):
        for node, per_s in ((0, 10), (1, 10), (2, 5)):
            board.lines(node, [LogLine("out", node, f"progress: {per_s * t}/1000")], now=float(t))
    assert board.pace[0].rate() == pytest.approx(10.0)
    assert board.cells(2, 10.0)[1] == "5% 5it/s eta 3:10"
    assert board.slow([0, 1, 2]) == {2: "0.50x"}
    assert board.newly_slow([0, 1, 2]) == {2: "0.50x"} and board.newly_slow([0, 1, 2]) == {}
    assert board.slow([0, 1]) == {}  # two at the same pace: no one is slow


def error(at: tuple, why: str) -> ConfigError:
    return ConfigError("c.yaml", 3, ".".join(map(str, ("notify", *at))), why)


def test_notify_targets_are_checked_with_the_key_that_is_wrong():
    assert targets(["json://127.0.0.1:9/x", {"webhook": "http://h/x", "on": ["ended"]}, {"command": "cat"}], error) == (
        Target("url", "json://127.0.0.1:9/x"), Target("webhook", "http://h/x", ("ended",)), Target("command", "cat"))
    for bad, where, words in ((["nope://token"], "notify.0.url", "Apprise does not know this URL (scheme 'nope')"),
                              ([{"webhook": "ftp://x"}], "notify.0.webhook", "http:// or https://"),
                              ([{"command": "x", "on": ["finished"]}], "notify.0.on", "ended, restart"),
                              ([{"webhook": "http://x", "command": "y"}], "notify.0", "one of"),
                              ("slack://x", "notify", "must be a list")):
        with pytest.raises(ConfigError) as e:
            targets(bad, error)
        assert e.value.key == where and words in str(e.value), str(e.value)
        assert "token" not in str(e.value)


def test_a_notifier_masks_every_payload_and_tells_a_failing_target_once():
    sent, warned = [], []

    def fails(value, payload):
        raise OSError(f"refused by {value}")

    notifier = Notifier((Target("webhook", "http://hook/T0KEN"), Target("command", "tell", ("ended",))), "J1",
                        frozenset({"http://hook/T0KEN", "p4ssw0rd"}), warned.append,
                        senders={"webhook": fails, "command": lambda value, payload: sent.append(payload)})
    notifier.event("hang", "job J1 looks hung: rank 3 printed p4ssw0rd")
    notifier.event("restart", "again")
    notifier.event("ended", "job J1 ok", ok=True)
    notifier.close()
    assert [p["event"] for p in sent] == ["ended"]  # the command only wants `ended`
    assert sent[0]["job_id"] == "J1" and sent[0]["ok"] is True and sent[0]["time"].endswith("Z")
    assert warned == ["notify[0] (webhook) failed: refused by ***; the job is not affected (told once)"]


def test_a_command_target_gets_the_event_on_stdin_and_its_failure_says_why(tmp_path):
    out = tmp_path / "got.json"
    node_notify.run(f"cat > {out}", {"event": "ended", "job_id": "J"})
    assert '"event": "ended"' in out.read_text()
    with pytest.raises(OSError, match="exited with 3: nope"):
        node_notify.run("echo nope >&2; exit 3", {"event": "ended"})
    with pytest.raises(OSError, match="ran past 0.2 s"):
        node_notify.run("sleep 30", {"event": "ended"}, timeout=0.2)


def test_a_run_record_outside_a_checkout_and_without_a_cluster_file(tmp_path, monkeypatch):
    from orchestrator.run import record as runrecord

    monkeypatch.chdir(tmp_path)
    record = runrecord.RunRecord.take(["ddp-up", "-H", "a,b", "train.py", "--token", "s3cr3t"], None, str(tmp_path))
    assert record.git is None and record.commit is None
    record.write(str(tmp_path / "run"), frozenset({"s3cr3t"}))
    written = json.loads((tmp_path / "run" / "run.json").read_text())
    assert written["cluster_file"] is None and written["git"] is None and written["command"][-1] == "***"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]


def test_a_long_diff_is_cut_and_says_so(tmp_path, monkeypatch):
    from orchestrator.run import record as runrecord

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "big.txt").write_text("x\n")
    subprocess.run([*git, "add", "big.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (tmp_path / "big.txt").write_text("y\n" * 50_000)
    monkeypatch.setattr(runrecord, "DIFF_MAX", 1000)
    state = runrecord.git_state(str(tmp_path))
    assert state.dirty and state.diff_cut and len(state.diff) == 1000 and state.diff.startswith(b"diff --git")


HOSTILE_ROWS = ["progress 1/2 [0<:]", "1/2 [::::<:::]", "1/2 [0<0, :it/s]", "9" * 400 + "/1 [00:01<00:02]",
                "1/" + "9" * 400 + " [00:01<00:02]", "1/2 [" + "9" * 400 + "<" + "9" * 400 + ", 1it/s]",
                "1/2 [00:01<00:02, " + "9" * 400 + "it/s]", "1/2 [00:01<00:02, 0.00s/it]", "1" * 20_000,
                "1/2 [" * 5_000, "1.5.5/2 [00:01<00:02]", "progress: " + "1/" * 10_000, "0/0 [00:00<00:00]",
                "1e308/1e308 [00:01<00:02]", "\x00/\x00 [\x00<\x00]", "１/２ [00:01<00:02]"]


@pytest.mark.parametrize("row", HOSTILE_ROWS, ids=range(len(HOSTILE_ROWS)))
def test_whatever_a_rank_draws_reading_it_never_raises_and_the_figures_are_finite(row):
    """A rank's bar is the job's text: a bad clock, a 400-digit ETA, a 20,000-digit run are read
    as no progress (or finite figures), never an exception in the controller."""
    reading = progress.read(row)
    if reading is not None:
        assert all(math.isfinite(x) for x in (reading.n, reading.total, reading.rate or 0, reading.remaining or 0))
    pace = progress.NodePace()
    if reading is not None:
        pace.take(reading, 0.0)
    assert isinstance(pace.text(1.0), str)
    assert progress.duration(float("inf")) == progress.duration(1e300) == "876000:00:00"


def test_an_unquoted_on_key_which_yaml_reads_as_true_is_taken():
    from orchestrator.config.clusterfile import parse_cluster

    config = parse_cluster("nodes: [{host: a, gpus: 1}]\nnotify:\n  - command: ./on-event.sh\n    on: [ended, hang]\n", "c.yaml")
    assert config.notify[0].events == ("ended", "hang")


@pytest.mark.parametrize("kind, value, masked, shown", [
    ("command", "true", [], ["true"]),
    ("command", 'curl -H "Authorization: Bearer xoxb1234567890abcdef" https://x', ["xoxb1234567890abcdef"], ["curl"]),
    ("url", "tgram://123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw/12345", ["AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"], []),
    ("webhook", "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
     ["XXXXXXXXXXXXXXXXXXXXXXXX", "B00000000"], ["hooks.slack.com", "services"]),
    ("url", "mailto://user:hunter2pass@gmail.com", ["hunter2pass"], ["gmail.com"]),
])
def test_a_targets_secret_parts_are_masked_not_the_whole_target(kind, value, masked, shown):
    """`command: true` masked every "true" in every log; a URL's token is masked wherever it shows,
    also in part (an error message that quotes only the path)."""
    secrets = Target(kind, value).secrets()
    assert all(m in secrets for m in masked) and not any(s in secrets for s in shown), secrets
    text = f"failed: {value.split('//')[-1]} said no"
    from orchestrator.config.masking import mask_secrets
    assert not any(m in mask_secrets(text, frozenset(secrets)) for m in masked)


def test_a_run_that_never_started_still_sends_its_ended_event():
    """A node not ready (exit 3) or an internal error (70) sent no `ended` event: the user waiting
    for one heard nothing."""
    from orchestrator.errors import NodeProblem, SetupError

    sent = []
    notifier = Notifier((Target("command", "cat"),), "J1", frozenset(), warn=lambda text: None,
                        senders={"command": lambda value, payload: sent.append(payload)})
    notifier.unstarted(SetupError([NodeProblem("gpu-b", "script train.py not found", "copy it")]))
    notifier.unstarted(RuntimeError("a bug"))
    assert [(p["event"], p["exit_code"], p["ok"]) for p in sent] == [("ended", 3, False), ("ended", 70, False)]
    assert sent[0]["text"].startswith("job J1 did not run (exit status 3): 1 node(s) not ready; nothing was started")
    assert sent[1]["text"] == "job J1 did not run (exit status 70): internal error in ddp-up (RuntimeError)"


def test_richs_bar_as_lightning_draws_it_is_read():
    assert read("Epoch 3/9 ━━━━━━━━━ 12/40 0:00:01 • 0:00:03 9.87it/s v_num: 0") == \
        progress.Reading(12.0, 40.0, 9.87, "it", 3.0)
    assert read("Epoch 0/9 ━━━ 0/40 0:00:00 • -:--:-- 0.00it/s").remaining is None
    assert read("Epoch 0/9 ━━━━━━━━━") is None  # no count yet


def test_colors_and_other_escapes_go_whole_from_what_the_console_shows():
    from orchestrator.clean import safe_text

    assert safe_text("\x1b[32mgreen\x1b[0m, \x1b]0;a title\x07plain\x1b[?25h \x9b31mx\x1b[2K") == "green, plain x"
    assert safe_text("\x1b[" + "9" * 100 + "m") == "[" + "9" * 100 + "m"  # too long to be one: its ESC goes
