#!/usr/bin/env bash
# Build a local Python base image from Debian packages, for machines that cannot pull
# python:3.11-slim from a container registry but can reach Debian's packages and PyPI.
#
#   deploy/podman/build-base-image.sh            # prints the image name on its last line
#   podman build --build-arg BASE_IMAGE=localhost/ctxproxy-base:bookworm -t ctxproxy .
#
# The image is the host's Debian release (mmdebstrap, or debootstrap as a fallback) with the
# distribution's python3, python3-venv and python3-pip. It trusts what the host trusts: the host's
# extra CA certificates (/usr/local/share/ca-certificates) are copied in, so pip inside `podman build`
# works behind the same TLS-intercepting egress as the host. Cached: the image stays in podman's
# store and its tarball in $CTXPROXY_CHECK_CACHE (default ~/.cache/ctxproxy-check), so it is paid
# once per machine. FORCE=1 rebuilds.
#
# Environment: CONTAINERS_CONF (default: deploy/podman/containers.conf beside this script),
# BASE_SOURCES (apt sources files for the image; default: the host's Debian sources).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
. /etc/os-release
codename="${VERSION_CODENAME:?cannot tell the host Debian release from /etc/os-release}"
image="localhost/ctxproxy-base:${codename}"
cache="${CTXPROXY_CHECK_CACHE:-$HOME/.cache/ctxproxy-check}"
tarball="$cache/ctxproxy-base-${codename}.tar"
mkdir -p "$cache"

if [ "${FORCE:-0}" != 1 ] && podman image exists "$image"; then
  echo "$image"
  exit 0
fi
if [ "${FORCE:-0}" = 1 ] || [ ! -s "$tarball" ]; then
  sources=()
  if [ -n "${BASE_SOURCES:-}" ]; then
    read -r -a sources <<<"$BASE_SOURCES"
  else
    [ -s /etc/apt/sources.list ] && grep -q '^deb ' /etc/apt/sources.list && sources+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] && grep -qi debian "$f" && sources+=("$f")
    done
  fi
  pkgs=python3,python3-venv,python3-pip,ca-certificates,passwd
  hooks=(
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-include=/usr/share/locale/locale.alias'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"'
    --customize-hook='for c in /usr/local/share/ca-certificates/*.crt; do [ -f "$c" ] && cp "$c" "$1/usr/local/share/ca-certificates/"; done; true'
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1'
    # pip in a venv uses its own certifi bundle unless told to use the system's (which now holds the host's CAs)
    --customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" > "$1/etc/pip.conf"'
    --customize-hook='rm -rf "$1/var/lib/apt/lists/"* "$1/var/cache/apt/"*.bin'
  )
  tmp="$cache/ctxproxy-base-${codename}.partial.tar"  # mmdebstrap picks the format from the suffix
  rm -rf "$tmp"
  if command -v mmdebstrap >/dev/null; then
    mmdebstrap --quiet --variant=apt --include="$pkgs" "${hooks[@]}" "$codename" "$tmp" "${sources[@]}"
  elif command -v debootstrap >/dev/null; then
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include="$pkgs" "$codename" "$root" >/dev/null
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$root" update-ca-certificates >/dev/null 2>&1
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
    rm -rf "$root/var/lib/apt/lists/"* "$root/var/cache/apt/"*.bin
    tar -C "$root" -cf "$tmp" .
  else
    echo "neither mmdebstrap nor debootstrap is installed (apt-get install mmdebstrap)" >&2
    exit 3
  fi
  mv "$tmp" "$tarball"
fi
podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "$image" >/dev/null
echo "$image"
