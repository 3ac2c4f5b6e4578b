#!/usr/bin/env bash
# Builds omni_engine's container images: Docker where a Docker engine runs, else buildah (rootless
# container tools with chroot isolation, which build where no container daemon can run).
#
#   bash docker/build.sh [cpu|cuda] [--tag NAME] [--base IMAGE|local|public] [--engine docker|buildah]
#
#   cpu (default)  docker/Dockerfile.cpu  -> omni-engine:cpu
#   cuda           docker/Dockerfile.cuda -> omni-engine:cuda
#   --base         the image to build on (Dockerfile.cpu's BASE_IMAGE, Dockerfile.cuda's VLLM_IMAGE);
#                  "public" (python:3.11-slim, vllm/vllm-openai:v0.32.0), or "local": a Debian
#                  bookworm root made here with debootstrap and imported as
#                  localhost/omni-engine-base:bookworm (python3 and its venv module); for the CUDA
#                  image, that plus pip and vLLM 0.32.0 from the package index (CUDA's libraries
#                  come with its torch wheels), standing in for vllm/vllm-openai.
#                  Default: public where Docker Hub answers, else local.
#   --engine       default: docker if `docker info` works, else buildah.
#
# With buildah the build gets this machine's pip configuration (its indexes, find-links and CA
# bundle, mounted read-only into the build) instead of the Dockerfile's public defaults, and the
# host network; nothing of it reaches the final image (only the steps that install read it). The CUDA
# image gets no find-links: a local torch there is this machine's CPU build.
# Environment: BUILDAH_STORAGE_DRIVER (default vfs: no overlay mounts needed), OMNI_BASE_ROOTFS (where
# debootstrap builds the local base, default /var/tmp/omni-engine-base-rootfs).
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=cpu tag= base= engine=
while [[ $# -gt 0 ]]; do
    case $1 in
        cpu|cuda) flavour=$1 ;;
        --tag) tag=$2; shift ;;
        --base) base=$2; shift ;;
        --engine) engine=$2; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "docker/build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
tag=${tag:-omni-engine:$flavour}
dockerfile=docker/Dockerfile.$flavour
case $flavour in
    cpu) base_arg=BASE_IMAGE public_base=python:3.11-slim ;;
    cuda) base_arg=VLLM_IMAGE public_base=vllm/vllm-openai:v0.32.0 ;;
esac
LOCAL_BASE=localhost/omni-engine-base:bookworm
VLLM_VERSION=0.32.0   # the release the CUDA image is built on (Dockerfile.cuda's default base tag)
LOCAL_VLLM_BASE=localhost/omni-engine-base:bookworm-vllm-$VLLM_VERSION
STORAGE=${BUILDAH_STORAGE_DRIVER:-vfs}
buildah_() { buildah --storage-driver "$STORAGE" "$@"; }

if [[ -z $engine ]]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker; else engine=buildah; fi
fi
command -v "$engine" >/dev/null || { echo "docker/build.sh: $engine is not installed" >&2; exit 1; }

