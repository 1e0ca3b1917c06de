"""The one wording of every SSH failure, whichever client met it: the `openssh` transport reads
ssh's words on stderr, the `fabric` one paramiko's exceptions, and both name the same problem with
the same fix through these functions. ``where`` is ``user@host:port`` as the client resolved it."""

from __future__ import annotations

import shlex

from ..errors import NodeProblem


def command(*words: str) -> str:
    """A command line to paste, each word quoted for the shell: a host name or a path from a
    cluster file, an SSH config or a server runs as nothing but what it says. A leading ``~/``
    stays unquoted, so that the shell still makes it the home directory."""
    return " ".join("~/" + shlex.quote(w[2:]) if w.startswith("~/") and w[2:] else shlex.quote(w) for w in words)


def changed_key(label: str, host: str, lookup_name: str, known_hosts: str) -> NodeProblem:
    """``lookup_name``: the name the key is filed under in ``known_hosts`` (the HostName)."""
    return NodeProblem(label, f"host key for {host} CHANGED (possible impersonation); refusing",
                       f"if the node was reinstalled, remove the old key: "
                       f"{command('ssh-keygen', '-R', lookup_name, '-f', known_hosts)}, then add the new one after checking it")


def unknown_key(label: str, key: str | None, jump_host: str | None, keyscan: tuple[str, ...],
                known_hosts: str) -> NodeProblem:
    """``key``: "TYPE SHA256:..." when known; ``jump_host``: set when the key was a jump host's;
    ``keyscan``: ssh-keyscan's arguments for the host that presented it."""
    of = f" of jump host {jump_host}" if jump_host else ""
    shown = f" ({key})" if key else ""
    return NodeProblem(label, f"unknown host key{of}{shown}; refusing to connect",
                       f"verify the fingerprint with the node's admin, then add it: {command('ssh-keyscan', *keyscan)} >> "
                       f"{command(known_hosts)} (or set `StrictHostKeyChecking accept-new` for it in your SSH config)")


def auth_failed(label: str, where: str) -> NodeProblem:
    return NodeProblem(label, f"SSH authentication failed for {where} (key-only, no password prompts)",
                       "check `user:`/`identity_file:` or your SSH config, ssh-agent, and the node's authorized_keys")


def unresolvable(label: str, host: str) -> NodeProblem:
    return NodeProblem(label, f"cannot resolve host name {host!r}",
                       "fix `host:` or add it to DNS, /etc/hosts or your SSH config")


def refused(label: str, where: str) -> NodeProblem:
    return NodeProblem(label, f"connection refused by {where}", "start sshd on the node or fix the port")


def unreachable(label: str, where: str, why: str) -> NodeProblem:
    return NodeProblem(label, f"cannot reach {where}: {why}", "check the address and routing (is the node up?)")


def no_answer(label: str, where: str, timeout: float) -> NodeProblem:
    return NodeProblem(label, f"no answer from {where} within {timeout:g} s",
                       "check the address, the network path and that sshd runs; or raise ssh.connect_timeout")
