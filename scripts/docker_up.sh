#!/usr/bin/env bash
# Makes sure a Docker Engine answers on /var/run/docker.sock: installs docker.io when dockerd is
# missing and starts it without a bridge network (sandboxes run with --network none).
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
if ! command -v dockerd >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q docker.io debootstrap >/dev/null
fi
command -v debootstrap >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
mkdir -p /var/log
nohup dockerd --bridge=none --iptables=false >/var/log/polar-dockerd.log 2>&1 &
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "docker_up.sh: dockerd did not answer within 60 s; last log lines:" >&2
tail -n 20 /var/log/polar-dockerd.log >&2
exit 1
