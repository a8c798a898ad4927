#!/bin/bash
# Build and smoke-test the Specgate image without a container daemon (buildah, vfs storage,
# chroot isolation), on a Debian bookworm host whose only reachable sources are the Debian
# mirror and PyPI (no container registry): the python:3.11-slim-bookworm base is replaced by
# a debootstrap of bookworm with Debian's python3.11.
#
#   apt-get install -y buildah debootstrap
#   deploy/image/build-daemonless.sh            # from the repository root, as root
#
# PIP_CONF: a pip.conf for the build (e.g. local wheel mirrors); CA_BUNDLE: the CA bundle
# that verifies PyPI through this network's proxy (pip.conf: cert = /tmp/host-ca.crt);
# EXTRA_MOUNTS: directories the pip.conf names (wheel mirrors), bind-mounted read-only;
# TINY_MODEL: a model directory (world-readable) to start the server on.
set -euo pipefail
WORK=${WORK:-/tmp/specgate-image}
PIP_CONF=${PIP_CONF:-}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
TAG=${TAG:-localhost/specgate:0.1.0-cpu}
B="buildah --storage-driver vfs"
mkdir -p "$WORK"

# 1. The base image, from the Debian mirror.
rm -rf "$WORK/rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
  bookworm "$WORK/rootfs" http://deb.debian.org/debian
cat > "$WORK/rootfs/etc/apt/sources.list" <<SRC
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SRC
rm -rf "$WORK/rootfs/var/lib/apt/lists/"* "$WORK/rootfs/var/cache/apt/archives/"*.deb
tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
ctr=$($B from scratch)
$B add "$ctr" "$WORK/rootfs.tar" /
$B config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd python3 "$ctr"
$B commit --rm "$ctr" localhost/debian-python:3.11-bookworm

# 2. The image, from the committed tree (what `git archive` gives, not the work tree).
rm -rf "$WORK/context" && mkdir "$WORK/context"
git archive HEAD | tar -x -C "$WORK/context"
mounts=(-v "$CA_BUNDLE:/tmp/host-ca.crt:ro")
if [ -n "$PIP_CONF" ]; then mounts+=(-v "$PIP_CONF:/etc/pip.conf:ro"); fi
# TORCH_INDEX_URL: where torch comes from when download.pytorch.org is not reachable.
if [ -n "${TORCH_INDEX_URL:-}" ]; then mounts+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"); fi
for dir in ${EXTRA_MOUNTS:-}; do mounts+=(-v "$dir:$dir:ro"); done
(cd "$WORK/context" && $B bud --format docker --isolation chroot --network host --layers=false \
  "${mounts[@]}" --build-arg BASE_IMAGE=localhost/debian-python:3.11-bookworm \
  -f Dockerfile -t "$TAG" .)
$B images "$TAG"

# 3. Smoke test as the image's user: the CLI, then a server on a tiny model and its probes.
ctr=$($B from "$TAG")
trap '$B rm "$ctr" >/dev/null' EXIT
$B run --isolation chroot "$ctr" -- id
$B run --isolation chroot "$ctr" -- specgate serve --help > /dev/null && echo "serve --help: ok"
if [ -n "${TINY_MODEL:-}" ]; then
  $B copy "$ctr" "$TINY_MODEL" /srv/tiny > /dev/null
  $B run --isolation chroot --network host "$ctr" -- sh -c '
    specgate serve --target /srv/tiny --host 127.0.0.1 --port 18000 > /tmp/serve.log 2>&1 &
    pid=$!
    probe() { python -c "import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:18000/$1\", timeout=4).read().decode())"; }
    for i in $(seq 1 120); do probe healthz > /dev/null 2>&1 && break; sleep 1; done
    probe healthz && probe readyz && echo "server uid: $(stat -c %u /proc/$pid)"
    kill $pid; wait $pid || true'
fi
