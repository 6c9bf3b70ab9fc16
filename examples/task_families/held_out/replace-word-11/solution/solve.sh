#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/nutmeg/birch/g' cobalt.txt
