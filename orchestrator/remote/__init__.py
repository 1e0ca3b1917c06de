"""Stage 3, the nodes reached: transports, the agent's channel, and the one-shot calls.

transport/transports/openssh/paramiko_ssh/srun: how a node is reached (sshmaster, sshproblems:
OpenSSH's shared connections and the one wording of its failures); protocol ships the node
package; channel is one agent's frames; parallel and signals: a call on every node at once that a
signal can interrupt. The one-shot calls: detect (`gpus: auto`), cleanup (ddp-kill, the sweep),
sync (the workdir copy), fetch (files back).

May import: plan, config, node, and the leaf modules.
"""
