#!/usr/bin/env bash
# Make sure `kubectl` (with its built-in kustomize) is installed, to render k8s/ in the tests.
# Quick when it is there; otherwise installs Debian's kubernetes-client (needs root and apt-get).
set -euo pipefail
if command -v kubectl >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "k8s-tools: installing kubernetes-client (kubectl)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    kubernetes-client >/dev/null
  command -v kubectl >/dev/null 2>&1 && exit 0
fi
echo "k8s-tools: kubectl is missing; install it (Debian: apt-get install kubernetes-client)" \
     "to render and check k8s/" >&2
exit 1
