#!/bin/sh
# Stage 0 of routing-basics: address the server's link to the router, with no route back to
# the client's network, and say so on the page the image's httpd serves from /www.
set -eu

ip link set eth1 up
ip route del 10.10.1.0/24 2>/dev/null || true
ip addr flush dev eth1
ip addr add 10.10.2.10/24 dev eth1

mkdir -p /www
cat > /www/index.html <<'HTML'
<!doctype html>
<html>
  <head><title>server</title></head>
  <body>
    <h1>server, 10.10.2.10</h1>
    <p>Stage 0: no route back to 10.10.1.0/24 yet, so the client cannot fetch this page.</p>
  </body>
</html>
HTML
