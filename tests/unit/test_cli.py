import pytest

from orchestrator.commands.up import main_up, split_argv


@pytest.mark.parametrize("argv,ours,script_args", [
    (["c.yaml", "t.py", "--dry-run", "x"], ["c.yaml", "t.py"], ["--dry-run", "x"]),
    (["--dry-run", "c.yaml", "t.py", "-v"], ["--dry-run", "c.yaml", "t.py"], ["-v"]),
    (["--job-id", "j1", "c.yaml", "t.py"], ["--job-id", "j1", "c.yaml", "t.py"], []),
    (["c.yaml", "--", "-weird.py", "a"], ["c.yaml", "-weird.py"], ["a"]),
    (["c.yaml", "t.py", "--", "a"], ["c.yaml", "t.py"], ["--", "a"]),
])
def test_everything_after_the_script_is_the_scripts(argv, ours, script_args):
    assert split_argv(argv) == (ours, script_args)


def test_config_error_exits_2_with_one_message(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - host: a\n    gpus: 0\n")
    assert main_up([str(bad), "t.py"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: nodes[0].gpus: must be an integer between 1 and 1024 or `auto`, got 0" in err


def test_dry_run_connects_to_nothing(tmp_path, capsys):
    c = tmp_path / "c.yaml"
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 2}, {host: 192.0.2.2, gpus: 1}]\n")  # TEST-NET: never dialed
    assert main_up(["--dry-run", "--job-id", "J", str(c), "t.py", "a b"]) == 0
    out = capsys.readouterr().out
    assert "# node 1 192.0.2.2 (ssh 192.0.2.2), ranks 2-2" in out
    assert "--node-rank=1 --master-addr=192.0.2.1 '--master-port=<auto: a free port on the master>'" in out
    assert out.rstrip().endswith("t.py 'a b'")
    assert "# at launch, on each node: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME=<the interface its route to " \
           "192.0.2.1 takes>" in out


@pytest.mark.parametrize("keys, said", [
    ("", "# warm start: each rank is forked from an interpreter that imported torch, and runs as the line below "
         "would run it (with warm: false, that line runs as it is)"),
    ("preload: [lightning]\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 1, container: {image: img}}]\n",
     "# warm start: each rank is forked from an interpreter that imported torch, lightning, and runs as"),
    ("launcher: none\npreload: [lightning]\nnodes: [{host: a, gpus: 1}, {host: b, gpus: 1, container: {image: img}}]\n",
     "# warm start: each rank is forked from an interpreter that imported torch, lightning, and runs as"),
    ("warm: false\n", None), ("launcher: none\n", None)])
def test_dry_run_says_whether_the_ranks_start_warm(tmp_path, capsys, keys, said):
    c = tmp_path / "c.yaml"
    c.write_text(keys if "nodes:" in keys else "nodes: [{host: 192.0.2.1, gpus: 2}]\n" + keys)
    assert main_up(["--dry-run", "--job-id", "J", str(c), "t.py"]) == 0
    out = capsys.readouterr().out
    assert (said in out) if said else ("warm start" not in out), out


def test_the_controller_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, orchestrator.commands.up, orchestrator.commands.attach, orchestrator.views.dashboard; " \
           "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_sync_flags_pick_the_files_directory_this_directory_or_none(tmp_path, capsys, monkeypatch):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text("")
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "a.py").write_text("")
    (tmp_path / "here" / "b.py").write_text("")
    c = tmp_path / "c.yaml"
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 1}]\nworkdir: ~/proj\nsync: proj\n")  # relative to the file
    monkeypatch.chdir(tmp_path / "here")
    for flags, line in ((["--dry-run"], f"# sync {tmp_path / 'proj'} -> each node's workdir: 1 files"),
                        (["--dry-run", "--sync"], f"# sync {tmp_path / 'proj'} -> each node's workdir: 1 files"),
                        (["--dry-run", "--no-sync"], None)):
        assert main_up([*flags, str(c), "t.py"]) == 0
        out = capsys.readouterr().out
        assert (line in out) if line else ("# sync" not in out), out
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 1}]\nworkdir: ~/proj\n")
    assert main_up(["--dry-run", "--sync", str(c), "t.py"]) == 0
    assert f"# sync {tmp_path / 'here'} -> each node's workdir: 2 files" in capsys.readouterr().out


def test_sync_without_a_workdir_is_refused_before_connecting(tmp_path, capsys):
    c = tmp_path / "c.yaml"
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 1}]\nsync: .\n")
    assert main_up([str(c), "t.py"]) == 2
    assert f"{c}:1: nodes[0]: sync copies into each node's `workdir:`" in capsys.readouterr().err


@pytest.mark.parametrize("module, main", [("up", "main_up"), ("check", "main_check"), ("kill", "main_kill")])
def test_help_renders(module, main, capsys):
    import importlib

    with pytest.raises(SystemExit) as done:
        getattr(importlib.import_module(f"orchestrator.commands.{module}"), main)(["--help"])
    assert done.value.code == 0 and "--slurm" in capsys.readouterr().out


def test_detach_takes_restarts_and_min_nodes_but_refuses_spares_before_connecting(tmp_path, capsys):
    nodes = "nodes: [{host: 192.0.2.1, gpus: 1}, {host: 192.0.2.2, gpus: 1}, {host: 192.0.2.3, gpus: 1}]\n"  # never dialed
    c = tmp_path / "c.yaml"
    for top in ("", "min_nodes: 2\n", "min_nodes: 2\nevict_after: 5m\n"):
        c.write_text("restarts: 2\n" + top + nodes)
        assert main_up(["--detach", "--dry-run", "--job-id", "J", str(c), "t.py"]) == 0
    c.write_text("restarts: 2\nspares: 1\n" + nodes)
    assert main_up(["--detach", "--job-id", "J", str(c), "t.py"]) == 2
    assert "--detach: spares need ddp-up to stay" in capsys.readouterr().err


