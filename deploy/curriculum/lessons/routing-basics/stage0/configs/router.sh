#!/bin/sh
# Stage 0 of routing-basics: the router's address on each link. Both networks are directly
# connected, so it needs no routes; the image turns IP forwarding on.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.10.1.1/24 dev eth1

ip link set eth2 up
ip addr flush dev eth2
ip addr add 10.10.2.1/24 dev eth2
