"""Stage 0, the code that runs on the nodes: the node agent, as a stdlib-only package (Python 3.8+).
It imports nothing of the controller's; every stage of the controller may import it (wire, the
protocol's vocabulary, and policy, the decisions both ends make).

The controller ships these modules to every node over the agent's stdin, as source and as
bytecode (see remote/protocol.py); the bootstrap builds this package there under the name
``ddp_up_node`` from the names it is given, so the modules' relative imports work the same on
the controller (``orchestrator.node.*``) and on a node. SHIPPED is the one list of what is
shipped, in the order the bootstrap runs them: each module comes after every module it imports.

  wire        the protocol: every frame, both directions, every mode (shared with the controller)
  facts       what the node's network and GPUs look like (interfaces, routes, nvidia-smi)
  gpuhealth   what nvidia-smi says of the GPUs' health (ECC, remapped rows, clock events, PCIe, NVLink)
  policy      the decisions both ends make (restart limit and delay, hang, root cause, silence)
  stragglers  which node arrives last at the collectives (ddp-up's, and a detached job's supervisor's)
  procs       the job's processes: tags, find, signal, kill
  state       private directories, records, journals
  screen      a worker's stream as a terminal shows it: lines done, and bars still drawn
  relay       the writer that owns stdout, the launcher's pipes and the workers' log files
  teardown    the teardown rule, by each rank's end marker: a death after a clean end, a node finishing
  failures    what the job's failed ranks left here (error files, tracebacks) and when
  forksafe    warm start, before the fork: what keeps a forked rank a cold one (part of zygote's text)
  warmchild   warm start, in the child: the rank made what `python -u SCRIPT` would be (part of zygote's text)
  zygote      warm start: the warm interpreter's own code, run as `python -c` (and torchrun's stand-in)
  warm        warm start: an interpreter that imported torch, the ranks forked from it
  workers     `launcher: none`: the agent starts the workers itself (in a container, their own launcher does)
  container   `container:`: the launcher in an image, its container's whole life kept by the agent
  checks      the preflight's probes: torch, GPUs, the master port held until Go
  keptbox     a warm container kept across launches (docker, podman): held by its keeper, asked by each attempt
  stacks      every rank's stack on request
  flight      every rank's collectives, as torch's Flight Recorder keeps them
  events      the agent's own events, named once
  results     a function's launch from Python: each rank's return value, read back bounded
  launch      one attempt's processes here: started, relayed, signalled, ended
  run         run mode, attached (controller watching): preflight, Go, the job's loop and end
  keep        keep mode: a warm interpreter kept ready for every launch of one Python session
  decide      a detached job's decisions, pure
  notify      an event as JSON, to a webhook or a command (a detached job's, and ddp-up's own)
  supervisor  a detached job's supervisor and every other node's link to it
  detached    run mode, detached: the job on its own, its record and journal, restarts
  report      torchrun's failure report: the ranks it names, with their exit codes
  inventory   the state root as a whole: the jobs recorded here, and what is stale
  replay      follow and list modes: a detached job's journal and records
  oneshot     detect and sweep modes
  sync        sync mode: the workdir copy
  fetch       fetch mode: files back from the node (ddp-fetch)
  main        the table from spec frame to mode

IN_IMAGE are node modules no agent runs: a container's first process runs them in the image, sent
with the job (RunSpec.box_code, container.BOX_MAIN), with the shipped modules they import.

  boxwarm     warm start in a container: the warm interpreter started in the image, torchrun forked from it
  boxkeep     a warm container kept across launches: its first process, which forks each attempt's launcher
"""

SHIPPED = ("wire", "facts", "gpuhealth", "policy", "stragglers", "procs", "report", "state", "teardown", "inventory", "flight", "screen", "relay", "failures", "forksafe", "warmchild", "zygote", "warm", "workers", "container", "checks", "keptbox", "stacks", "events", "results", "launch", "run",
           "keep", "decide", "notify", "supervisor", "detached", "replay", "oneshot", "sync", "fetch", "main")
IN_IMAGE = ("boxwarm", "boxkeep")
PACKAGE = "ddp_up_node"  # the package's name on a node
