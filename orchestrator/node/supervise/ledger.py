"""What a detached job's supervisor has decided, written down as it decides it: the attempts file
(each ended attempt, and what follows it), read by an attach that replays the job (replay.py), the
outcome once no attempt follows, and the notices that tell the user. Written by the master node's
agent only; the decisions themselves are the Supervisor's (supervisor.py) by decide.py's rules.
"""

from ..local.state import ATTEMPTS, OUTCOME, write_record
from . import notify


class Ledger:
    """A detached job's record of its attempts, kept in the master node's job folder."""

    def __init__(self, runner):
        self.runner, self.job = runner, runner.spec.job
        self.attempts = []  # the ended attempts (the current one too, once a restart is decided), as outcome.json lists them

    def open(self):
        write_record(self.runner.dir, {"attempts": []}, ATTEMPTS)  # an attach knows the master node by it

    def decided(self, summary, **what_follows):
        """An attempt follows ``summary``'s: the decision is written now, for an attach (replay.decided)."""
        self.attempts.append(dict(summary, **what_follows))
        write_record(self.runner.dir, {"attempts": list(self.attempts)}, ATTEMPTS)

    def restarted(self, attempt, nodes_words):
        """Attempt ``attempt`` begins: the user is told why the one before ended."""
        root = notify.root_text(self.attempts[-1]["root_cause"])
        self.runner.notices.send("restart", "job %s: attempt %d ended (%s); attempt %d starts%s" % (
            self.job, attempt - 1, root or "no root cause", attempt, nodes_words), attempt=attempt, root_cause=root)

    def over(self, summary, reason):
        """No attempt follows ``summary``'s: the outcome, with every attempt before it (a restart
        decided on for that attempt is replaced: the job was stopped while it waited)."""
        last = dict(summary, next=reason)
        earlier = [a for a in self.attempts if a["attempt"] != summary["attempt"]]
        write_record(self.runner.dir, dict(last, job=self.job, attempts=earlier + [last]), OUTCOME)
        return last
