#!/bin/sh
# Stage 1 of netcat-toolbox: web's end of the link, and a page pointing at this stage's tasks.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.30.0.2/24 dev eth1

mkdir -p /www
cat > /www/index.html <<'HTML'
<!doctype html>
<html>
  <head><title>web</title></head>
  <body><h1>Port 8080 is open</h1><p>Now open port 9000 with <code>nc -l -p 9000</code>.</p></body>
</html>
HTML
