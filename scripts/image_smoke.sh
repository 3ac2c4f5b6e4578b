#!/usr/bin/env bash
# The CPU image, built and answering, on a machine without a Docker engine: builds omni-engine:cpu
# (docker/build.sh, buildah), starts the image's own default command (`omni-engine serve` of the
# speech pipeline) inside it with buildah (chroot isolation, host network), checks /health,
# /v1/models, a chat answer ("Paris") and a /v1/audio/speech WAV, then stops it and checks that no
# process runs in the container's root and no mount of it is left. Prints the image's size and the
# answers. Not part of CI's run: the first build takes many minutes.
#
#   bash scripts/image_smoke.sh [--no-build] [--tag omni-engine:cpu] [--port 18000] [--timeout 600]
#
# Needs buildah (apt-get install buildah; debootstrap too where no registry is reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=omni-engine:cpu port=18000 timeout=600 build=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --no-build) build=0 ;;
        --tag) tag=$2; shift ;;
        --port) port=$2; shift ;;
        --timeout) timeout=$2; shift ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "image_smoke: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift
done
STORAGE=${BUILDAH_STORAGE_DRIVER:-vfs}
buildah_() { buildah --storage-driver "$STORAGE" "$@"; }
say() { echo "[image_smoke $(date +%H:%M:%S)] $*" >&2; }

if [[ $build == 1 ]]; then
    t0=$SECONDS
    bash docker/build.sh cpu --engine buildah --tag "$tag"
    say "built $tag in $((SECONDS - t0)) s"
