#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/river/dune/g' tundra.txt
