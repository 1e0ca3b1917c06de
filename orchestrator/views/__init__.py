"""Stage 6, the views of a job: they read events and statuses and own the terminal; they never
touch SSH. terminal is stdout, guarded; console prints the lines, dashboard draws the live table, fanout hands every event to
every view, logfiles writes the run's log files, filters and transfer shape what is shown.

May import: job (its events), diagnose, remote, plan, config, node, and the leaf modules.
"""