if [[ -z $base ]]; then
    # Docker Hub's registry answers 401 to an anonymous /v2/ when it is reachable.
    code=$(curl -s -o /dev/null -m 10 -w '%{http_code}' https://registry-1.docker.io/v2/ || true)
    if [[ $code == 401 || $code == 200 ]]; then base=public; else base=local; fi
    echo "docker/build.sh: base image: $base (Docker Hub answered '${code:-nothing}')" >&2
fi

make_local_base() {
    # A Debian root with python3 and venv, imported once; rebuilt only when missing.
    if buildah_ inspect --type image "$LOCAL_BASE" >/dev/null 2>&1; then return; fi
    command -v debootstrap >/dev/null || { echo "docker/build.sh: --base local needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
    local rootfs=${OMNI_BASE_ROOTFS:-/var/tmp/omni-engine-base-rootfs}
    if [[ ! -x $rootfs/usr/bin/python3 ]]; then
        rm -rf "$rootfs"
        echo "docker/build.sh: debootstrap bookworm -> $rootfs" >&2
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
            http://deb.debian.org/debian >&2
    fi
    # apt's and debootstrap's caches are not part of the base
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/debootstrap
    local ctr tarball
    tarball=$(mktemp "${TMPDIR:-/tmp}/omni-engine-base.XXXXXX.tar")
    tar -C "$rootfs" -cf "$tarball" .
    ctr=$(buildah_ from scratch)
    # a local tar archive is unpacked into the image
    if ! { buildah_ add "$ctr" "$tarball" / && buildah_ config --cmd /bin/bash --env LANG=C.UTF-8 "$ctr" &&
           buildah_ commit --rm "$ctr" "$LOCAL_BASE" >&2; }; then
        buildah_ rm "$ctr" >/dev/null 2>&1 || true
        rm -f "$tarball"
        echo "docker/build.sh: could not make $LOCAL_BASE" >&2
        exit 1
    fi
    rm -f "$tarball"
}

make_local_vllm_base() {
    # Dockerfile.cuda's base brings CUDA's libraries, torch and vLLM (vllm/vllm-openai); the local
    # stand-in is the local base plus Debian's pip and the same vLLM release from the package index,
    # whose CUDA torch wheels carry CUDA's libraries (the GPU driver comes from the host at run time).
    if buildah_ inspect --type image "$LOCAL_VLLM_BASE" >/dev/null 2>&1; then return; fi
    local ctr
    ctr=$(buildah_ from "$LOCAL_BASE")
    if ! { buildah_ run --isolation chroot --network host "${mounts[@]}" "$ctr" -- sh -c "
               apt-get update && apt-get install -y --no-install-recommends python3-pip &&
               apt-get clean && rm -rf /var/lib/apt/lists/* &&
               printf '%b\\n' '$conf' > /tmp/pip.conf &&
               PIP_CONFIG_FILE=/tmp/pip.conf PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install 'vllm==$VLLM_VERSION' &&
               rm -rf /tmp/pip.conf /root/.cache" >&2 &&
           buildah_ config --entrypoint '["vllm", "serve"]' --cmd '[]' "$ctr" &&
           buildah_ commit --rm "$ctr" "$LOCAL_VLLM_BASE" >&2; }; then
        buildah_ rm "$ctr" >/dev/null 2>&1 || true
        echo "docker/build.sh: could not make $LOCAL_VLLM_BASE" >&2
        exit 1
    fi
}

# buildah: this machine's pip configuration for the builder stage, and its local paths mounted.
# pip_for_build prints "conf <option line>" and "mount <host path> <path in the build>" lines.
pip_for_build() {
    python3 -m pip config list 2>/dev/null | FLAVOUR=$flavour python3 -c '
import os, shlex, sys
seen = {}
wanted = ("index-url", "extra-index-url", "cert") + (("find-links",) if os.environ["FLAVOUR"] == "cpu" else ())
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in wanted and name not in seen:
        seen[name] = shlex.split(value)[0] if value else ""
for name, value in seen.items():
    if name == "cert":
        # the bundle itself, not /etc/ssl/certs (mounting that breaks the ca-certificates package)
        print(f"conf cert = /host-ca.crt\nmount {value} /host-ca.crt")
        continue
    print(f"conf {name} = {value}")
    for item in value.split():
        path = item.removeprefix("file://").rstrip("/")
        if name != "find-links" and path.endswith("/simple"):
            path = path.rsplit("/", 1)[0]  # a PEP 503 index links to files beside it (../../files)
        if path.startswith("/"):
            print(f"mount {path} {path}")
'
}
mounts=() conf="[global]\nno-cache-dir = true\ndisable-pip-version-check = true"
while read -r kind rest; do
    case $kind in
        conf) conf+="\n$rest" ;;
        mount) read -r host inside <<<"$rest"; [[ -e $host ]] && mounts+=(-v "$host:$inside:ro") ;;
    esac
done < <(pip_for_build)

case $base in
    public) base_image=$public_base ;;
    local)
        [[ $engine == buildah ]] || { echo "docker/build.sh: --base local is made with buildah (--engine buildah)" >&2; exit 2; }
        make_local_base
        base_image=$LOCAL_BASE
        if [[ $flavour == cuda ]]; then make_local_vllm_base; base_image=$LOCAL_VLLM_BASE; fi ;;
    *) base_image=$base ;;
esac

if [[ $engine == docker ]]; then
    set -x
    exec docker build -f "$dockerfile" --build-arg "$base_arg=$base_image" -t "$tag" .
fi
set -x
# No --layers: with the vfs driver every cached layer is a full copy of the root (3 GB each here).
# Docker's format keeps the HEALTHCHECK (OCI's has none).
buildah_ bud --isolation chroot --network host --format docker -f "$dockerfile" \
    --build-arg "$base_arg=$base_image" --build-arg "PIP_CONF=$conf" "${mounts[@]}" -t "$tag" .
{ set +x; } 2>/dev/null
echo "built $tag on $base_image: $(buildah_ images --format '{{.Size}}' "$tag" | head -1)" >&2
