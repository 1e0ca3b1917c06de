"""Stage 1, the configuration: the cluster file (YAML) read, checked and frozen.

clusterfile reads it (reading keeps every key's line for messages), validate turns it into
cluster's frozen values, with containers, notify and hostlists for their keys and values for
durations, environment values and .env files; keyhints says where
a misplaced key belongs; schema writes the same rules as JSON Schema; masking hides the secrets
it names, everywhere ddp-up shows or keeps text.

May import: node, and the leaf modules (errors, ownfiles, clean).
"""
