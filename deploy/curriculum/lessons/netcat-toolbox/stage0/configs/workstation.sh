#!/bin/sh
# Stage 0 of netcat-toolbox: the workstation's end of the link to web. The connection has no
# subnet, so the lesson addresses it itself.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.30.0.1/24 dev eth1
