#!/bin/sh
# Stage 0 of netcat-toolbox: web's end of the link, and the page its httpd serves from /www.
set -eu

ip link set eth1 up
ip addr flush dev eth1
ip addr add 10.30.0.2/24 dev eth1

mkdir -p /www
cat > /www/index.html <<'HTML'
<!doctype html>
<html>
  <head><title>web</title></head>
  <body><h1>Fetched by hand</h1><p>If nc printed this, you spoke HTTP yourself.</p></body>
</html>
HTML
