#!/bin/sh
# The check of netcat-toolbox stage 0, run on the workstation: the web server's page, fetched
# by hand across the link, says hello to the learner. It passes once the learner has changed
# the heading of /www/index.html on web to "Hello, learner".
answer=$(printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 10.30.0.2 8080 2>&1)
case "$answer" in
HTTP/*) ;;
*)
    echo "The workstation gets no HTTP answer from 10.30.0.2:8080: $answer"
    exit 1
    ;;
esac
if ! printf '%s' "$answer" | grep -q '<h1>Hello, learner</h1>'; then
    echo "The page the workstation fetches has the heading:"
    printf '%s\n' "$answer" | grep -o '<h1>.*</h1>' || echo "(no <h1> heading)"
    echo "Change it to <h1>Hello, learner</h1> in /www/index.html on the web tab."
    exit 1
fi
echo "The page across the link says hello to you."