@pytest.mark.parametrize("argv,ours,script_args", [
    (["c.yaml", "-m", "pkg.train", "--lr", "1"], ["c.yaml", "--", "-m"], ["pkg.train", "--lr", "1"]),
    (["--dry-run", "c.yaml", "-m", "pkg.train"], ["--dry-run", "c.yaml", "--", "-m"], ["pkg.train"]),
    (["-H", "a:1", "-m", "pkg.train"], ["-H", "a:1", "--", "-m"], ["pkg.train"]),
    (["c.yaml", "t.py", "-m", "x"], ["c.yaml", "t.py"], ["-m", "x"]),  # after the script: the script's
])
def test_a_module_is_the_script_as_python_dash_m_takes_it(argv, ours, script_args):
    assert split_argv(argv) == (ours, script_args)


def test_a_module_runs_under_torchrun_as_torchrun_dash_m(tmp_path, capsys):
    c = tmp_path / "c.yaml"
    c.write_text("nodes: [{host: 192.0.2.1, gpus: 2}]\n")  # TEST-NET: never dialed
    assert main_up(["--dry-run", "--job-id", "J", str(c), "-m", "pkg.train", "--lr", "1"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--redirects=3 -m pkg.train --lr 1")
    assert main_up([str(c), "-m"]) == 2
    assert "-m needs a module: ddp-up [options] CLUSTER.yaml -m PACKAGE.MODULE" in capsys.readouterr().err


def test_every_command_says_its_version(capsys):
    import pytest

    from orchestrator import __version__
    from orchestrator.commands.attach import main_attach, main_logs, main_ls
    from orchestrator.commands.check import main_check
    from orchestrator.commands.fetch import main_fetch
    from orchestrator.commands.kill import main_kill
    from orchestrator.commands.up import main_up

    for prog, main in (("ddp-up", main_up), ("ddp-kill", main_kill), ("ddp-check", main_check), ("ddp-ls", main_ls),
                       ("ddp-attach", main_attach), ("ddp-logs", main_logs), ("ddp-fetch", main_fetch)):
        with pytest.raises(SystemExit) as ended:
            main(["--version"])
        assert ended.value.code == 0 and capsys.readouterr().out == f"{prog} {__version__}\n"


def test_force_color_colors_a_pipe_but_draws_no_dashboard_there_and_no_color_drops_colors(monkeypatch):
    """FORCE_COLOR and NO_COLOR, as https://no-color.org and https://force-color.org say (Rich reads
    both): colors in a pipe, but lines there, not a redrawn screen; no colors on a terminal."""
    import io

    from rich.console import Console
    from rich.text import Text

    from orchestrator.commands.common import interactive
    from orchestrator.views.terminal import terminal_console

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    piped = terminal_console()  # pytest's captured stdout: not a terminal
    assert piped.is_terminal and piped.color_system is not None and not interactive(piped)
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    Console(file=out, force_terminal=True).print(Text("node-a r0 |", style="cyan"))
    assert "\x1b[36m" not in out.getvalue() and "node-a r0 |" in out.getvalue()


def test_ddp_check_json_is_one_object_a_node_and_nothing_else_on_stdout(tmp_path, capsys):
    import json
    import sys

    from orchestrator.commands.check import main_check

    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"transport: local\npython: {sys.executable}\nworkdir: {tmp_path}\nlauncher: none\n"
                       "nodes: [{host: a, gpus: 1}, {host: b, gpus: 1}]\n")
    assert main_check([str(cluster), "missing.py", "--json"]) == 3
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["node"], r["host"], r["ok"]) for r in records] == [(0, "a", False), (1, "b", False)]
    assert "script missing.py not found" in records[0]["problems"][0]


def test_every_command_writes_its_own_completion_for_bash_and_zsh(capsys):
    import pytest

    from orchestrator.commands.fetch import main_fetch
    from orchestrator.commands.up import main_up

    for main, option in ((main_up, "--dry-run"), (main_fetch, "--node")):
        for shell in ("bash", "zsh"):
            with pytest.raises(SystemExit) as ended:
                main(["--print-completion", shell])
            assert ended.value.code == 0 and option in capsys.readouterr().out


def test_a_notebook_gets_the_dashboard_redrawn_in_place_where_ipywidgets_can_show_it(monkeypatch):
    """Rich draws a live display in Jupyter in an ipywidgets Output: the dashboard there, in the
    notebook's own console (no terminal codes forced into it); plain lines without ipywidgets."""
    import argparse
    import builtins
    import io

    from rich.console import Console

    from orchestrator.commands.common import make_view
    from orchestrator.config.clusterfile import parse_cluster
    from orchestrator.plan.launch import make_plan
    from orchestrator.views.console import ConsoleView
    from orchestrator.views.dashboard import DashboardView

    plan = make_plan(parse_cluster("transport: local\nnodes: [{host: a, gpus: 1}]\n"), "t.py", [], "J", "/")
    args = argparse.Namespace(ranks=None, dashboard=None, collapse=False)
    notebook = Console(file=io.StringIO(), force_jupyter=True)
    view = make_view(plan, notebook, args)
    assert type(view) is DashboardView and view.console is notebook
    real_import = builtins.__import__

    def without_ipywidgets(name, *more, **kw):
        if name == "ipywidgets":
            raise ImportError(name)
        return real_import(name, *more, **kw)

    monkeypatch.setattr(builtins, "__import__", without_ipywidgets)
    assert type(make_view(plan, notebook, args)) is ConsoleView
