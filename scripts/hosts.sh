#!/usr/bin/env bash
# Several hosts on one Linux machine: network namespaces joined by a bridge, each with its own address on its own
# `eth0` (as a Kubernetes pod has), so a Ray cluster, the collective and S3 / MLflow traffic between them cross real
# links that can be cut. Needs root and iproute2. The tests (tests/netns_hosts.py) make theirs with this script.
#
#   scripts/hosts.sh up NAME N [SUBNET]   NAME-br with SUBNET.1/24 in this namespace (where SeaweedFS and MLflow
#                                          listen), hosts NAME-h0 .. NAME-h{N-1} at SUBNET.10, SUBNET.11, ...
#                                          (default SUBNET 10.231.0); prints each host's namespace and address
#   scripts/hosts.sh down NAME            kill every process in NAME's hosts, delete them and the bridge
#   scripts/hosts.sh kill NAME I          kill -9 every process of host I (a preempted node)
#   scripts/hosts.sh cut NAME I           take host I's link down (a partition); its processes keep running
#   scripts/hosts.sh mend NAME I          bring host I's link back up
#   scripts/hosts.sh run NAME I CMD...    run CMD on host I (ip netns exec)
#
# NAME is at most 8 letters or digits (interface names are limited to 15 characters). No host gets a default route:
# traffic stays between these hosts and the bridge address.
set -euo pipefail

usage() { sed -n '2,16p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1 name=$2
[[ $name =~ ^[a-z0-9]{1,8}$ ]] || { echo "hosts.sh: NAME must be 1-8 lowercase letters or digits, got '$name'" >&2; exit 2; }
bridge=$name-br

hosts() { ip netns list | awk '{print $1}' | grep -E "^$name-h[0-9]+$" | sort -V || true; }

kill_host() {
    local pids
    pids=$(ip netns pids "$1" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}

case $cmd in
up)
    [ $# -ge 3 ] || usage
    n=$3 subnet=${4:-10.231.0}
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || { echo "hosts.sh: N must be 1-200" >&2; exit 2; }
    "$0" down "$name" >/dev/null 2>&1 || true
    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
    for ((i = 0; i < n; i++)); do
        ns=$name-h$i
        ip netns add "$ns"
        ip link add "$name-v$i" type veth peer name eth0 netns "$ns"
        ip link set "$name-v$i" master "$bridge" up
        ip -n "$ns" addr add "$subnet.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        echo "$ns $subnet.$((10 + i))"
    done
    ;;
down)
    for ns in $(hosts); do kill_host "$ns"; done
    for ns in $(hosts); do ip netns del "$ns"; done
    # a namespace lives on while anything still holds it (its veth pair with it): delete our ends of the links
    for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^$name-v[0-9]+$" || true); do
        ip link del "$link" 2>/dev/null || true
    done
    ip link del "$bridge" 2>/dev/null || true
    ;;
kill) [ $# -eq 3 ] || usage; kill_host "$name-h$3" ;;
cut) [ $# -eq 3 ] || usage; ip link set "$name-v$3" down ;;
mend) [ $# -eq 3 ] || usage; ip link set "$name-v$3" up ;;
run) [ $# -ge 4 ] || usage; i=$3; shift 3; exec ip netns exec "$name-h$i" "$@" ;;
*) usage ;;
esac
