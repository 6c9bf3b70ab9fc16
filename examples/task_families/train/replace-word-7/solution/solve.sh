#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/tundra/ember/g' pine.txt
