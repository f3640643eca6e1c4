#!/usr/bin/env bash
# Builds the fairserve CPU image with buildah and tags it localhost/fairserve-cpu:<version>
# (the version in pyproject.toml). Run it from anywhere; no flags.
#
#   bash deploy/images/build.sh
#
# Needs root, buildah and debootstrap (Debian: apt-get install -y buildah debootstrap), the
# Debian mirror and the Python package index. No container registry is needed: the base image
# is a Debian bookworm root made by debootstrap and imported as
# localhost/fairserve-base:bookworm-minbase, kept in buildah's storage and reused by later
# builds (FAIRSERVE_REBUILD_BASE=1 makes it anew). Layers are cached (--layers), so a rebuild
# after a source change redoes only the project's install and the prepared model.
#
# Environment (all optional):
#   FAIRSERVE_TORCH_WHEELS   directory holding torch-2.13.0+cpu-cp311-*.whl (default /opt/wheels)
#   FAIRSERVE_CA_BUNDLE      CA bundle for pip inside the build (a TLS-inspecting proxy); default:
#                            $PIP_CERT, else the system bundle when local CAs were added to it.
#                            A build secret: it is never stored in the image.
#   FAIRSERVE_IMAGE          image name (default localhost/fairserve-cpu)
#   DEBIAN_MIRROR            default http://deb.debian.org/debian
#   BUILDAH_STORAGE_DRIVER   default vfs (works everywhere, copies whole layers; overlay is faster
#                            where the kernel allows it)
#
# The CUDA image (Containerfile.cuda) is not built here: see README.md beside this file.
set -euo pipefail

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
root=$(cd -- "$here/../.." && pwd)
cd "$root"

version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
image=${FAIRSERVE_IMAGE:-localhost/fairserve-cpu}:$version
base=localhost/fairserve-base:bookworm-minbase
suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
wheels=${FAIRSERVE_TORCH_WHEELS:-/opt/wheels}
buildah=(buildah --storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

log() { printf '[build.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

check_tools() {
  [[ $(id -u) -eq 0 ]] || die "run as root (debootstrap and buildah's chroot isolation need it)"
  local tool
  for tool in buildah debootstrap python3; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install -y buildah debootstrap)"
  done
  compgen -G "$wheels/torch-2.13.0+cpu-cp311-*.whl" >/dev/null \
    || die "no torch-2.13.0+cpu cp311 wheel in $wheels (set FAIRSERVE_TORCH_WHEELS)"
}

# The base image: debootstrap's minbase of Debian 12 (python3 is 3.11 there), with the
# security and updates suites, imported FROM scratch. Made once; later builds reuse it.
make_base() {
  if [[ ${FAIRSERVE_REBUILD_BASE:-0} != 1 ]] && "${buildah[@]}" inspect --type image "$base" >/dev/null 2>&1; then
    log "base image $base exists; reusing it"
    return
  fi
  local rootfs container mount started
  rootfs=$(mktemp -d /var/tmp/fairserve-base.XXXXXX)
  # shellcheck disable=SC2064  # expand now: the trap must remove this very directory
  trap "rm -rf '$rootfs'" EXIT
  started=$SECONDS
  log "debootstrap --variant=minbase $suite from $mirror ..."
  debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
  rm -f "$rootfs.log"
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian}/debian-security $suite-security main
EOF
  # the container runtime provides /dev; apt's downloaded packages are not needed
  rm -rf "$rootfs"/dev/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  log "base root made in $((SECONDS - started)) s ($(du -sh "$rootfs" | cut -f1)); importing it"
  container=$("${buildah[@]}" from scratch)
  mount=$("${buildah[@]}" mount "$container")
  cp -a "$rootfs/." "$mount/"
  "${buildah[@]}" umount "$container" >/dev/null
  "${buildah[@]}" config --env LANG=C.UTF-8 --cmd /bin/bash \
    --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    --label "org.opencontainers.image.description=Debian $suite minbase (debootstrap)" "$container"
  "${buildah[@]}" commit --quiet --rm "$container" "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  log "base image $base ready in $((SECONDS - started)) s"
}

ca_bundle() {
  if [[ -n ${FAIRSERVE_CA_BUNDLE:-} ]]; then
    echo "$FAIRSERVE_CA_BUNDLE"
  elif [[ -n ${PIP_CERT:-} ]]; then
    echo "$PIP_CERT"
  elif compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null \
       && [[ -s /etc/ssl/certs/ca-certificates.crt ]]; then
    echo /etc/ssl/certs/ca-certificates.crt
  fi
}

build_cpu() {
  local started=$SECONDS bundle args=()
  bundle=$(ca_bundle)
  if [[ -n $bundle ]]; then
    [[ -s $bundle ]] || die "CA bundle $bundle is missing or empty"
    args+=(--secret "id=ca-bundle,src=$bundle")
  fi
  local previous
  previous=$("${buildah[@]}" images --quiet --no-trunc "$image" 2>/dev/null || true)
  log "building $image from deploy/images/Containerfile.cpu ..."
  "${buildah[@]}" bud --isolation chroot --layers \
    --file deploy/images/Containerfile.cpu \
    --ignorefile deploy/images/build-context.ignore \
    --build-arg "BASE_IMAGE=$base" \
    --build-context "wheels=$wheels" \
    "${args[@]}" \
    --build-arg "FAIRSERVE_VERSION=$version" \
    --tag "$image" . >&2
  log "built $image in $((SECONDS - started)) s"
  # The image this one replaced, with the cached steps only it used, goes (buildah removes an
  # image's untagged parents with it, not those the new image shares): with vfs every layer is
  # a full copy of the file system, GBs each.
  if [[ -n $previous && $previous != "$("${buildah[@]}" images --quiet --no-trunc "$image")" ]]; then
    "${buildah[@]}" rmi "$previous" >/dev/null || log "warning: could not remove the previous image $previous"
  fi
  "${buildah[@]}" images "$image" >&2
}

check_tools
make_base
build_cpu
echo "$image"
