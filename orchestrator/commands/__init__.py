"""Stage 8, the commands: up (ddp-up), check (ddp-check), kill (ddp-kill), attach (ddp-attach,
ddp-logs, ddp-ls), fetch (ddp-fetch); common holds what they share, entry the console entry
points, reference the manual's generated pages. The only layer that maps exceptions to exit
statuses (0 ok, 1 job failed, 2 usage or config, 3 a node could not be set up, 70 internal
error, 128+N a signal): the code below reports problems as values or as errors that render
themselves.

May import every stage below it: run, views, job, diagnose, remote, plan, config, node, and the
leaf modules. Only the package's face (api) imports it.
"""
