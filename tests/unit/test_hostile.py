"""Hostile and careless inputs: each one ends with its documented exit status and one message that
names the file, line and key (or the flag) and the fix; never a traceback, never a hang.

Every case runs the real CLI in-process. Nodes, where a case needs any, are local or a closed port
on 127.0.0.1: nothing here leaves this machine.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import pytest

from orchestrator.commands.attach import main_attach, main_logs, main_ls
from orchestrator.commands.check import main_check
from orchestrator.commands.kill import main_kill
from orchestrator.commands.fetch import main_fetch
from orchestrator.commands.up import main_up
from orchestrator.config.masking import mask_secrets
from tests.harness.runner import REPO

LOCAL = "transport: local\nnodes: [{host: a, gpus: 1}]\n"
SSH_CLOSED = "nodes: [{host: 127.0.0.1, gpus: 1, port: 1, connect_timeout: 5}]\n"  # refused at once
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, n in zip("abcdefgh", "bcdefghi")) \
    + "nodes: *i\n"


@dataclass
class Case:
    name: str
    argv: list[str]  # {c} is the cluster file, {d} the test's directory
    code: int
    message: str  # must appear in stderr (or stdout), with {c}/{d} filled in
    files: dict[str, str | bytes] = field(default_factory=dict)  # {"c.yaml": ...}
    env: dict[str, str] = field(default_factory=dict)
    tool: object = main_up
    absent: str | None = None  # must not appear anywhere (a secret)


CASES = [
    # --- the cluster file ---
    Case("not UTF-8", ["{c}", "t.py"], 2, "{c}:3: cluster file is not UTF-8 text (byte 0xe9); save it as UTF-8",
         {"c.yaml": b"nodes:\n  - {host: a, gpus: 1}\n# caf\xe9\n"}),
    Case("missing", ["{d}/nope.yaml", "t.py"], 2, "{d}/nope.yaml: cannot read cluster file: No such file"),
    Case("a directory", ["{d}", "t.py"], 2, "{d}: cannot read cluster file: Is a directory"),
    Case("NaN", ["{c}", "t.py"], 2, "{c}:1: orphan_timeout: must be a number of seconds > 0, or a duration such as 90s, 5m, 12h or 7d, got nan",
         {"c.yaml": "orphan_timeout: .nan\n" + LOCAL}),
    Case("inf", ["{c}", "t.py"], 2, "{c}:1: stop_grace: must be a number of seconds >= 0, or a duration such as 90s, 5m, 12h or 7d, got inf",
         {"c.yaml": "stop_grace: .inf\n" + LOCAL}),
    Case("-inf", ["{c}", "t.py"], 2, "{c}:1: hang_timeout: must be a number of seconds > 0, or a duration such as 90s, 5m, 12h or 7d, got -inf",
         {"c.yaml": "hang_timeout: -.inf\n" + LOCAL}),
    # huge but finite: refused, not an OverflowError deep in a running job's wait (issue 26)
    Case("orphan_timeout 1e10", ["{c}", "t.py"], 2,
         "{c}:1: orphan_timeout: must be at most 2592000 seconds (30 days), got 10000000000.0",
         {"c.yaml": "orphan_timeout: 1.0e+10\n" + LOCAL}),
    Case("restart_delay 1e10", ["{c}", "t.py"], 2, "{c}:1: restart_delay: must be at most 2592000 seconds",
         {"c.yaml": "restart_delay: 1.0e+10\n" + LOCAL}),
    Case("stop_grace 1e10", ["{c}", "t.py"], 2, "{c}:1: stop_grace: must be at most 2592000 seconds",
         {"c.yaml": "stop_grace: 10000000000\n" + LOCAL}),
    Case("connect_timeout 1e10", ["{c}", "t.py"], 2, "{c}:1: ssh.connect_timeout: must be at most 2592000 seconds",
         {"c.yaml": "ssh: {connect_timeout: 1.0e+10}\n" + LOCAL}),
    Case("retention of a million years", ["{c}", "t.py"], 2, "{c}:1: retention: must be at most 315360000 seconds",
         {"c.yaml": "retention: 365000000d\n" + LOCAL}),
    Case("restarts 10**12", ["{c}", "t.py"], 2, "{c}:1: restarts: must be an integer between 0 and 1000",
         {"c.yaml": "restarts: 1000000000000\n" + LOCAL}),
    Case("--hang-timeout 1e10", ["--hang-timeout", "1e10", "{c}", "t.py"], 2,
         "--hang-timeout must be a number of seconds > 0 and at most 2592000 (30 days)", {"c.yaml": LOCAL}),
    Case("--job-id with --sbatch", ["--job-id", "../../x", "--sbatch", "-N1", "{c}", "t.py"], 2,
         "--job-id '../../x': a job id is", {"c.yaml": LOCAL}),
    Case("--restarts 10**12", ["--restarts", "1000000000000", "{c}", "t.py"], 2,
         "--restarts must be an integer between 0 and 1000", {"c.yaml": LOCAL}),
    Case("gpus 10**9", ["{c}", "t.py"], 2, "{c}:2: nodes[0].gpus: must be an integer between 1 and 1024",
         {"c.yaml": "transport: local\nnodes: [{host: a, gpus: 1000000000}]\n"}),
    Case("a secret argument with --sbatch --export", ["--sbatch", "--export=NONE", "{c}", "t.py", "--key", "s3cr3t-value"],
         2, "a script argument holds a secret", {"c.yaml": "env: {API_KEY: s3cr3t-value}\n"},
         absent="s3cr3t-value"),
    Case("ddp-kill --signal KILL", ["--signal", "KILL", "{c}"], 2,
         "argument --signal: 'KILL': one of USR1, USR2, HUP, INT, QUIT, TERM", {"c.yaml": LOCAL}, tool=main_kill),
    Case("stop_signal SIGKILL", ["{c}", "t.py"], 2, "{c}:1: stop_signal: must be one of SIGTERM",
         {"c.yaml": "stop_signal: SIGKILL\n" + LOCAL}),
    Case("NUL in an env value", ["{c}", "t.py"], 2, "{c}:1: env.A: holds a NUL character",
         {"c.yaml": 'env: {A: "x\\0y"}\n' + LOCAL}),
    Case("NUL in an env_file value", ["{c}", "t.py"], 2, "{d}/x.env:2: B: holds a NUL character",
         {"c.yaml": "env_file: x.env\n" + LOCAL, "x.env": b"A=1\nB=x\x00y\n"}),
    Case("an interface name with a stray space", ["{c}", "t.py"], 2,
         "{c}:1: env.GLOO_SOCKET_IFNAME: interface names with spaces ('eth0, eth1')",
         {"c.yaml": 'env: {GLOO_SOCKET_IFNAME: "eth0, eth1"}\n' + LOCAL}),
    Case("a host with a space", ["{c}", "t.py"], 2, "{c}:1: nodes[0].host: the host 'gpu a' has a space",
         {"c.yaml": "nodes: [{host: gpu a, gpus: 1}]\n"}),
    Case("a host that is an ssh option", ["{c}", "t.py"], 2,
         "{c}:1: nodes[0].host: the host '-oProxyCommand=true' starts with '-'",
         {"c.yaml": "nodes: [{host: '-oProxyCommand=true', gpus: 1}]\n"}),
    Case("-H with an IPv6 address out of brackets", ["-H", "fe80::1:2", "t.py"], 2,
         "write an IPv6 address in brackets, e.g. -H [fe80::1]:8", {}),
    Case("--ranks of 5000 digits", ["--ranks", "9" * 5000, "{c}", "t.py"], 2, "expected a list like 0,3-5",
         {"c.yaml": LOCAL}),
    Case("--ranks in other digits", ["--ranks", "\u0663", "{c}", "t.py"], 2, "expected a list like 0,3-5",
         {"c.yaml": LOCAL}),
    Case("alias bomb", ["{c}", "t.py"], 2, "{c}:1: a: unknown key", {"c.yaml": BOMB}),
    Case("nested too deep", ["{c}", "t.py"], 2, "{c}: nested too deeply to be a cluster file",
         {"c.yaml": "nodes: " + "[" * 5000 + "]" * 5000 + "\n"}),
    Case("duplicate key", ["{c}", "t.py"], 2, "{c}:2: nodes: duplicate key (first set on line 1)",
         {"c.yaml": LOCAL.split("\n", 1)[1] + "nodes: []\n"}),
    Case("key that is not a name", ["{c}", "t.py"], 2, "{c}:1: a key must be a plain name",
         {"c.yaml": "? [a, b]\n: 1\n" + LOCAL}),
    Case("top level is a list", ["{c}", "t.py"], 2, "{c}:1: must be a mapping, got a list", {"c.yaml": "- a\n"}),
    Case("nodes is a mapping", ["{c}", "t.py"], 2, "{c}:1: nodes: must be a non-empty list of nodes",
         {"c.yaml": "nodes: {a: 1}\n"}),
    Case("gpus 1.5", ["{c}", "t.py"], 2, "{c}:1: nodes[0].gpus: must be an integer between 1 and 1024 or `auto`, got 1.5",
         {"c.yaml": "nodes: [{host: a, gpus: 1.5}]\n"}),
    Case("gpus true", ["{c}", "t.py"], 2, "nodes[0].gpus: must be an integer between 1 and 1024 or `auto`, got True",
         {"c.yaml": "nodes: [{host: a, gpus: true}]\n"}),
    Case("port 70000", ["{c}", "t.py"], 2, "master.port: must be an integer between 1 and 65535 or `auto`",
         {"c.yaml": "master: {port: 70000}\n" + LOCAL}),
    Case("env name with a newline", ["{c}", "t.py"], 2, "is not a valid environment variable name",
         {"c.yaml": 'env: {"FOO\\n": 1}\n' + LOCAL}),
    Case("env name with a space", ["{c}", "t.py"], 2, "is not a valid environment variable name",
         {"c.yaml": 'env: {"A B": 1}\n' + LOCAL}),
    Case("missing ssh.config_file", ["{c}", "t.py"], 2,
         "{c}:1: ssh.config_file: {d}/nope_config does not exist (or is a directory)",
         {"c.yaml": "ssh: {config_file: nope_config}\nnodes: [{host: a, gpus: 1}]\n"}),
    Case("missing env_file", ["{c}", "t.py"], 2, "{c}:1: env_file: cannot read env_file: No such file",
         {"c.yaml": "env_file: nope.env\n" + LOCAL}),
    Case("env_file not UTF-8", ["{c}", "t.py"], 2, "{d}/x.env:2: env_file is not UTF-8 text",
         {"c.yaml": "env_file: x.env\n" + LOCAL, "x.env": b"A=1\nB=\xff\n"}),
    Case("env_file bad line holding a secret", ["{c}", "t.py"], 2, "{d}/x.env:1: expected NAME=value",
         {"c.yaml": "env_file: x.env\n" + LOCAL, "x.env": "HF TOKEN=hf_s3cr3t_value\n"}, absent="hf_s3cr3t_value"),
    Case("sync source missing", ["{c}", "t.py"], 2, "{c}:1: sync: {d}/nowhere is not a directory",
         {"c.yaml": "sync: nowhere\n" + LOCAL}),
    # --- node lists ---
    Case("hostfile not UTF-8", ["--hostfile", "{d}/hosts", "t.py"], 2, "{d}/hosts:2: hostfile is not UTF-8",
         {"hosts": b"a slots=1\nb\xfe slots=1\n"}),
    Case("hostfile slots=0", ["--hostfile", "{d}/hosts", "t.py"], 2,
         "{d}/hosts:1: slots: slots must be an integer from 1 to 4096, got '0'", {"hosts": "a slots=0\n"}),
    Case("hostfile slots huge", ["--hostfile", "{d}/hosts", "t.py"], 2, "got '99999999999999'",
         {"hosts": "a slots=99999999999999\n"}),
    Case("hostfile slots in Arabic digits", ["--hostfile", "{d}/hosts", "t.py"], 2, "slots must be an integer",
         {"hosts": "a slots=\u0663\n"}),
    Case("-H zero slots", ["-H", "a:0", "t.py"], 2, "-H 'a:0': slots must be an integer from 1 to 4096"),
    Case("-H no host", ["-H", ":4", "t.py"], 2, "expected HOST:N[,HOST:N...]"),
    Case("Slurm range bomb", ["--slurm", "t.py"], 2, "expands to more than 65536 hosts",
         env={"SLURM_JOB_NODELIST": "n[1-999999999]", "SLURM_JOB_ID": "7"}),
    Case("Slurm product bomb", ["--slurm", "t.py"], 2, "expands to more than 65536 hosts",
         env={"SLURM_JOB_NODELIST": "n[1-1000][1-1000]", "SLURM_JOB_ID": "7"}),
    Case("Slurm brackets", ["--slurm", "t.py"], 2, "unbalanced brackets",
         env={"SLURM_JOB_NODELIST": "n[1-3", "SLURM_JOB_ID": "7"}),
    Case("Slurm reversed range", ["--slurm", "t.py"], 2, "bad Slurm host range [5-1]",
         env={"SLURM_JOB_NODELIST": "n[5-1]", "SLURM_JOB_ID": "7"}),
    # --- ids and flags ---
    Case("job id with ..", ["--job-id", "../../etc", "{c}", "t.py"], 2, "--job-id '../../etc': a job id is",
         {"c.yaml": LOCAL}),
    Case("job id with a slash", ["--job-id", "a/b", "{c}", "t.py"], 2, "--job-id 'a/b'", {"c.yaml": LOCAL}),
    Case("empty job id", ["--job-id", "", "{c}", "t.py"], 2, "--job-id ''", {"c.yaml": LOCAL}),
    Case("job id too long", ["--job-id", "j" * 65, "{c}", "t.py"], 2, "a job id is 1-64", {"c.yaml": LOCAL}),
    Case("job id starting with a dash", ["--job-id=-rf", "{c}", "t.py"], 2, "--job-id '-rf'", {"c.yaml": LOCAL}),
    Case("job id with a newline", ["--job-id", "a\nb", "{c}", "t.py"], 2, "--job-id 'a\\nb'", {"c.yaml": LOCAL}),
    Case("hidden job id", ["--job-id", ".x", "{c}", "t.py"], 2, "--job-id '.x'", {"c.yaml": LOCAL}),
    Case("fetch not a path", ["{c}", "t.py"], 2, "fetch: must be a path on the nodes or a list of them",
         {"c.yaml": LOCAL + "fetch: 5\n"}),
    Case("fetch with a NUL", ["{c}", "t.py"], 2, "fetch: holds a NUL character", {"c.yaml": LOCAL + 'fetch: ["a\\0b"]\n'}),
    Case("ddp-fetch NUL path", ["{c}", "a\0b", "{d}/out"], 2, "REMOTE_PATH 'a\\x00b'", {"c.yaml": LOCAL},
         tool=main_fetch),
    Case("job id of a run already there", ["--job-id", "j1", "{c}", "t.py"], 2,
         "--job-id: runs/j1 already holds a run (rank0.log, summary.json); a job id names one run",
         {"c.yaml": LOCAL, "runs/j1/summary.json": "{}", "runs/j1/rank0.log": "x\n"}),
    Case("ddp-kill --job path", ["{c}", "--job", "../x"], 2, "--job '../x': a job id is", {"c.yaml": LOCAL},
         tool=main_kill),
    Case("ddp-kill --job glob", ["{c}", "--job", "*"], 2, "--job '*'", {"c.yaml": LOCAL}, tool=main_kill),
    Case("hang timeout nan", ["--hang-timeout", "nan", "{c}", "t.py"], 2, "--hang-timeout must be a number",
         {"c.yaml": LOCAL}),
    Case("hang timeout inf", ["--hang-timeout", "inf", "{c}", "t.py"], 2, "--hang-timeout must be a number",
         {"c.yaml": LOCAL}),
    # --- known_hosts lines paramiko cannot read: the node is named, nothing crashes ---
    Case("@cert-authority and @revoked in known_hosts (ddp-up)", ["{c}", "t.py"], 3,
         "127.0.0.1: connection refused by 127.0.0.1:1",
         {"c.yaml": "ssh: {known_hosts: kh, client: fabric}\n" + SSH_CLOSED,
          "kh": "@cert-authority *.x ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"
                "@revoked * ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"
                "not a key line\n"}),
    Case("@cert-authority in known_hosts (ddp-kill)", ["{c}"], 1, "connection refused by 127.0.0.1:1",
         {"c.yaml": "ssh: {known_hosts: kh, client: fabric}\n" + SSH_CLOSED,
          "kh": "@cert-authority * ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"},
         tool=main_kill),
    Case("ddp-check against a refusing node", ["{c}"], 3, "connection refused by root@127.0.0.1:1",
         {"c.yaml": SSH_CLOSED}, tool=main_check),
    # --- ddp-kill must not depend on files only the launching machine has ---
    Case("ddp-kill without the env_file and sync source", ["{c}", "--dry-run"], 0, "ddp-kill (dry run",
         {"c.yaml": "env_file: gone.env\nsync: gone/\nforward_env: [NOT_SET_HERE_X]\n" + LOCAL}, tool=main_kill),
    # --- secrets in a failing setup command's message ---
    Case("secret in a failed setup command and its output", ["{c}", "t.py"], 3,
         "setup command 1 `echo *** >&2; false` failed with status 1: ***",
         {"c.yaml": "setup: 'echo k3y-very-secret >&2; false'\nenv: {API_KEY: k3y-very-secret}\n" + LOCAL},
         absent="k3y-very-secret"),
    # --- what a newcomer or a hostile file brings (the first hour, hardening round 4) ---
    Case("a script for a cluster file", ["train.py"], 2, "train.py is not a cluster file"),
    Case("-m with no module", ["{c}", "-m"], 2, "-m needs a module", {"c.yaml": LOCAL}),
    Case("a duration in words", ["{c}", "t.py"], 2, "{c}:1: hang_timeout: must be a number of seconds > 0, or a "
         "duration such as 90s, 5m, 12h or 7d, got '5 minutes'", {"c.yaml": "hang_timeout: 5 minutes\n" + LOCAL}),
    Case("a signal name through case folding", ["{c}", "t.py"], 2, "{c}:1: stop_signal:",
         {"c.yaml": "stop_signal: ſigusr1\n" + LOCAL}),
    Case("an image named like an option", ["{c}", "t.py"], 2, "container.image: must be an image's name or path",
         {"c.yaml": "container: {image: --privileged}\n" + LOCAL}),
    Case("bundled own container flags", ["{c}", "t.py"], 2, "container.options[0]: -itd is ddp-up's own",
         {"c.yaml": "container: {image: i, options: [-itd]}\n" + LOCAL}),
    Case("accelerate with uneven nodes", ["{c}", "t.py"], 2, "launcher: accelerate starts the same number of "
         "processes on every node", {"c.yaml": "launcher: accelerate\ntransport: local\nnodes: [{host: a, gpus: 2}, "
                                     "{host: b, gpus: 1}]\n"}),
    Case("a key of torchrun's", ["{c}", "t.py"], 2, "{c}:1: nproc_per_node: unknown key; `nproc_per_node` is "
         "`gpus:` here", {"c.yaml": "nproc_per_node: 8\n" + LOCAL}),
    Case("a mistyped option", ["--dryrun", "{c}", "t.py"], 2, "unrecognized arguments: --dryrun (did you mean "
         "--dry-run?)", {"c.yaml": LOCAL}),
    # --- an integer longer than Python converts, anywhere in the file, on every command (round 5) ---
    *(Case(f"{name}: an integer of 5000 digits", [*argv], 2, "{c}:3: %s: an integer of 5,000 characters" % key,
           {"c.yaml": LOCAL + text}, tool=tool)
      for name, tool, argv in [("ddp-up", main_up, ["{c}", "t.py"]), ("ddp-kill", main_kill, ["{c}"]),
                               ("ddp-check", main_check, ["{c}"]), ("ddp-ls", main_ls, ["{c}"]),
                               ("ddp-fetch", main_fetch, ["{c}", "ckpt", "{d}/out"]),
                               ("ddp-logs", main_logs, ["{c}", "20261127-010000-aaaaaa"]),
                               ("ddp-attach", main_attach, ["{c}", "20261127-010000-aaaaaa"])]
      for key, text in [("restarts", "restarts: " + "9" * 5000 + "\n"),
                        ("env.BIG", "env: {BIG: " + "1" * 5000 + "}\n")]),
    Case("a hexadecimal integer of 5000 digits", ["{c}", "t.py"], 2, "{c}:3: stop_grace: an integer of 5,002",
         {"c.yaml": LOCAL + "stop_grace: 0x" + "f" * 5000 + "\n"}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case: Case, tmp_path, capsys, monkeypatch):
    for name, content in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    fill = {"c": str(tmp_path / "c.yaml"), "d": str(tmp_path)}
    try:
        code = case.tool([a.format(**fill) for a in case.argv])
    except SystemExit as e:  # argparse's own refusal: its usage line and one message, exit 2
        code = e.code
    out, err = capsys.readouterr()
    assert code == case.code, (out, err)
    assert case.message.format(**fill) in " ".join((err + out).split()), (out, err)
    assert "Traceback" not in out + err
    if case.absent:
        assert case.absent not in out + err
        for root, _, names in os.walk(tmp_path):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    assert case.absent.encode() not in f.read() or name.endswith(("c.yaml", ".env")), name


def test_the_corpus_is_large():
    assert len(CASES) >= 40


def test_a_yaml_merge_key_with_an_override_is_a_valid_cluster_file(tmp_path, capsys):
    c = tmp_path / "c.yaml"
    c.write_text("nodes:\n  - &a {host: a, gpus: 2, python: python3}\n  - {<<: *a, host: b, gpus: 4}\n")
    assert main_up(["--dry-run", str(c), "t.py"]) == 0
    out = capsys.readouterr().out
    assert "# node 1 b (ssh b), ranks 2-5" in out  # gpus 4 overrides the merged 2


def test_secrets_are_masked_longest_first():
    assert mask_secrets("token=abcdef and abcd", {"abcd", "abcdef"}) == "token=*** and ***"
    assert mask_secrets("token=abcdef and abcd", {"abcdef", "abcd"}) == "token=*** and ***"


def test_summary_json_and_console_never_show_a_secret_in_script_arguments(tmp_path, capsys, monkeypatch):
    """launcher: none and a script without torch: a real local job in about a second."""
    (tmp_path / "t.py").write_text("import sys; print('args', sys.argv[1:])\n")
    (tmp_path / "c.yaml").write_text("launcher: none\nenv: {HF_TOKEN: hf_0123456789}\n" + LOCAL)
    monkeypatch.chdir(tmp_path)
    code = main_up(["--no-dashboard", "--runs-dir", str(tmp_path / "runs"), "--job-id", "J1", str(tmp_path / "c.yaml"),
                    "t.py", "--token=hf_0123456789"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "args ['--token=***']" in out and "hf_0123456789" not in out + err
    summary = json.loads((tmp_path / "runs" / "J1" / "summary.json").read_text())
    assert summary["args"] == ["--token=***"] and summary["exit_code"] == 0
    assert "hf_0123456789" not in (tmp_path / "runs" / "J1" / "rank0.log").read_text()


def test_a_runs_dir_that_cannot_be_written_never_stops_the_job(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.py").write_text("print('trained')\n")
    (tmp_path / "c.yaml").write_text("launcher: none\n" + LOCAL)
    (tmp_path / "file").write_text("a file where the runs dir's parent should be")
    monkeypatch.chdir(tmp_path)
    code = main_up(["--no-dashboard", "--runs-dir", str(tmp_path / "file" / "runs"), str(tmp_path / "c.yaml"), "t.py"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "trained" in out
    assert " ".join(out.split()).count("cannot write the run logs") == 1  # warned once, not per line


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_the_agent_state_root_is_private(tmp_path, monkeypatch):
    from orchestrator.node.local import state

    monkeypatch.setattr(state.tempfile, "gettempdir", lambda: str(tmp_path))
    root = state.state_root()
    os.mkdir(root, 0o755)  # as an earlier version made it: tightened, since nobody else could write
    assert state.private_dir(root) is None and os.stat(root).st_mode & 0o777 == 0o700
    os.chmod(root, 0o777)  # others could have planted anything: refused
    assert state.private_dir(root) == "is writable by other users (mode 777)"
    os.rmdir(root)
    os.symlink(str(tmp_path), root)  # a link planted in its place: refused, never followed
    assert state.private_dir(root) == "is a symbolic link or not a directory"
    os.unlink(root)
    path, problem = state.claim_node_dir("J", 0)
    assert problem is None and path.endswith("/J/node0")
    _, problem = state.claim_node_dir("J", 0)  # the same job id and node again: in use
    assert problem.what.startswith("job id J is already in use on this node")


def test_tables_into_a_pipe_keep_every_job_id_and_state_whole(capsys, tmp_path):
    """Issue 26, item 12: ddp-ls and ddp-kill printed into a pipe or a file show full job ids and
    states (no 80-column cut), and ddp-kill has --json as ddp-ls has."""
    from orchestrator.remote.cleanup import SweepReport
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.commands.attach import JobRow, ls_table
    from orchestrator.commands.common import table_console
    from orchestrator.commands.kill import kill_table

    job = "a-job-id-of-sixty-four-characters-" + "x" * 30
    node = parse_cluster(LOCAL).nodes[0]
    found = [{"pid": 1, "tags": {"DDP_UP_JOB": job}, "cmd": "python train.py"}]
    console = table_console()  # capsys: stdout is not a terminal
    console.print(kill_table([SweepReport(node, found=found)], dry_run=True))
    console.print(ls_table([JobRow(job=job, script="train.py", state="restarting", ranks=8, started=None, ended=None,
                                   exit_status=None, root_cause="node 3 failed (exit code 1): " + "y" * 80,
                                   nodes={}, attempt=2)], now=0.0))
    out = capsys.readouterr().out
    assert job in out and "restarting (attempt 2)" in out and "y" * 80 in out, out
    (tmp_path / "c.yaml").write_text(LOCAL)
    assert main_kill(["--json", "--job", "nothing-runs-under-this-id", str(tmp_path / "c.yaml")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rows == [{"node": 0, "host": "a", "jobs": [], "found": 0, "stopped": 0, "killed": 0, "left": 0,
                     "error": None, "dry_run": False, "removed": [], "containers": []}]


def test_a_setup_line_that_is_only_a_comment_runs_and_a_failing_one_is_still_named():
    """Issue 26, item 8: `setup: "# later"` made every node fail with bash's syntax error."""
    import subprocess

    from orchestrator.remote.transport import setup_script

    done = subprocess.run(["bash", "-c", setup_script(("# activate later", "true # and a comment"), None, "echo ran")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout == "ran\n", done
    failed = subprocess.run(["bash", "-c", setup_script(("# fine", "(exit 7)"), None, "echo ran")],
                            capture_output=True, text=True, timeout=30)
    assert failed.returncode == 96 and "setup command 2 failed with status 7" in failed.stderr, failed


HOSTILE_TEXT = ["[/x]", "[bold red]planted[/]", "\x1b]0;pwned\x07", "\x1b[2J\x1b[31mred", "\x9b31m", "tab\there"]


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_text_not_from_ddp_up_is_printed_as_text_everywhere(text, capsys):
    """Issue 26, item 7: a process tag, a record's field, a script name, a host or a node's answer
    holding terminal escapes or rich markup reached the terminal raw, or crashed ddp-kill/ddp-ls
    with exit 70 (for as long as the record was kept). Every table shows it as inert text."""
    from rich.console import Console

    from orchestrator.diagnose import collective
    from orchestrator.remote.cleanup import SweepReport
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.commands.attach import ls_table, merge_records
    from orchestrator.commands.check import check_table
    from orchestrator.commands.kill import kill_table
    from orchestrator.diagnose.outcome import JobResult, NodeStatus
    from orchestrator.plan.launch import make_plan

    plan = make_plan(parse_cluster(LOCAL), "train.py", [], "J", "/tmp")
    from dataclasses import replace
    node = replace(plan.nodes[0], config=replace(plan.nodes[0].config, host="host" + text))
    plan = replace(plan, nodes=(node,))
    found = [{"pid": 1, "tags": {"DDP_UP_JOB": "job" + text}, "cmd": "python train.py"}]
    record = {"job": "job" + text, "node": 0, "label": "n" + text, "script": "s" + text, "state": "failed" + text,
              "ranks": [0, 1], "started": 1.0, "ended": 2.0,
              "outcome": {"root_cause": {"state": "failed", "node": 0, "reason": "r" + text, "exception": "E" + text}}}
    status = NodeStatus(node, state="done", info={"python": "3.11" + text, "torch": "2" + text, "gpus": text})
    console = Console(file=__import__("io").StringIO(), force_terminal=True, width=200)
    for table in (kill_table([SweepReport(node.config, found=found)], dry_run=False),
                  ls_table(merge_records([record]), now=3.0), check_table([status], [], 29500),
                  collective.render({"world": 1, "backend": "gloo" + text, "all_reduce": [], "links": []},
                                    ["h" + text])):
        console.print(table)
    from orchestrator.views.console import summary_table
    console.print(summary_table(JobResult(plan, (status.outcome(),), 29500, ())))
    written = console.file.getvalue()
    # rich's own styles are SGR sequences (ESC [ ... m); nothing else of an ESC, BEL or C1 is left,
    # and markup shows as the text it is, not as a style
    import re
    assert not re.search(r"\x1b(?!\[[0-9;]*m)|\x07|\x9b", written), repr(written)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", written)
    if text.startswith("["):
        assert text in plain, plain


def test_a_detached_jobs_agent_masks_its_secrets_in_every_frame_it_journals():
    """Issue 26, item 4: the journal (what ddp-attach and ddp-logs replay) holds no secret value,
    in a rank's line, a failure's exception or a reason; frames without one pass unchanged."""
    import io
    import threading

    from orchestrator.node.protocol import wire
    from orchestrator.node.watch.relay import Writer

    class Journal:
        lock = threading.Lock()
        frames: list = []

        def append(self, data):
            self.frames.append(data)

    writer = Writer(io.BytesIO())
    writer.journal, writer.secrets = Journal(), ("tok-long-secret", "tok-long")
    writer.send(wire.Output("out", 0, b"key=tok-long-secret and tok-long\n"))
    writer.send(wire.Exited(code=1, signal=None, stopped=False, reason="tok-long",
                            failures=[{"rank": 0, "at": 1.0, "exception": "E: tok-long-secret", "trace": ["tok-long"],
                                       "error_file": None}]))
    writer.send(wire.Started())
    decoder = wire.Decoder(wire.TO_CONTROLLER)
    frames = [f for data in writer.journal.frames for f in decoder.feed(data)]
    assert frames[0].data == b"key=*** and ***\n"  # longest first: no half-masked secret
    assert frames[1].reason == "***" and frames[1].failures[0]["exception"] == "E: ***"
    assert frames[1].failures[0]["trace"] == ["***"] and frames[2] == wire.Started()
    assert not any(b"tok-long" in data for data in writer.journal.frames)


@pytest.mark.parametrize("before", [None, "/tmp/before-setup"])
def test_a_setup_that_sets_tmpdir_moves_the_jobs_tmpdir_not_ddp_ups_state(before, tmp_path):
    """Issue 26, item 9: `setup: export TMPDIR=...` put the agent's state where ddp-ls, ddp-kill
    and ddp-attach (which run no setup) never look: the job was hidden from them. The agent keeps
    the TMPDIR from before setup; the job gets setup's."""
    import subprocess
    import sys

    from orchestrator.remote.transport import setup_script
    script = tmp_path / "probe.py"
    script.write_text(f"import json, os, sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from orchestrator.node.local.procs import job_env\n"
                      "print(json.dumps([os.environ.get('TMPDIR'), job_env({}).get('TMPDIR'),\n"
                      "                  any(k.startswith('DDP_UP_') for k in job_env({}))]))\n")
    probe = f"{sys.executable} {script}"
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    if before is not None:
        env["TMPDIR"] = before
    for setup, jobs in ((("export TMPDIR=/scratch/job",), "/scratch/job"), (("unset TMPDIR",), None),
                        (("true",), before)):
        done = subprocess.run(["bash", "-c", setup_script(setup, None, "exec " + probe)], env=env,
                              capture_output=True, text=True)
        assert json.loads(done.stdout) == [before, jobs, False], (setup, done.stdout, done.stderr)


def test_ddp_ls_into_a_file_keeps_each_attempt_on_a_line_of_its_own(capsys):
    """A job that restarted: its attempts' lines stay apart (the line breaks between them are ddp-up's;
    what is in each, the job's, is made safe), where "restart 1 of 6attempt 1" ran them together."""
    from orchestrator.commands.attach import JobRow, ls_table
    from orchestrator.commands.common import table_console

    attempts = ("attempt 0: node 1 failed (exit code 1) -> restart 1 of 6", "attempt 1: \x1b[31mdone")
    table_console().print(ls_table([JobRow(job="j", script="train.py", state="done", ranks=2, started=None, ended=None,
                                           exit_status=0, root_cause=None, nodes={}, attempt=1, attempts=attempts)],
                                   now=0.0))
    out = capsys.readouterr().out
    ends = [line.rstrip(" │").rsplit("│", 1)[-1].strip() for line in out.splitlines() if "attempt " in line]
    assert "attempt 0: node 1 failed (exit code 1) -> restart 1 of 6" in ends and "\x1b" not in out, out
    assert any(end.startswith("attempt 1:") and end.endswith("done") for end in ends), out
