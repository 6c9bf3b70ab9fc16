#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/iris/willow/g' cobalt.txt
