#!/usr/bin/env bash
# Build the image (and its Debian base) and run a syncer container and a learner container
# against each other on this machine: the learner trains 300 steps of the tiny recipe, the
# syncer's status must show committed rounds, and the syncer must stop cleanly (exit 0).
#
#   sudo deploy/container/try-local.sh [IMAGE]      # default IMAGE: localhost/diloco:0.1.0-cpu
#
# Extra `podman build` arguments come from BUILD_ARGS (e.g. -v /opt/wheels:/wheels for offline
# torch wheels, a proxy's CA: -v CA:/ca.crt --build-arg PIP_CERT=/ca.crt). Where the kernel or
# a sandbox refuses what podman asks by default (cgroup controllers, setrlimit), point
# CONTAINERS_CONF at a file with `default_ulimits = []` and `cgroup_manager = "cgroupfs"`, and
# set RUNTIME=runc (docs/deploy.md says what was needed here).
set -euo pipefail
image=${1:-localhost/diloco:0.1.0-cpu}
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/diloco-try.XXXXXX)
port=${PORT:-47123}
runtime=(${RUNTIME:+--runtime "$RUNTIME"})
cleanup() { podman rm -f diloco-try-syncer >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

podman image exists localhost/diloco-base:bookworm || "$root/deploy/container/build-base.sh"
# shellcheck disable=SC2086  # BUILD_ARGS is a list of arguments
podman build --isolation=chroot ${BUILD_ARGS:-} -f "$root/deploy/container/Containerfile" \
    -t "$image" "$root"
mkdir -p "$work/state" && head -c 32 /dev/urandom | base64 > "$work/token"
run=(podman run "${runtime[@]}" --network host -v "$work/token:/secret/token:ro")
"${run[@]}" -d --name diloco-try-syncer -v "$work/state:/state" "$image" syncer \
    --bind "127.0.0.1:$port" --state-dir /state --token-file /secret/token --recipe tiny
for _ in $(seq 120); do  # bounded: the syncer serves within a minute
    podman logs diloco-try-syncer 2>&1 | grep -q "serving on" && break
    sleep 0.5
done
"${run[@]}" --rm "$image" learner --syncer "127.0.0.1:$port" --token-file /secret/token \
    --id container-a --recipe tiny --total-steps 300 --threads 1
status=$("${run[@]}" --rm "$image" status "127.0.0.1:$port" --token-file /secret/token)
echo "$status"
echo "$status" | grep -Eq "serving, up .*: [1-9][0-9]* rounds" || { echo "no committed round" >&2; exit 1; }
podman stop -t 20 diloco-try-syncer >/dev/null
code=$(podman inspect diloco-try-syncer --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || { echo "the syncer exited $code" >&2; exit 1; }
echo "ok: a syncer and a learner container trained together; the syncer stopped cleanly"
