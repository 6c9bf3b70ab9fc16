#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/tundra/apple/g' river.txt
