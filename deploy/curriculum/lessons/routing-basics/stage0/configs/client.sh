#!/bin/sh
# Stage 0 of routing-basics: address the client's link to the router, with no route beyond it.
# Every stage sets the whole state from scratch, so stages can be entered in any order.
set -eu

ip link set eth1 up
ip route del 10.10.2.0/24 2>/dev/null || true
ip addr flush dev eth1
ip addr add 10.10.1.10/24 dev eth1
