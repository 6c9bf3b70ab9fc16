#!/bin/sh
# podman_runc.sh: runc for machines that withhold CAP_SYS_RESOURCE and a cgroup mount in containers
# (some VMs): it drops the bundle's process.rlimits and its cgroup mount, then runs runc. Give it
# to podman as its OCI runtime: `podman --runtime "$PWD/scripts/podman_runc.sh" ...`, or in a
# run's config `env.sandbox.podman: [podman, --runtime, /abs/path/scripts/podman_runc.sh]`.
# A machine whose podman runs `podman run --rm debian true` as is does not need it.
bundle=
prev=
for arg in "$@"; do
  case "$prev" in --bundle | -b) bundle=$arg ;; esac
  prev=$arg
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  python3 -c '
import json, sys
path = sys.argv[1]
with open(path) as f:
    config = json.load(f)
config.get("process", {}).pop("rlimits", None)
config["mounts"] = [m for m in config.get("mounts", []) if m.get("type") != "cgroup"]
with open(path, "w") as f:
    json.dump(config, f)
' "$bundle/config.json"
fi
exec runc "$@"