fi
size=$(buildah_ images --format '{{.Size}}' "$tag" 2>/dev/null | head -1 || true)
[[ -n $size ]] || { echo "image_smoke: no image $tag (build it, or drop --no-build)" >&2; exit 1; }
# From one inspection: the image's bytes (its layers' sizes), its user, and its default command, as
# `docker run` would start it, on a port of our choosing (argparse keeps the last --port).
{ read -r bytes; read -r user; mapfile -t cmd; } < <(buildah_ inspect --type image "$tag" | python3 -c '
import json, sys
d = json.load(sys.stdin)
config = d["OCIv1"]["config"]
print(sum(layer.get("size", 0) for layer in json.loads(d["Manifest"] or "{}").get("layers", [])))
print(config.get("User", ""))
print("\n".join(config.get("Cmd") or []))')
[[ ${#cmd[@]} -gt 0 && -n ${cmd[0]} ]] || { echo "image_smoke: $tag has no default command" >&2; exit 1; }
say "image $tag: $size; user ${user:-root}; default command: ${cmd[*]}"

ctr=$(buildah_ from --name "omni-engine-smoke-$$" "$tag")
root=$(buildah_ mount "$ctr")
root_id=$(stat -c %d:%i "$root")
# The processes whose root directory is the container's (buildah run binds the root elsewhere, so
# the path differs; device and inode do not), buildah's own chroot helper (run from a memfd) left out.
container_pids() {
    local p
    for p in /proc/[0-9]*; do
        if [[ $(stat -L -c %d:%i "$p/root" 2>/dev/null) == "$root_id" && $(cat "$p/comm" 2>/dev/null) != *buildah* ]]; then
            echo "${p#/proc/}"
        fi
    done
}
log=$(mktemp "${TMPDIR:-/tmp}/omni-image-smoke.XXXXXX.log")
server=
cleanup() {
    local rc=$?
    trap - EXIT
    if [[ -n $server ]]; then
        # As `docker stop` does: SIGTERM to the container's first process (the server, whose parent
        # is buildah's chroot helper), then a grace period for it to end its stages.
        local main p
        main=$(for p in $(container_pids); do
                   [[ $(cat "/proc/$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null)/comm" 2>/dev/null) == *buildah* ]] && echo "$p"
               done | head -1 || true)
        if [[ -n $main ]]; then
            kill -TERM "$main" 2>/dev/null || true
            for _ in $(seq 120); do [[ -z $(container_pids) ]] && break; sleep 0.5; done
            [[ -z $(container_pids) ]] && say "the server ended its stages and exited on SIGTERM"
        fi
        kill -TERM -- "-$server" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$server" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    # Nothing may still run inside the container's root.
    mapfile -t left < <(container_pids)
    if [[ ${#left[@]} -gt 0 ]]; then
        echo "image_smoke: processes still in the container after stopping it: ${left[*]}" >&2
        kill -KILL "${left[@]}" 2>/dev/null || true
        rc=1
    fi
    buildah_ umount "$ctr" >/dev/null 2>&1 || true
    buildah_ rm "$ctr" >/dev/null 2>&1 || true
    if grep -q " $root" /proc/mounts; then
        echo "image_smoke: mounts of the container left: $(grep -c " $root" /proc/mounts)" >&2
        rc=1
    fi
    [[ $rc == 0 ]] || { echo "image_smoke: FAILED (server log: $log)" >&2; tail -30 "$log" >&2; }
    exit "$rc"
}
trap cleanup EXIT

say "starting it: buildah run --isolation chroot --network host $ctr -- ${cmd[*]} --port $port"
# setsid runs a program, not the buildah_ function: the same command spelt out.
setsid buildah --storage-driver "$STORAGE" run --isolation chroot --network host "$ctr" -- "${cmd[@]}" --port "$port" >"$log" 2>&1 &
server=$!

python3 - "$port" "$timeout" "$server" <<'EOF'
"""The four answers a user of the image expects; exits non-zero naming the first that is wrong."""
import io, json, os, sys, time, urllib.error, urllib.request, wave

port, timeout, server = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
base = f"http://127.0.0.1:{port}"


def call(path, body=None, timeout=120):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


t0 = time.monotonic()
while True:
    try:
        status, _ = call("/health", timeout=5)
        if status == 200:
            break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        sys.exit("image_smoke: the server in the container exited before /health answered")
    if time.monotonic() - t0 > timeout:
        sys.exit(f"image_smoke: /health did not answer 200 within {timeout:.0f} s")
    time.sleep(1)
print(f"/health: 200 after {time.monotonic() - t0:.0f} s")
models = json.loads(call("/v1/models")[1])["data"]
name = models[0]["id"]
print(f"/v1/models: {[m['id'] for m in models]}")
answer = json.loads(call("/v1/chat/completions", {
    "model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32, "temperature": 0.0})[1])["choices"][0]["message"]["content"]
print(f"chat: {answer!r}")
if "Paris" not in answer:
    sys.exit(f"image_smoke: the chat answer does not say Paris: {answer!r}")
status, audio = call("/v1/audio/speech", {"model": name, "input": "The capital of France is Paris.",
                                          "voice": "alloy", "response_format": "wav"})
with wave.open(io.BytesIO(audio)) as w:
    # a streamed WAV's header cannot know its length: count the samples that came
    pcm = w.readframes(1 << 30)
    seconds = len(pcm) / (w.getsampwidth() * w.getnchannels() * w.getframerate())
    print(f"/v1/audio/speech: {len(audio)} bytes of WAV, {w.getframerate()} Hz, {w.getnchannels()} channel(s), "
          f"{seconds:.2f} s")
if seconds < 0.5:
    sys.exit(f"image_smoke: the speech is {seconds:.2f} s long")
EOF
# The server and its stage processes run as the image's user, not root.
uids=$(for p in $(container_pids); do awk '/^Uid:/ {print $2}' "/proc/$p/status" 2>/dev/null || true; done |
       sort -u | tr '\n' ' ')
say "$(container_pids | wc -l) processes in the container"
say "processes in the container run as uid(s): $uids"
[[ -n $uids && " $uids " != *" 0 "* ]] || { echo "image_smoke: a process in the container runs as root (uids: $uids)" >&2; exit 1; }
say "all answers right; stopping the server"
echo "image: $tag, $size ($bytes bytes in its layers)"
