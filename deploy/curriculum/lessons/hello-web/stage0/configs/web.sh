#!/bin/sh
# Stage 0 of hello-web: publish the welcome page that the image's httpd serves from /www.
set -eu

mkdir -p /www
cat > /www/index.html <<'HTML'
<!doctype html>
<html>
  <head><title>Hello, Web</title></head>
  <body>
    <h1>Hello from Antidote</h1>
    <p>This page was written by <code>stage0/configs/web.sh</code> when the lesson started.</p>
  </body>
</html>
HTML
