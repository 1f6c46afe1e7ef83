#!/bin/sh
# The check of routing-basics stage 0: the client reaches the server, 10.10.2.10, across the
# router. It passes once the learner has added both routes (the client's to 10.10.2.0/24 and
# the server's back to 10.10.1.0/24); what it prints is what the learner reads.
if ! ip route get 10.10.2.10 2>/dev/null | grep -q 'via 10.10.1.1'; then
    echo "The client has no route to 10.10.2.0/24 through the router (10.10.1.1)."
    echo "Try: ip route add 10.10.2.0/24 via 10.10.1.1 (on the client tab)"
    exit 1
fi
if ! ping -c 1 -W 2 10.10.2.10 >/dev/null 2>&1; then
    echo "The client's route is there, but 10.10.2.10 does not answer: the replies have no"
    echo "way back. Add the server's route to 10.10.1.0/24 through 10.10.2.1 (server tab)."
    exit 1
fi
echo "The client reaches 10.10.2.10 through the router."
