#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/^port = 8080$/port = 9090/' config.ini
