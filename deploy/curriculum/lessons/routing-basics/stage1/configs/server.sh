#!/bin/sh
# Stage 1 of routing-basics: the server's address, a route back to the client's network
# through the router, and a page that says the client can now reach it.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.10.2.10/24 dev eth1
ip route replace 10.10.1.0/24 via 10.10.2.1 dev eth1

mkdir -p /www
cat > /www/index.html <<'HTML'
<!doctype html>
<html>
  <head><title>server</title></head>
  <body>
    <h1>server, 10.10.2.10</h1>
    <p>Stage 1: routed. Fetch this page from the client with
       <code>printf 'GET / HTTP/1.0\r\n\r\n' | nc 10.10.2.10 8080</code>.</p>
  </body>
</html>
HTML
