#!/bin/sh
# What a learner does on the web tab in stage 0 of netcat-toolbox: change the page's heading.
set -eu
sed -i 's|<h1>.*</h1>|<h1>Hello, learner</h1>|' /www/index.html
