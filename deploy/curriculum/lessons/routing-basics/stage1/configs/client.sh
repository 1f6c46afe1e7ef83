#!/bin/sh
# Stage 1 of routing-basics: the client's address, plus a route to the server's network
# through the router. Only that network: the default route stays on eth0, the management
# network through which the learner's terminal reaches this endpoint.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.10.1.10/24 dev eth1
ip route replace 10.10.2.0/24 via 10.10.1.1 dev eth1
